"""The ``kvtriton`` command (``kvtriton.cli``): ``simulate`` writes its JSON and table, and bad
input wherever a user reaches the command line is one clear line on stderr, exit code 2.

What a user can type or feed: kv-cache-tester and Mooncake files that are malformed, truncated,
corrupt, nested without end or carry a bad continuation hint, through every subcommand that reads
a trace; block sizes that do not divide the trace's or do not fit the model; out-of-range and
malformed arguments; sizes too large for the machine; folders without traces; and output paths
that cannot be written (refused before the run, not after it). The loaders' own messages are
checked in ``tests/sim/test_traces.py``.
"""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

import pytest

from kvtriton.cli import main
from kvtriton.sim import data_path

MOONCAKE = str(data_path("mooncake_synthetic_trace.jsonl"))
CC = str(data_path("cc_agentic_sample"))
GLM5 = str(data_path("glm5_sample.jsonl"))
SMALL = ["--conversations", "1", "--turns", "1", "1", "--system-prompt", "64", "--quiet"]


def run(argv, capsys) -> str:
    """Run the CLI; it must fail with exit code 2 and exactly one line on stderr."""
    assert main(argv) == 2, f"exit code for {argv}"
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("kvtriton: error: "), err
    assert "Traceback" not in err
    return err


def req(t=0.0, n_in=100, out=5, ids=(1, 2), model="m", **extra):
    return {"t": t, "type": "n", "model": model, "in": n_in, "out": out,
            "hash_ids": list(ids), **extra}


def conv_doc(requests, block_size=64, **extra):
    return {"id": "conv", "block_size": block_size, "requests": requests, **extra}


# ---- simulate: JSON and table --------------------------------------------------------------------


def test_cli_simulate_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--conversations", "3", "--turns", "2", "3", "--gpu-tokens", "4096",
               "--cpu-tokens", "8192", "--setups", "eager,eager+restore+tail", "--json", str(out),
               "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "eager+restore+tail" in text and "hit rate" in text
    doc = json.loads(out.read_text())
    assert [r["setup"] for r in doc["rows"]] == ["eager", "eager+restore+tail"]


