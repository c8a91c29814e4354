"""The results manifest (``bench/results/MANIFEST.json``), the harness's table of studies
(``bench/studies.py``, ``python -m bench``) and the paper's check of its inputs.

Everything is written to a temporary folder: a test run must never touch ``bench/results/``.
"""

from __future__ import annotations

import json
import multiprocessing
import re
from pathlib import Path

import pytest

import bench.common
import paper.build
import paper.results
import paper.sections.provenance
from bench.__main__ import main as harness
from bench.common import MANIFEST, record_output, write_result, writing_as
from bench.studies import BY_NAME, NEEDS, STUDIES, always_written, writers

ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())["files"]


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A temporary results folder in place of ``bench/results/``."""
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_findings_are_written_with_the_rows_and_derived_again_without_a_run(results,
                                                                           monkeypatch):
    """A study's findings go into its file with its rows; ``derive_findings`` recomputes them
    from the rows on disk with the writer's own function, leaves the rows and the writer's
    entry as they were, and stamps when. A file whose findings were tampered with (or written
    by an older rule) gets the study's findings back."""
    from bench.planner import scaling

    rows = [{"variant": "fused_restore", "requests": 128, "restores_per_step": 2000,
             "median_ms": 3.0, "select_median_ms": 1.0}]
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234")
    with writing_as("bench.planner.scaling", ["--quick"]):
        path = write_result("planner", {"rows": rows}, results, scaling.findings)
    with writing_as("bench.planner.hole_demo", []):  # no findings function: left alone
        write_result("other", {"rows": [1]}, results)
    doc = json.loads(path.read_text())
    want = scaling.findings("planner", doc)
    assert doc["findings"] == want and want["bookkeeping"]["bookkeeping_ms"] == 2.0
    doc["findings"]["bookkeeping"]["bookkeeping_ms"] = 99.0
    path.write_text(json.dumps(doc))
    before = _manifest(results)
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "def5678")
    assert bench.common.derive_findings(results) == ["planner.json"]
    again = json.loads(path.read_text())
    assert again["findings"] == want and again["rows"] == rows
    after = _manifest(results)
    assert after["planner.json"]["writer"] == before["planner.json"]["writer"]
    assert after["planner.json"]["commit"] == "abc1234"
    assert after["planner.json"]["findings"]["commit"] == "def5678"
    assert after["other.json"] == before["other.json"]
    assert "findings" not in json.loads((results / "other.json").read_text())


def test_each_write_records_its_file_and_a_rewrite_changes_only_its_entry(results, monkeypatch):
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234+dirty")
    with writing_as("bench.bench_x", ["--quick"], via="python -m bench --only x"):
        a = write_result("a", {"rows": [1]}, results)
        write_result("b", {"rows": [2]}, results)
        (results / "b.png").write_bytes(b"png")
        fig = record_output(results / "b.png")
    files = _manifest(results)
    assert set(files) == {"a.json", "b.json", "b.png"}
    for entry in files.values():
        assert entry["writer"] == {"module": "bench.bench_x", "argv": ["--quick"],
                                   "command": "python -m bench.bench_x --quick",
                                   "via": "python -m bench --only x"}
        assert entry["commit"] == "abc1234" and entry["clean"] is False
        assert DATE.fullmatch(entry["date_utc"])
    doc = json.loads(a.read_text())
    assert doc["rows"] == [1] and doc["machine"]["git_sha"] == "abc1234+dirty"
    assert files["a.json"]["date_utc"] == doc["machine"]["date_utc"] and fig.name == "b.png"

    # A later run rewrites b only, at another commit with clean code, by another command.
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "def5678")
    with writing_as("bench.bench_y", []):
        write_result("b", {"rows": [3]}, results)
    after = _manifest(results)
    assert after["a.json"] == files["a.json"] and after["b.png"] == files["b.png"]
    assert after["b.json"]["commit"] == "def5678" and after["b.json"]["clean"] is True
    assert after["b.json"]["writer"] == {"module": "bench.bench_y", "argv": [],
                                         "command": "python -m bench.bench_y"}
    # No temporary file is left beside the results.
    assert {p.name for p in results.iterdir()} == {"a.json", "b.json", "b.png", MANIFEST}


