"""``bench/planner/scaling.py`` and the kvtriton side of ``bench/vllm/vs_vllm.py`` (its variants in
``vs_vllm_variants.py``): the per-step CPU eviction (``--eviction lru``, the pool's next victims;
``random``, the former uniform draw), short runs of both CLIs on tiny scenarios, and the one-line
exit-2 answer to bad arguments.

Results go to a temporary folder: a test run must never overwrite ``bench/results/``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import bench.common
from bench.planner import scaling
from bench.planner.scenarios import VARIANTS, Scenario, evict_cpu_blocks

TINY = ["--sizes", "2", "--blocks", "8", "--steps", "3"]


@pytest.fixture
def results(tmp_path, monkeypatch):
    """``write_result`` into ``tmp_path``, without asking git for the sha."""
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "test")
    return tmp_path


def _cached(pool) -> list[int]:
    return [b for b in pool.iter_free() if pool.block_hash(b) is not None]


def _tiny(eviction: str, seed: int = 3) -> Scenario:
    return Scenario(VARIANTS["fused_restore"], 2, 8, steps=6, evict_fraction=0.25, seed=seed,
                    eviction=eviction)


def test_lru_evicts_the_head_of_the_pools_eviction_order():
    sc = _tiny("lru")
    for _ in range(2):  # past the initial store: stores and re-stores have reordered the queue
        sc.step()
    cached = _cached(sc.cpu)
    n = int(len(cached) * 0.25)
    assert n >= 2
    victims = sc.evict()
    assert victims == cached[:n]
    assert all(sc.cpu.block_hash(b) is None for b in victims)
    assert all(sc.cpu.block_hash(b) is not None for b in cached[n:])
    # Unhashed now, so the next allocations take them first; the survivors keep their order.
    assert set(list(sc.cpu.iter_free())[:n]) == set(victims)
    assert _cached(sc.cpu) == cached[n:]
    sc.cpu.check_invariants()


def test_random_is_the_former_uniform_draw():
    sc = _tiny("random", seed=5)
    cached = _cached(sc.cpu)
    n = int(len(cached) * 0.25)
    expected = np.random.default_rng(5).choice(cached, size=n, replace=False).tolist()
    assert sc.evict() == expected
    assert expected != cached[:n]  # this seed does differ from LRU, so the test tells them apart


def test_evict_cpu_blocks_refuses_unknown_modes():
    sc = _tiny("lru")
    with pytest.raises(ValueError, match="eviction must be one of"):
        evict_cpu_blocks(sc.cpu, 0.5, "fifo")
    with pytest.raises(ValueError, match="needs an rng"):
        evict_cpu_blocks(sc.cpu, 0.5, "random")
    with pytest.raises(ValueError, match="eviction must be one of"):
        Scenario(VARIANTS["fused_restore"], 1, 4, 1, 0.1, seed=0, eviction="LRU")


@pytest.mark.parametrize("mode", ["lru", "random"])
def test_short_run(results, capsys, mode):
    payload = scaling.main([*TINY, "--evict", "0.25", "--eviction", mode, "--out", "p"])
    out = capsys.readouterr().out
    assert f"eviction {mode}" in out.splitlines()[0]
    doc = json.loads((results / "p.json").read_text())
    assert doc["conditions"]["eviction"] == mode == payload["conditions"]["eviction"]
    assert {r["eviction"] for r in doc["rows"]} == {mode}
    assert len(doc["rows"]) == 2 * len(VARIANTS)  # no eviction and 25%, one size
    evicting = {r["variant"]: r for r in doc["rows"] if r["evict_fraction"] == 0.25}
    assert evicting["fused_restore"]["restores_per_step"] > 0
    assert evicting["fused_control"]["restores_per_step"] == 0


def test_default_is_lru(results, capsys):
    doc = scaling.main([*TINY, "--out", "p"])
    assert doc["conditions"]["eviction"] == "lru"
    assert "eviction lru" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--eviction", "fifo"], "argument --eviction: invalid choice: 'fifo'"),
    (["--eviction"], "argument --eviction: expected one argument"),
    (["--evict", "1.5"], "--evict must be a fraction in [0, 1], got 1.5"),
    (["--evict", "-0.1"], "--evict must be a fraction in [0, 1]"),
])
def test_bad_arguments_exit_2_with_one_line(results, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        scaling.main([*TINY, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m bench.planner.scaling: error: "), err
    assert message in err
    assert not list(results.iterdir())


# ---- bench_vs_vllm's kvtriton side -------------------------------------------------------------


def test_vs_vllm_kvt_side_is_the_planner_scenario_with_lru():
    from bench.vllm import vs_vllm_variants

    sc = vs_vllm_variants.KvtScenario("kvt_fused_restore", 2, 8, steps=4, evict_fraction=0.25)
    assert isinstance(sc, Scenario) and sc.eviction == "lru"
    assert sc.planner.config.cpu_free_order == "head_first"
    ref = Scenario(vs_vllm_variants.KVT_CONFIGS["kvt_fused_restore"], 2, 8, steps=4,
                   evict_fraction=0.25, seed=0, eviction="lru")
    for _ in range(4):
        dt, stored, parts = sc.step()
        r = ref.advance()
        assert dt >= 0 and stored == r.planned == r.stored + r.restored
        # The parts split the timed build and nothing else: they add up to it.
        assert set(parts) == set(vs_vllm_variants.PARTS) and parts["adapter"] == 0
        assert sum(parts.values()) == pytest.approx(dt)
        assert all(parts[p] >= 0 for p in ("tables", "selection", "cpu_alloc", "pin"))
    assert list(sc.cpu.iter_free()) == list(ref.cpu.iter_free())


def test_vs_vllm_short_run(results, capsys):
    pytest.importorskip("vllm")
    from bench.vllm import vs_vllm, vs_vllm_variants

    payload = vs_vllm.main(["--sizes", "2", "128", "--blocks", "8", "16", "--steps", "3",
                                  "--evict", "0.25", "--variants", "vllm_control",
                                  "kvt_fused_restore", "kvt_connector_fused_restore"])
    assert payload["settings"]["eviction_order"] == "lru"
    assert payload["settings"]["blocks_per_request"] == [8, 16]
    rows = {(r["variant"], r["requests"], r["blocks_per_request"]): r for r in payload["rows"]}
    assert {v for v, _, _ in rows} == {"vllm_control", "kvt_fused_restore",
                                      "kvt_connector_fused_restore"}
    # With LRU eviction and re-store, the planner and the connector re-store the same blocks.
    assert rows["kvt_fused_restore", 2, 8]["stored_per_step"] == \
        rows["kvt_connector_fused_restore", 2, 8]["stored_per_step"] > 2
    for row in rows.values():
        assert set(row["parts_ms"]) == set(vs_vllm_variants.PARTS)
    assert rows["kvt_connector_fused_restore", 2, 8]["parts_ms"]["adapter"] > 0
    assert rows["vllm_control", 2, 8]["parts_ms"]["selection"] > 0
    # Targets at R = 128 only (not 256: not run), for both block counts, and the block scaling.
    names = {(t["name"], t["requests"], t["blocks_per_request"]) for t in payload["targets"]}
    assert ("fused_restore_over_vllm_control", 128, 8) in names
    assert ("connector_over_planner_restore", 128, 16) in names
    assert ("blocks_8_to_16_kvt_fused_restore", 128, "8->16") in names
    assert not {n for n in names if n[1] != 128}
    assert all(isinstance(t["met"], bool) for t in payload["targets"])
    # Past 4,096 blocks of 16 tokens a request outgrows 64K tokens: the model length follows.
    assert vs_vllm.max_model_len(8192, 20, 3) >= (8192 + 43) * 16
    assert (results / "vs_vllm.json").exists()
    assert all(row["interleaved_with"] == ["vllm_control", "kvt_fused_restore",
                                           "kvt_connector_fused_restore"]
               for row in rows.values())


def test_vs_vllm_another_setting_writes_a_file_of_its_own(results, capsys):
    """``--name`` writes another setting beside the default run's file, which stays as it is;
    a name that is not a plain file stem is one line and exit 2, before anything runs."""
    pytest.importorskip("vllm")
    from bench.vllm import vs_vllm

    (results / "vs_vllm.json").write_text("{}")
    for bad in ("../x", "a.json", ""):
        with pytest.raises(SystemExit) as e:
            vs_vllm.main(["--name", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--name: letters, digits and _ only" in err
    vs_vllm.main(["--sizes", "2", "--blocks", "8", "--steps", "2", "--warmup", "1",
                        "--evict", "0.25", "--variants", "vllm_control", "kvt_fused_restore",
                        "--name", "vs_vllm_other"])
    doc = json.loads((results / "vs_vllm_other.json").read_text())
    assert doc["settings"]["evict_fraction"] == 0.25 and len(doc["rows"]) == 2
    assert (results / "vs_vllm.json").read_text() == "{}"


def test_vs_vllm_a_size_past_the_memory_bound_runs_in_groups(results, capsys):
    """Past ``--max-blocks-held`` the variants run in groups, each interleaved on its own; every
    row names its group, and the ratios to vLLM's variants are still computed across groups."""
    pytest.importorskip("vllm")
    from bench.vllm import vs_vllm

    payload = vs_vllm.main(["--sizes", "2", "4", "--blocks", "8", "--steps", "2",
                                  "--max-blocks-held", "64", "--variants", "vllm_control",
                                  "kvt_fused_restore", "kvt_connector_fused_restore",
                                  "vllm_rescan_restore"])
    assert payload["settings"]["grouped"] == [{"requests": 4, "blocks_per_request": 8}]
    with_ = {(r["variant"], r["requests"]): r["interleaved_with"] for r in payload["rows"]}
    everyone = ["vllm_control", "kvt_fused_restore", "kvt_connector_fused_restore",
                "vllm_rescan_restore"]
    assert all(with_[v, 2] == everyone for v in everyone)
    # 4 x 8 = 32 blocks per variant, 64 in all: two variants a group, in packing order.
    assert with_["vllm_control", 4] == with_["kvt_fused_restore", 4] == [
        "vllm_control", "kvt_fused_restore"]
    assert with_["kvt_connector_fused_restore", 4] == with_["vllm_rescan_restore", 4] == [
        "kvt_connector_fused_restore", "vllm_rescan_restore"]
    assert vs_vllm.groups(["vllm_rescan_restore", "vllm_control"], 4, 8, 16) == [
        ["vllm_control"], ["vllm_rescan_restore"]]  # one a group at least, even past the bound
    row = next(r for r in payload["rows"]
               if (r["variant"], r["requests"]) == ("kvt_connector_fused_restore", 4))
    assert row["x_vs_vllm_control"] > 0 and row["x_vs_vllm_rescan_restore"] > 0
    assert "the variants in groups" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        vs_vllm.main(["--max-blocks-held", "0"])
    assert exc.value.code == 2


