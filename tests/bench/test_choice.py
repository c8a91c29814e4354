"""``bench.choice``: the one rule every study chooses on train by, and the part reader."""

import pytest

from bench.choice import choose_on_train, figures


def _row(name, train, test, whole=0.0):
    return {"name": name, "hit": whole,
            "parts": {"train": {"hit": train, "p90": 1.0}, "test": {"hit": test, "p90": 1.0}}}


ROWS = [_row("a", 0.2, 0.9), _row("b", 0.5, 0.1), _row("c", 0.5, 0.8, whole=0.7)]


def test_highest_objective_on_train_ties_first():
    assert choose_on_train(ROWS, lambda f: f["hit"])["name"] == "b"


def test_constraint_sees_train_figures_and_none_when_nothing_qualifies():
    assert choose_on_train(ROWS, lambda f: f["hit"], lambda f: f["hit"] < 0.3)["name"] == "a"
    assert choose_on_train(ROWS, lambda f: f["hit"], lambda f: f["hit"] > 1.0) is None
    assert choose_on_train([], lambda f: f["hit"]) is None


def test_whole_run_when_part_is_none():
    assert choose_on_train(ROWS, lambda f: f["hit"], part=None)["name"] == "c"


def test_figures_reads_a_part_or_the_whole_run_and_a_missing_part_is_a_key_error():
    assert figures(ROWS[0], "test") == {"hit": 0.9, "p90": 1.0}
    assert figures(ROWS[0], None) is ROWS[0]
    with pytest.raises(KeyError):
        figures({"hit": 0.1}, "train")
    with pytest.raises(KeyError):
        choose_on_train([{"hit": 0.1}], lambda f: f["hit"])