def test_the_old_policies_flag_warns_and_runs_the_same_setups(tmp_path, capsys):
    """``--policies`` (the flag's old name) is an alias of ``--setups`` that warns once; a bad
    setup through it is the same one-line error."""
    args = ["simulate", "--conversations", "3", "--turns", "2", "3", "--gpu-tokens", "4096",
            "--cpu-tokens", "8192", "--quiet", "--no-bound"]
    assert main([*args, "--setups", "eager", "--json", str(tmp_path / "new.json")]) == 0
    capsys.readouterr()
    assert main([*args, "--policies", "eager", "--json", str(tmp_path / "old.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --policies is now --setups") == 1
    new, old = (json.loads((tmp_path / n).read_text())["rows"] for n in ("new.json", "old.json"))
    assert [r["setup"] for r in old] == ["eager"]
    assert old[0]["token_hit_rate"] == new[0]["token_hit_rate"]
    assert main(["simulate", "--policies", "nope"]) == 2
    assert "unknown setup 'nope'" in capsys.readouterr().err


def test_cli_shows_rejected_requests(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--conversations", "3", "--turns", "2", "3", "--gpu-blocks", "230",
                 "--cpu-blocks", "1000", "--setups", "eager", "--quiet", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "9 requests (8 rejected: larger than the GPU; hit rates and the bound cover the " \
           "others)" in text
    doc = json.loads(out.read_text())
    assert doc["conditions"]["rejected"] == doc["rows"][0]["rejected"] == 8
    assert (doc["bound"]["requests"], doc["bound"]["rejected"]) == (1, 8)


# ---- kv-cache-tester and Mooncake traces through the CLI -----------------------------------------


TESTER_BAD = {
    "missing-model": (conv_doc([req(), {k: v for k, v in req(t=1).items() if k != "model"}]),
                      "requests[1]: missing field 'model'"),
    "negative-in": (conv_doc([req(n_in=-4)]), "requests[0]: field 'in' must be an int >= 1"),
    "negative-out": (conv_doc([req(out=-1)]), "requests[0]: field 'out' must be an int >= 0"),
    "string-time": (conv_doc([req(t="soon")]), "requests[0]: field 't' must be a finite"),
    "time-goes-back": (conv_doc([req(t=5), req(t=2)]), "requests[1]: t=2 is before"),
    "nested-time-goes-back": (
        conv_doc([req(), {"t": 1, "type": "subagent", "requests": [req(t=3), req(t=1)]}]),
        "requests[1].requests[1]: t=1 is before"),
    "subagent-not-a-list": (conv_doc([{"t": 0, "type": "subagent", "requests": "x"}]),
                            "requests[0]: field 'requests' must be a list"),
    "request-not-an-object": (conv_doc([req(), 7]), "requests[1]: expected a JSON object"),
    "huge-hash-id": (conv_doc([req(ids=(2 ** 70,))]), "does not fit in 64 bits"),
    "no-block-size": ({"requests": [req()]}, "top level: missing field 'block_size'"),
    "zero-block-size": (conv_doc([req()], block_size=0), "'block_size' must be an int >= 1"),
    "no-requests": (conv_doc([]), "no requests"),
    "top-level-list": ([req()], "expected a JSON object with 'requests', got list"),
}


@pytest.mark.parametrize("command", ["trace-stats", "simulate", "replay"])
@pytest.mark.parametrize("case", list(TESTER_BAD))
def test_malformed_tester_trace(tmp_path, capsys, case, command):
    doc, message = TESTER_BAD[case]
    path = tmp_path / "conv.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    argv = ["trace-stats", str(path)] if command == "trace-stats" else [
        command, "--workload", str(path), "--quiet"]
    err = run(argv, capsys)
    assert f"error: {path}" in err and message in err


@pytest.mark.parametrize("name, content, message", [
    ("c.json.gz", gzip.compress(json.dumps(conv_doc([req()])).encode())[:-6], "bad gzip data"),
    ("c.json.gz", b"\x1f\x8b\x08\x00garbage", "bad gzip data"),
    ("c.json.gz", gzip.compress(b""), "empty file"),
    ("c.json", b"", "empty file"),
    ("c.json", b'{\n  "block_size": 64,\n  "requests": [,]\n}', "c.json:3: bad JSON"),
    ("c.json", b"\x80\x81 not text", "not UTF-8"),
    ("c.json", (json.dumps(req()) + "\n" + json.dumps(req()) + "\n").encode(),
     "a Mooncake JSONL trace?"),
    ("c.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("c.data", b'{"requests": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("t.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "t.jsonl:1: bad JSON: nested too deeply"),
    ("t.jsonl", b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n'
     b'{"timestamp": 1, "input_length": 600, "output_length": 1, '
     b'"hash_ids": [99999999999999999999999]}\n', "t.jsonl:2: hash_ids[0]=9999"),
    ("t.jsonl", b'{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": []}\n',
     "t.jsonl:1: field 'timestamp' must be a finite number"),
    ("t.jsonl", b'{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": []}\n',
     "t.jsonl:1: field 'input_length' must be an int >= 1"),
    ("t.jsonl.gz", gzip.compress(b'{"timestamp": 0}\n'), "t.jsonl.gz:1: missing field"),
], ids=["truncated-gzip", "corrupt-gzip", "empty-gzip", "empty", "bad-json-line", "binary",
        "jsonl-in-json", "nested-array", "nested-sniffed", "nested-jsonl-line", "huge-id",
        "nan-time", "float-length", "gzip-jsonl-missing-field"])
def test_unreadable_trace_files(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    err = run(["trace-stats", str(path)], capsys)
    assert str(path) in err and message in err


def test_subagents_nested_without_end(tmp_path, capsys):
    depth = 2000  # deeper than the interpreter's recursion limit
    marker = '{"t": 0, "type": "subagent", "requests": ['
    nested = marker * depth + json.dumps(req()) + "]}" * depth
    path = tmp_path / "deep.json"
    path.write_text('{"block_size": 64, "requests": [' + nested + "]}")
    err = run(["trace-stats", str(path)], capsys)
    assert str(path) in err and "nested too deeply" in err


def test_folders_without_traces(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    others = tmp_path / "others"
    others.mkdir()
    (others / "notes.txt").write_text("not a trace")
    for folder in (empty, others):
        for argv in (["trace-stats", str(folder)], ["simulate", "--workload", str(folder)],
                     ["replay", "--workload", str(folder)]):
            err = run(argv, capsys)
            assert f"{folder}: no *.json or *.json.gz trace in this folder" in err


def test_a_bad_file_in_a_folder_is_named(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(conv_doc([req()])))
    (tmp_path / "b.json").write_text(json.dumps(conv_doc([req(), req(t=-1)])))
    err = run(["trace-stats", str(tmp_path)], capsys)
    assert f"{tmp_path / 'b.json'}: requests[1]: field 't'" in err


@pytest.mark.parametrize("name, content, where", [
    ("t.jsonl", "", "empty"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1}\n', ":1:"),
    ("t.jsonl", '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n', ":2:"),
    ("t.jsonl", '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}\n',
     ":1:"),
    ("t.jsonl", "not json at all\n", ":1: bad JSON"),
    ("t.txt", "not json at all\n", "not a Mooncake"),
], ids=["empty", "missing-field", "time-goes-back", "negative-length", "bad-json",
        "wrong-format"])
def test_cli_bad_trace_names_file_and_line(tmp_path, capsys, name, content, where):
    path = tmp_path / name
    path.write_text(content)
    assert main(["trace-stats", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and where in err


# ---- continuation hints through the CLI ----------------------------------------------------------


def treq(t: float = 0.0, **extra) -> dict:
    return {"t": t, "type": "n", "model": "m", "in": 128, "out": 10, "hash_ids": [1, 2],
            "think_time": 0.0, **extra}


def write_json(path: Path, doc) -> Path:
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


@pytest.mark.parametrize("command", ["simulate", "replay", "trace-stats"])
@pytest.mark.parametrize("fmt", ["tester-stop", "tester-unknown-stop", "mooncake-hint"])
def test_cli_bad_hint_is_one_line_and_exit_2(tmp_path, capsys, fmt, command):
    if fmt == "mooncake-hint":
        path = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": "soon"}])
        message = ":2: field 'hint' must be null or one of ('continue', 'close'), got 'soon'"
    elif fmt == "tester-stop":
        path = write_json(tmp_path / "c.json.gz", conv_doc([treq(stop=7)]))
        message = ": requests[0]: field 'stop' must be a string, got 7"
    else:
        path = write_json(tmp_path / "c.json.gz", conv_doc([treq(), treq(t=1, stop="halt")]))
        message = ": requests[1]: field 'stop' is not a known stop reason: 'halt'"
    argv = (["trace-stats", str(path)] if command == "trace-stats"
            else [command, "--workload", str(path), "--quiet"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtriton: error: "), err
    assert "Traceback" not in err
    assert f"{path}{message}" in err


# ---- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--gpu-tokens", "0"], "--gpu-tokens: '0' must be positive"),
    (["simulate", "--gpu-tokens", "x"], "is not an integer"),
    (["simulate", "--setups", "nope"], "unknown setup 'nope'"),
    (["simulate", "--model", "gpt5"], "invalid choice"),
    (["simulate", "--gpu-tokens", "8", "--gpu-gib", "1"], "give one of"),
    (["simulate", "--workload", "/no/such/trace.jsonl"], "no such file"),
    (["replay", "--evictions", "fifo"], "fifo"),
    (["trace-stats", "/no/such/file"], "no such file"),
    ([], "required: command"),
], ids=["zero", "not-int", "setup", "model", "two-units", "missing-file", "replay-eviction",
        "stats-missing", "no-command"])
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtriton: error:")
    assert message in err


ARG_ERRORS = {
    "block-size-vs-mooncake": (["replay", "--workload", "mooncake", "--block-size", "48"],
                               "hash_block_size=48 does not divide the trace block size 512"),
    "block-size-vs-tester": (["simulate", "--workload", "cc_agentic", "--block-size", "48",
                              "--quiet"], "does not divide the trace block size 64"),
    "block-size-vs-stats": (["trace-stats", MOONCAKE, "--block-size", "96"],
                            "hash_block_size=96 does not divide the trace block size 512"),
    "block-size-bigger": (["trace-stats", CC, "--block-size", "128"],
                          "hash_block_size=128 does not divide the trace block size 64"),
    "block-size-zero": (["simulate", "--block-size", "0"], "--block-size: '0' must be positive"),
    "block-size-negative": (["replay", "--block-size", "-16"], "--block-size: '-16' must be"),
    "block-size-vs-model": (["simulate", "--model", "nemotron-h-8b", "--block-size", "48", *SMALL],
                            "--block-size 48 does not fit --model nemotron-h-8b"),
    "turns-reversed": (["simulate", "--turns", "5", "3"], "--turns 5 3: MIN must not exceed MAX"),
    "turns-zero": (["simulate", "--turns", "0", "3"], "--turns: '0' must be positive"),
    "turns-one-value": (["simulate", "--turns", "5"], "--turns: expected 2 arguments"),
    "think-negative": (["simulate", "--think-s", "-1"], "--think-s: '-1' must be a finite"),
    "think-nan": (["simulate", "--think-s", "nan"], "--think-s: 'nan' is not a number ("),
    "think-word": (["replay", "--think-s", "long"], "--think-s: 'long' is not a number"),
    "seed-negative": (["simulate", "--seed", "-1"], "--seed: '-1' must be >= 0"),
    "time-scale-zero": (["simulate", "--time-scale", "0"], "--time-scale: '0' must be a positive"),
    "time-scale-negative": (["replay", "--time-scale", "-2"], "--time-scale: '-2' must be"),
    "time-scale-inf": (["simulate", "--time-scale", "inf"], "--time-scale: 'inf' is not a"),
    "time-scale-overflow": (["simulate", "--time-scale", "1e400"], "--time-scale: '1e400' must be"),
    "capacities-word": (["replay", "--capacities", "lots"], "--capacities: 'lots' is not an int"),
    "capacities-mixed": (["replay", "--capacities", "1024,x"], "--capacities: 'x' is not an int"),
    "capacities-negative": (["replay", "--capacities", "1024,-5"], "'-5' must be positive"),
    "capacities-empty": (["replay", "--capacities", " , "], "expected a comma-separated list"),
    "capacities-float": (["replay", "--capacities", "10.5"], "'10.5' is not an integer"),
    "limit-zero": (["simulate", "--limit", "0"], "--limit: '0' must be positive"),
    "conversations-zero": (["simulate", "--conversations", "0"], "'0' must be positive"),
    "token-budget-zero": (["simulate", "--token-budget", "0"], "--token-budget: '0'"),
    "max-running-negative": (["simulate", "--max-running", "-1"], "--max-running: '-1'"),
    "unknown-model": (["simulate", "--model", "llama-9000"], "--model: invalid choice"),
    "unknown-gpu": (["simulate", "--gpu", "Z80"], "--gpu: invalid choice"),
    "unknown-backend": (["simulate", "--integrity-backend", "cuda"], "invalid choice: 'cuda'"),
    "unknown-command": (["simulte"], "invalid choice: 'simulte'"),
    "unknown-flag": (["replay", "--capacity", "10"], "unrecognized arguments: --capacity"),
    "empty-setups": (["simulate", "--setups", ","], "expected a comma-separated list"),
    "eager-hinted": (["simulate", "--setups", "eager+hinted"],
                     "'hinted' admission needs 'lazy'"),
    "gpu-below-a-block": (["simulate", "--gpu-tokens", "8", *SMALL],
                          "GPU must be at least one block, got 8 -> 0 blocks"),
    "cpu-gib-below-a-block": (["simulate", "--cpu-gib", "0.000000001", *SMALL],
                              "CPU must be at least one block"),
    "gib-overflow": (["simulate", "--gpu-gib", "1e300"], "--gpu-gib: '1e300' GiB is too large"),
    "gib-zero": (["simulate", "--cpu-gib", "0"], "--cpu-gib: '0' must be a positive"),
    "cpu-two-units": (["simulate", "--cpu-tokens", "64", "--cpu-blocks", "4"], "give one of"),
    "blocks-beyond-memory": (["simulate", "--gpu-blocks", "1e15", "--no-bound", *SMALL],
                             "GPU 1,000,000,000,000,000 blocks, CPU 4,000,000,000,000,000 blocks: "
                             "the simulator's block pools need about"),
    "integrity-beyond-memory": (["simulate", "--gpu-blocks", "1e12", "--integrity", "--no-bound",
                                 *SMALL], "GPU 1,000,000,000,000 blocks, CPU 4,000,000,000,000 "
                                 "blocks: the simulator's block pools and integrity tensors need"),
    "cpu-blocks-beyond-memory": (["simulate", "--cpu-blocks", "1e15", "--no-bound", *SMALL],
                                 "CPU 1,000,000,000,000,000 blocks: the simulator's block pools"),
    "every-request-rejected": (["simulate", "--gpu-blocks", "1", *SMALL],
                               "every request would be rejected (1 of 1): the smallest needs"),
    "stats-missing-file": (["trace-stats"], "the following arguments are required: file"),
    "workload-name-typo": (["replay", "--workload", "moooncake"], "moooncake: no such file"),
    "glm5-file-at-512": (["trace-stats", GLM5], "give the trace's block size: trace_block_size, "
                                                "--trace-block-size"),
    "trace-block-size-of-a-name": (["trace-stats", "glm5", "--trace-block-size", "256"],
                                   "'glm5' is a shipped trace that knows its block size"),
    "trace-block-size-of-a-workload": (["simulate", "--workload", "glm5", "--trace-block-size",
                                        "256"], "'glm5' is a shipped trace"),
    "trace-block-size-of-a-tester": (["trace-stats", CC, "--trace-block-size", "256"],
                                     "a kv-cache-tester trace names its own block size"),
}


def test_shipped_traces_by_name_and_a_file_with_its_block_size(capsys):
    assert main(["trace-stats", "glm5", "--block-size", "64"]) == 0
    by_name = capsys.readouterr().out
    assert "requests                 500" in by_name and "hash_block_size          64" in by_name
    assert main(["trace-stats", GLM5, "--trace-block-size", "256", "--block-size", "64"]) == 0
    assert capsys.readouterr().out == by_name


@pytest.mark.parametrize("case", list(ARG_ERRORS))
def test_bad_arguments(capsys, case):
    argv, message = ARG_ERRORS[case]
    err = run(argv, capsys)
    assert message in err


def test_capacity_that_fits_a_float_but_not_this_machine(capsys, monkeypatch):
    # 3e8 GPU blocks with integrity tensors: refused up front, before torch's allocator is asked,
    # with the value and the machine's memory (fixed here, so the case does not depend on the
    # machine running the test).
    # The module, not the function kvtriton.sim exports under the same name.
    sim_module = importlib.import_module("kvtriton.sim.simulate")

    monkeypatch.setattr(sim_module, "machine_memory_bytes", lambda: 64 << 30)
    err = run(["simulate", "--gpu-blocks", "3e8", "--cpu-blocks", "64", "--integrity",
               "--no-bound", *SMALL], capsys)
    assert "GPU 300,000,000 blocks, CPU 64 blocks" in err
    assert "more than this machine's 64.0 GiB of memory" in err


def test_trace_request_too_long_for_memory(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 10**15,
                                "hash_ids": [1]}) + "\n")
    err = run(["simulate", "--workload", str(path), "--quiet", "--no-bound"], capsys)
    assert "out of memory" in err


@pytest.mark.parametrize("command", ["simulate", "replay", "trace-stats"])
def test_unwritable_output_is_refused_before_the_run(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "result.json"
    argv = {"simulate": ["simulate", *SMALL], "replay": ["replay", "--workload", MOONCAKE,
                                                         "--quiet"],
            "trace-stats": ["trace-stats", MOONCAKE]}[command]
    err = run([*argv, "--json", str(out)], capsys)
    assert f"--json {out}: cannot write there" in err
    assert capsys.readouterr().out == ""  # nothing ran
    folder = tmp_path / "folder"
    folder.mkdir()
    err = run([*argv, "--json", str(folder)], capsys)
    assert "is a folder" in err


def test_plot_path_is_checked_too(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = run(["replay", "--workload", MOONCAKE, "--quiet", "--plot", str(blocker / "x.png")],
              capsys)
    assert "--plot" in err and "cannot write there" in err


# ---- numbers too large, names twice, unwritable outputs, odd paths, endless files ----------------


def test_time_too_large_for_a_float(tmp_path, capsys):
    huge = "1" + "0" * 400  # an int JSON allows and no float holds
    moon = tmp_path / "t.jsonl"
    moon.write_text(f'{{"timestamp": {huge}, "input_length": 10, "output_length": 1, '
                    '"hash_ids": []}\n')
    tester = tmp_path / "c.json"
    tester.write_text(json.dumps(conv_doc([req()])).replace('"t": 0.0', f'"t": {huge}'))
    think = tmp_path / "k.json"
    think.write_text(json.dumps(conv_doc([req(), req(t=1)])).replace(
        '"hash_ids": [1, 2]}]', f'"hash_ids": [1, 2], "think_time": {huge}}}]'))
    for path, field in ((moon, "timestamp"), (tester, "t"), (think, "think_time")):
        for argv in (["trace-stats", str(path)], ["replay", "--workload", str(path), "--quiet"],
                     ["simulate", "--workload", str(path), "--quiet", "--no-bound"]):
            err = run(argv, capsys)
            assert f"field '{field}' must be a finite number" in err and "characters)" in err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--block-size", "2.5e0"], "--block-size: '2.5e0' is not an integer"),
    (["simulate", "--seed", "1.5e0"], "--seed: '1.5e0' is not an integer"),
    (["replay", "--capacities", "1e3.5"], "'1e3.5' is not an integer"),
    (["simulate", "--setups", "eager,eager"], "eager listed more than once"),
    (["replay", "--evictions", "lru,belady,lru"], "lru listed more than once"),
    (["replay", "--workload", "mooncake", "--capacities", "100"],
     "--capacities 100: not a whole number of 16-token blocks (use 96 or 112)"),
    (["replay", "--workload", "mooncake", "--block-size", "512", "--capacities", "100"],
     "not a whole number of 512-token blocks"),
    (["simulate", "--conversations", "1e12"], "more than the generator's limit"),
], ids=["float-block-size", "float-seed", "bad-exponent", "setup-twice", "eviction-twice",
        "capacity-not-whole-blocks", "capacity-below-a-block", "too-many-conversations"])
def test_nonsense_is_refused(capsys, argv, message):
    assert message in run(argv, capsys)


def test_integer_flags_still_take_exponents(capsys):
    assert main(["simulate", "--block-size", "1.6e1", *SMALL, "--gpu-tokens", "4e3",
                 "--cpu-tokens", "8192", "--setups", "eager", "--no-bound"]) == 0
    assert "1 requests" in capsys.readouterr().out


# ---- one number syntax for flags and setups; lists without holes (issue 50, item 5) -------------

#: Whole numbers as a user may spell them: the setup grammar's syntax takes the first five.
WHOLE_TAKEN = ["1000", "1e3", "1.0e3", "1000.", "0.1e4"]
WHOLE_REFUSED = ["1E3", "1_000", "0x3e8", "\u0661\u0660\u0660\u0660", "inf", "1e", "1000 "]


def _flag_takes(flag: str, text: str) -> bool:
    from kvtriton.cli import build_parser

    try:
        build_parser().parse_args(["simulate", flag, text])
    except Exception:  # the parser's one-line usage error (_UsageError)
        return False
    return True


def _setup_takes(text: str) -> bool:
    from kvtriton.setups import tier_setup

    try:
        tier_setup(f"eager+lfu:{text}+sessions:{text}")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("text", WHOLE_TAKEN + WHOLE_REFUSED)
def test_integer_flags_and_setup_numbers_take_the_same_spellings(text):
    taken = text in WHOLE_TAKEN
    assert _setup_takes(text) is taken
    for flag in ("--sync-load-budget", "--store-blocks", "--gpu-tokens", "--seed"):
        assert _flag_takes(flag, text) is taken, flag


@pytest.mark.parametrize(("argv", "message"), [
    (["--sync-load-budget", "1e+6"], "argument --sync-load-budget: '1e+6' is not an integer ("),
    (["--store-blocks", "1E6"], "argument --store-blocks: '1E6' is not an integer ("),
    (["--gpu-tokens", "1_000"], "argument --gpu-tokens: '1_000' is not an integer ("),
    (["--think-s", "1e-3"], "argument --think-s: '1e-3' is not a number ("),
    (["--seed", "-0"], "argument --seed: '-0' is not an integer ("),
    (["--gpu-tokens", "1e19"], "argument --gpu-tokens: '1e19' is too large"),
    (["--gpu-blocks", "1e999999999"], "argument --gpu-blocks: '1e999999999' is too large"),
    (["--setups", "eager+sessions:1E3"], "setup axis 'sessions:1E3': the idle time must be"),
    (["--setups", "eager+lfu:1e+9"], "setup axis 'lfu:1e': the window must be"),
], ids=["signed-exponent", "capital-e", "underscore", "float-negative-exponent", "minus-zero",
        "int-past-64-bits", "huge-exponent", "setup-capital-e", "setup-signed-exponent"])
def test_a_misspelt_number_names_the_flag_or_axis_and_the_syntax(capsys, argv, message):
    err = run(["simulate", *SMALL, "--no-bound", *argv], capsys)  # small, should it run
    assert message in err
    if "too large" not in err:
        assert "no sign or space: 1000, 0.5, 1e3" in err


def test_exponents_run_in_setups_and_flags_alike(capsys):
    assert main(["simulate", *SMALL, "--gpu-tokens", "4e3", "--cpu-tokens", "8.192e3",
                 "--sync-load-budget", "1e6", "--setups", "eager+sessions:1e3,eager+lfu:1.6e1",
                 "--no-bound"]) == 0
    out = capsys.readouterr().out
    assert "eager+sessions:1000 " in out and "eager+lfu " in out  # the canonical names


def test_store_blocks_without_a_shared_setup_is_refused(capsys):
    for setups in (["--setups", "eager,lazy+hints"], []):  # [] : the default setups
        err = run(["simulate", *SMALL, "--no-bound", "--store-blocks", "1000", *setups], capsys)
        assert "--store-blocks 1000: no setup in --setups has 'shared'" in err


def test_store_blocks_with_a_shared_setup_runs(capsys):
    assert main(["simulate", *SMALL, "--store-blocks", "1e3", "--setups", "eager,eager+shared",
                 "--gpu-tokens", "4096", "--cpu-tokens", "8192", "--no-bound"]) == 0
    assert "eager+shared" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--setups", "eager+sessions,,lazy"],
     "--setups: 'eager+sessions,,lazy': entry 2 of 3 is empty"),
    (["simulate", "--setups", "eager,"], "--setups: 'eager,': entry 2 of 2 is empty"),
    (["simulate", "--setups", ",eager, ,lazy"], "entry 1, 3 of 4 is empty"),
    (["replay", "--capacities", "1024,,2048"], "--capacities: '1024,,2048': entry 2 of 3"),
    (["replay", "--evictions", "lru,"], "--evictions: 'lru,': entry 2 of 2 is empty"),
], ids=["setups-inner", "setups-trailing", "setups-two", "capacities", "evictions"])
def test_an_empty_list_entry_is_named(capsys, argv, message):
    assert message in run(argv, capsys)


def test_a_session_idle_time_past_a_day_is_refused(capsys):
    err = run(["simulate", *SMALL, "--no-bound", "--setups", "eager+sessions:99999999999"],
              capsys)
    assert "setup axis 'sessions:99999999999': the idle time must be seconds in (0, 86400]" in err


def test_an_unknown_axis_value_lists_every_axis_value(capsys):
    from kvtriton.setups import AXES

    err = run(["simulate", "--setups", "eager+fancy"], capsys)
    known = err.rstrip("\n").rstrip(")").partition("known: ")[2].split(", ")
    assert known == [v for axis in AXES for v in axis.values]


def test_output_that_cannot_be_written_fails(capsys):
    for flag in ("--plot", "--json"):
        err = run(["replay", "--workload", "mooncake", "--limit", "3", "--capacities", "1024",
                   "--quiet", flag, "/dev/full"], capsys)
        assert f"{flag} /dev/full: cannot write" in err


def test_newline_in_a_path_stays_one_line(tmp_path, capsys):
    err = run(["trace-stats", str(tmp_path / "a\nb.jsonl")], capsys)
    assert "a\\nb.jsonl" in err


@pytest.mark.parametrize("block_size", [32, 128])
def test_trace_stats_uses_the_tester_files_own_block_size(tmp_path, capsys, block_size):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(conv_doc([req(n_in=300, ids=(1, 2, 3))], block_size=block_size)))
    assert main(["trace-stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert any(line.split() == ["hash_block_size", str(block_size)] for line in out.splitlines())


def test_tester_files_with_different_block_sizes(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(conv_doc([req()], block_size=64)))
    (tmp_path / "b.json").write_text(json.dumps(conv_doc([req()], block_size=32)))
    err = run(["trace-stats", str(tmp_path)], capsys)
    assert "block_size 32 differs from 64" in err
    assert main(["trace-stats", str(tmp_path), "--block-size", "32"]) == 0


def test_unreadable_folder_is_not_an_empty_one(tmp_path, capsys, monkeypatch):
    import os

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "listdir", refuse)  # root reads any folder, so refusal is simulated
    err = run(["trace-stats", str(tmp_path)], capsys)
    assert f"{tmp_path}: cannot read folder: Permission denied" in err


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_endless_files_are_capped(capsys, monkeypatch, device):
    from kvtriton.sim import load_kv_cache_tester, load_mooncake, traces

    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 1 << 20)
    for load in (load_mooncake, load_kv_cache_tester):
        with pytest.raises(ValueError, match=r"larger than 1,048,576 bytes.*MAX_TRACE_BYTES"):
            load(device)
    err = run(["trace-stats", device], capsys)  # told apart by its first 64 KiB, not read whole
    assert device in err