def test_evictions_per_request_change_as_many_blocks_at_every_block_count():
    """``evict_per_request`` evicts that many blocks per running request, whatever the blocks
    held: the block-count target compares steps that change as many blocks."""
    counts = []
    for blocks in (8, 32):
        sc = Scenario(VARIANTS["fused_restore"], 3, blocks, steps=4, evict_fraction=0.5,
                      seed=0, evict_per_request=2)
        sc.step()
        counts.append(sc.step()[3])  # a step's re-stores: its evictions, all still running
        cached = _cached(sc.cpu)
        assert sc.evict() == cached[:6]  # 2 per request, the LRU head, not half of them
    assert counts == [6, 6]
    with pytest.raises(ValueError, match="evict_per_request must be >= 0"):
        Scenario(VARIANTS["fused_restore"], 1, 4, 1, 0.1, seed=0, evict_per_request=-1)


def test_the_setup_stores_every_block_once():
    """The scenario's batched set-up (one ``cache_blocks`` per request) leaves every GPU block
    hashed under its request's key and copied to the CPU, as one call per block did."""
    sc = Scenario(VARIANTS["fused_restore"], 2, 8, steps=2, evict_fraction=0.0, seed=0)
    for req, table in zip(sc.reqs, sc.tables, strict=True):
        assert [sc.gpu.block_hash(b) for b in table] == req.keys[0, :8].tolist()
        assert all(int(k) in sc.cpu for k in req.keys[0, :8])
    sc.step()
    for req, table in zip(sc.reqs, sc.tables, strict=True):
        assert sc.gpu.block_hash(table[-1]) == int(req.keys[0, 8])
    sc.cpu.check_invariants()
    sc.gpu.check_invariants()