def test_without_the_harness_the_writer_is_this_process(results, monkeypatch):
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "unknown")
    for name in ("outer.png", "plain.png"):
        (results / name).write_bytes(b"png")
    with pytest.raises(FileNotFoundError, match="no file"):
        record_output(results / "never_written.png")
    with writing_as("bench.outer", ["--full"]):
        with writing_as("bench.inner", []):
            pass
        record_output(results / "outer.png")
    record_output(results / "plain.png")
    files = _manifest(results)
    assert files["outer.png"]["writer"]["module"] == "bench.outer"
    assert "via" not in files["outer.png"]["writer"]
    assert files["plain.png"]["writer"]["module"] != "bench.outer"
    assert files["plain.png"]["commit"] == "unknown" and files["plain.png"]["clean"] is None


def test_a_subfolder_is_recorded_by_its_path_and_other_folders_are_not(results, tmp_path_factory,
                                                                      monkeypatch):
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234")
    write_result("kernel_check", {}, results / "gpu")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    write_result("kernel_check", {}, elsewhere)
    assert set(_manifest(results)) == {"gpu/kernel_check.json"}
    assert {p.name for p in elsewhere.iterdir()} == {"kernel_check.json"}


def _record_many(folder: str, worker: int) -> None:
    for i in range(10):
        path = Path(folder) / f"w{worker}_{i}.png"
        path.write_bytes(b"png")
        record_output(path)


