"""``bench.plots``: the study's gain figure draws what the paper cites."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from bench.plots import plot_gain_over_control


def _row(setup: str, hit: float, oracle: bool = False) -> dict:
    return {"setup": setup, "composition": setup, "oracle": oracle, "token_hit_rate": hit}


def test_gain_figure_draws_setups_over_the_control_with_the_bound(tmp_path):
    rows = [_row("eager", 0.5), _row("lazy", 0.48), _row("eager+arc", 0.52),
            _row("eager+nextuse", 0.6, oracle=True)]
    out = plot_gain_over_control([{"label": "CPU 1x", "rows": rows},
                                  {"label": "CPU 4x", "rows": rows}], tmp_path / "g.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_gain_figure_needs_the_control():
    with pytest.raises(ValueError, match="run 'x' has no 'eager' row"):
        plot_gain_over_control([{"label": "x", "rows": [_row("lazy", 0.4)]}], "/dev/null")


def test_decision_map_draws_every_cell(tmp_path):
    from bench.plots import plot_decision_map

    cells = [{"label": "agent 1x", "within_tier": 0.5, "queue_p50_s": 0.2, "winner": "lazy",
              "test_points": 4.2, "hinted": True},
             {"label": "Mooncake 1x", "within_tier": 0.12, "queue_p50_s": 18.0,
              "winner": None, "test_points": None, "hinted": False}]
    out = plot_decision_map(cells, tmp_path / "m.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