def test_concurrent_writers_keep_every_entry(results, monkeypatch):
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234")
    ctx = multiprocessing.get_context("fork")  # the monkeypatched sha and folder go with it
    procs = [ctx.Process(target=_record_many, args=(str(results), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert set(_manifest(results)) == {f"w{w}_{i}.png" for w in range(4) for i in range(10)}


# ---- the table of studies ----------------------------------------------------------------------


def test_every_study_is_complete_and_names_a_main():
    assert len(BY_NAME) == len(STUDIES)
    for s in STUDIES:
        assert s.needs in NEEDS and s.writes and s.module.startswith("bench.")
        assert (ROOT / (s.module.replace(".", "/") + ".py")).exists(), s.module
        source = (ROOT / (s.module.replace(".", "/") + ".py")).read_text()
        assert "\ndef main(argv" in source, f"{s.module} has no main(argv)"


def _bench_imports(source: str) -> set[str]:
    """The ``bench`` modules ``source`` imports, by dotted name (``from bench.x import y`` gives
    both ``bench.x`` and ``bench.x.y``: either may be the module)."""
    names = set()
    for pkg, grouped, items in re.findall(
            r"^\s*from (bench(?:\.\w+)*) import (?:\(([^)]*)\)|([\w, ]+))", source, flags=re.M):
        items = grouped or items
        names.add(pkg)
        names.update(f"{pkg}.{item.split(' as ')[0].strip()}"
                     for item in items.split(",") if item.strip())
    return names


def test_studies_never_import_each_other():
    scripts = {s.module for s in STUDIES}
    for s in STUDIES:
        source = (ROOT / (s.module.replace(".", "/") + ".py")).read_text()
        assert not (_bench_imports(source) & scripts) - {s.module}, s.module


def test_the_quick_run_writes_every_input_the_paper_needs():
    for name in paper.results.INPUTS:
        assert writers(f"{name}.json"), f"no study writes {name}.json"
    from bench.tier_study.setups import FULL_MAPS
    assert paper.results.MAP_TAGS == FULL_MAPS
    required = {n for n in paper.results.INPUTS if always_written(f"{n}.json")}
    assert {"hole_demo", "planner", "kernel_check", "setups_agent", "replay_agent"} <= required
    # Only a GPU run, a full-size run, a study run by name or a machine without vLLM may leave
    # the paper an input short.
    assert set(paper.results.INPUTS) - required == {
        "bench_kernels", "setups_agent_full", "setups_cc_agentic_full",
        "setups_mooncake", "setups_mooncake_full", "setups_glm5_full",
        "restore_map_mooncake",
        "replay_cc_agentic", "vs_vllm", "vs_vllm_quick", "vs_vllm_evict_share", "vllm_engine",
        "tune_shares",
        "conversational_gap", "lfu_recency", "second_tier", "fleet", "vllm_predict", "sync_loads"}


def test_list_and_unknown_studies(capsys):
    assert harness(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^{s.name}\s+{re.escape(s.module)}\s", out, re.M) for s in STUDIES)
    for argv in (["--only", "planner,nope"], ["--only", ","]):
        with pytest.raises(SystemExit) as e:
            harness(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python -m bench: error: --only: ")


def test_a_named_study_runs_and_one_it_cannot_run_is_one_line(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU box
    assert harness(["--quick", "--only", "hole_demo,kernels"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert skipped == ["skipped: kernels: needs CUDA (no CUDA device on this machine)"]
    entry = _manifest(tmp_path)["hole_demo.json"]
    assert entry["writer"]["command"] == "python -m bench.planner.hole_demo"
    assert entry["writer"]["via"] == "python -m bench --quick --only hole_demo,kernels"


# ---- the paper's inputs ------------------------------------------------------------------------


def test_the_paper_stops_on_a_missing_input_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(paper.results, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as e:
        paper.build.main([])
    message = str(e.value)
    assert "\n" not in message and f"{tmp_path}/hole_demo.json" in message
    assert "bench_kernels" not in message  # a GPU run's file is not required


def test_the_paper_names_each_inputs_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(paper.results, "RESULTS", tmp_path)
    monkeypatch.setattr(bench.common, "_git_sha", lambda: "abc1234+dirty")
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    with writing_as("bench.planner.hole_demo", []):
        write_result("hole_demo", {}, tmp_path)
    # A file older than the manifest: its machine block says where it came from.
    (tmp_path / "planner.json").write_text(json.dumps(
        {"machine": {"git_sha": "0ld0ld0", "date_utc": "2026-01-01T00:00:00Z"}}))
    v: dict[str, str] = {}
    paper.sections.provenance.inputs_section(v)
    rows = {line.split(" | ")[0].strip("| `"): line for line in v["inputs_text"].splitlines()
            if line.startswith("| `")}
    assert "`python -m bench.planner.hole_demo` | `abc1234` | **no** |" in rows["hole_demo.json"]
    assert "not recorded | `0ld0ld0` | yes | 2026-01-01T00:00:00Z" in rows["planner.json"]
    assert "missing (`python -m bench --only setups` writes it)" in \
        rows["setups_agent.json"]
    assert "needs a CUDA device" in rows["bench_kernels.json"]
    assert "a longer run (`python -m bench --only mooncake_map`)" in \
        rows["restore_map_mooncake.json"]
    assert "full size only (`python -m bench --full --only setups`)" in \
        rows["setups_agent_full.json"]
    assert v["inputs_text"].startswith("The 2 results files behind this paper come from 2 "
                                       "commits")


def test_the_commit_is_read_once_before_any_study_runs(monkeypatch):
    # A run records the commit of the code it loaded: one made while it ran (a 20-minute study
    # writes its only result at the end) must not be recorded instead.
    import bench.common as common

    first = common._git_sha()
    monkeypatch.setattr(common, "git_sha", lambda *a, **k: "later00+dirty")
    assert common._git_sha() == first and common._git_sha.cache_info().misses == 1


def test_the_recorded_command_names_the_results_folder_from_the_clone(tmp_path, monkeypatch):
    # A run from a worktree's root once recorded /tmp/<worktree>/bench/results/...: a command
    # no other clone can run again.
    from bench.__main__ import _shown
    from bench.studies import BY_NAME

    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    shown = str(_shown(results))
    assert BY_NAME["tune_shares"].args(True, False, shown) == \
        ["--json", "bench/results/tune_shares.json"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # outside the clone the whole path is the only one that works
    assert _shown(results) == results


def test_every_writer_the_manifest_records_is_a_module_here():
    """``python -m bench --findings`` imports each results file's writer: a module moved
    without its manifest entry (bench/vllm/differential.py to bench/conformance/) stops it."""
    import importlib.util

    files = json.loads((bench.common.RESULTS_DIR / MANIFEST).read_text())["files"]
    modules = {e["writer"]["module"] for e in files.values() if e.get("writer", {}).get("module")}
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert modules and not missing, missing
