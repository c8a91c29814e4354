"""Trace loaders (``kvtriton.sim.traces``) on the shipped files (counts, block mapping, sub-agent
flattening), the continuation hints they read (kv-cache-tester ``stop``, Mooncake ``hint``), and
malformed input (each error names the file and the line or request), including odd file names,
line separators inside JSON strings and files without end."""

from __future__ import annotations

import functools
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

import kvtriton.sim.traces as traces_module
from kvtriton.sim import STOP_REASONS, Workload, trace_stats
from kvtriton.sim.traces import (
    CC_AGENTIC_SAMPLE,
    GLM5_BLOCK_SIZE,
    GLM5_SAMPLE,
    MOONCAKE_SYNTHETIC,
    TraceError,
    data_path,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
)

MOONCAKE = data_path(MOONCAKE_SYNTHETIC)
CC_DIR = data_path(CC_AGENTIC_SAMPLE)


@functools.cache
def raw_mooncake() -> list[dict]:
    return [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]


def mooncake_head(tmp_path: Path, n: int) -> Path:
    """The shipped Mooncake trace's first ``n`` lines, under the shipped file's name."""
    p = tmp_path / MOONCAKE.name
    p.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:n]))
    return p


def raw_tester(name: str) -> dict:
    return json.loads(gzip.decompress((CC_DIR / name).read_bytes()))


@pytest.fixture(scope="module")
def mooncake():
    return load_mooncake(MOONCAKE)


@pytest.fixture(scope="module")
def cc():
    return load_kv_cache_tester(CC_DIR)


# ---- shipped data ---------------------------------------------------------------------------


def test_shipped_files_and_manifest():
    assert MOONCAKE.is_file() and MOONCAKE.parent.name == "data"
    assert len(list(CC_DIR.glob("trace_*.json.gz"))) == 12
    manifest = data_path("MANIFEST.md").read_text()
    assert "Apache-2.0" in manifest and "kvcache-ai/Mooncake" in manifest
    with pytest.raises(FileNotFoundError, match="not among the shipped"):
        data_path("nope.jsonl")


# ---- Mooncake -------------------------------------------------------------------------------


def test_mooncake_counts_and_times(mooncake):
    raw = raw_mooncake()
    assert len(mooncake) == len(raw) == 3993
    assert mooncake[0].arrival_s == 0.0
    assert mooncake[-1].arrival_s == pytest.approx(raw[-1]["timestamp"] / 1000)
    for r, obj in zip(mooncake, raw, strict=True):
        assert (r.prompt_len, r.output_len) == (obj["input_length"], obj["output_length"])
        assert len(r.hashes) == r.total_len // 512
        assert r.session is None and r.after is None
    assert load_trace(MOONCAKE).hash_block_size == 512


@pytest.mark.parametrize(("b", "n"), [(512, 400), (128, 200), (16, 100)])
def test_mooncake_block_mapping_follows_shared_ids(tmp_path, b, n):
    raw = raw_mooncake()[:n]
    w = load_mooncake(mooncake_head(tmp_path, n), hash_block_size=b)
    r = 512 // b
    owner: dict[int, tuple[int, ...]] = {}  # key -> the trace ids of its prefix, sub-block
    key_of: dict[tuple[int, ...], int] = {}
    checked = 0
    for req, obj in zip(w, raw, strict=True):
        ids = obj["hash_ids"]
        n_prompt = req.prompt_len // b
        assert n_prompt == obj["input_length"] // b
        for j, key in enumerate(req.hashes[:n_prompt].tolist()):
            prefix = (*ids[: j // r + 1], j % r)
            assert owner.setdefault(key, prefix) == prefix  # equal key => equal ids prefix
            assert key_of.setdefault(prefix, key) == key  # equal ids prefix => equal key
            checked += 1
    assert checked > 5_000


def test_mooncake_output_blocks_are_unique(mooncake):
    prompt = set()
    output = []
    for r in mooncake:
        n = mooncake.num_prompt_blocks(r)
        prompt.update(r.hashes[:n].tolist())
        output.extend(r.hashes[n:].tolist())
    assert len(set(output)) == len(output)
    assert not prompt & set(output)


def test_mooncake_partial_last_block_gives_its_full_sub_blocks(tmp_path):
    raw = raw_mooncake()
    i = next(i for i, o in enumerate(raw) if o["input_length"] % 512 >= 256)
    w = load_mooncake(mooncake_head(tmp_path, i + 1), hash_block_size=256)
    n_ids = len(raw[i]["hash_ids"])
    assert w[i].prompt_len // 256 == 2 * (n_ids - 1) + 1


def test_shipped_glm5_sample():
    """The GLM-5 sample as shipped: 500 prefill requests over 22.4 s, every id of a full or
    partial 256-token block read, and a key shared exactly where the ids up to it are (the
    file's ids are prefix-consistent but for about 1%, which chaining keeps apart)."""
    path = data_path(GLM5_SAMPLE)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert "alibaba/tair-kvcache" in data_path("MANIFEST.md").read_text()
    w = load_trace(path, hash_block_size=64, trace_block_size=GLM5_BLOCK_SIZE)
    assert len(w) == len(raw) == 500 and w[0].arrival_s == 0.0
    assert w[-1].arrival_s == pytest.approx((raw[-1]["timestamp"] - raw[0]["timestamp"]) / 1000)
    assert all(r.output_len == 1 and r.session is None for r in w)
    first: dict[int, tuple[int, int]] = {}  # trace id -> (request, position) where first seen
    shared = apart = 0
    for i, (r, obj) in enumerate(zip(w, raw, strict=True)):
        ids = obj["block_ids"]
        assert len(ids) == -(-obj["input_length"] // GLM5_BLOCK_SIZE)
        for j, h in enumerate(ids[:r.prompt_len // GLM5_BLOCK_SIZE]):
            a, pos = first.setdefault(h, (i, j))
            if a == i or pos != j:
                continue
            k = 4 * j  # the first 64-token key of trace block j
            same = raw[a]["block_ids"][:j] == ids[:j]
            assert (r.hashes[k] == w[a].hashes[k]) == same
            shared += same
            apart += not same
    assert shared > 8000 and 0 < apart < shared / 50


def test_block_ids_spelling_and_unix_timestamps(tmp_path):
    """Alibaba's GLM-5 sample writes Mooncake's format with ``block_ids`` and Unix times in ms:
    the same requests as with ``hash_ids`` and times from 0, arrivals counted from the first."""
    t0 = 1780722000040.479
    lines = [{"timestamp": t0 + dt, "input_length": n, "output_length": 1, "block_ids": ids}
             for dt, n, ids in ((0.0, 586, [11, 12, 13]), (250.5, 798, [11, 12, 14, 15]),
                                (1000.0, 300, [21, 22]))]
    glm = tmp_path / "glm.jsonl"
    glm.write_text("".join(json.dumps(o) + "\n" for o in lines))
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"timestamp": o["timestamp"] - t0,
                                        "input_length": o["input_length"], "output_length": 1,
                                        "hash_ids": o["block_ids"]}) + "\n" for o in lines))
    a = load_trace(glm, hash_block_size=64, trace_block_size=256)
    b = load_mooncake(same, hash_block_size=64, trace_block_size=256)
    assert [r.arrival_s for r in a] == pytest.approx([0.0, 0.2505, 1.0])
    assert [r.arrival_s for r in a] == pytest.approx([r.arrival_s for r in b])
    # Namespaces differ by file name: compare the sharing, not the key values.
    pa, pb = (r.hashes[:r.prompt_len // 64].tolist() for r in (a[1], b[1]))
    assert a[0].hashes[:8].tolist() == pa[:8] and b[0].hashes[:8].tolist() == pb[:8]
    assert pa[8:] != a[0].hashes[8:len(pa)].tolist()
    # 300 tokens at 256 per id: at most 2 ids, and the name in the message is the file's own.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**lines[2], "block_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(TraceError, match=r"3 block_ids for a 300-token prompt"):
        load_trace(bad, trace_block_size=256)
    with pytest.raises(ValueError, match="trace_block_size=256 is for Mooncake"):
        load_trace(CC_DIR, trace_block_size=256)


def test_namespace_by_file_and_model(tmp_path):
    line = json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 0,
                       "hash_ids": [1, 2]})
    (tmp_path / "a.jsonl").write_text(line + "\n")
    (tmp_path / "b.jsonl").write_text(line + "\n")
    a, b = load_mooncake(tmp_path / "a.jsonl"), load_mooncake(tmp_path / "b.jsonl")
    assert not set(a[0].hashes.tolist()) & set(b[0].hashes.tolist())
    m1 = load_mooncake(tmp_path / "a.jsonl", model="m1")
    assert not set(a[0].hashes.tolist()) & set(m1[0].hashes.tolist())
    assert a[0].hashes.tolist() == load_mooncake(tmp_path / "a.jsonl")[0].hashes.tolist()


# ---- kv-cache-tester ------------------------------------------------------------------------


def count_requests(items: list) -> int:
    return sum(count_requests(o["requests"]) if o.get("type") == "subagent" else 1
               for o in items)


def test_tester_counts(cc):
    files = sorted(CC_DIR.glob("*.json.gz"))
    expected = sum(count_requests(raw_tester(f.name)["requests"]) for f in files)
    assert len(cc) == expected == 863
    assert len({r.request_id for r in cc}) == len(cc)
    assert [r.arrival_s for r in cc] == sorted(r.arrival_s for r in cc)
    for r in cc:
        assert len(r.hashes) == r.total_len // 64


def test_tester_subagents_flattened(cc):
    raw = raw_tester("trace_0274.json.gz")
    markers = [(i, o) for i, o in enumerate(raw["requests"]) if o["type"] == "subagent"]
    assert [len(o["requests"]) for _, o in markers] == [11, 13, 24]
    by_id = {r.request_id: r for r in cc}
    for i, marker in markers:
        session = f"trace_0274/{marker['agent_id']}"
        subs = [r for r in cc if r.session == session]
        assert len(subs) == len(marker["requests"])
        for j, obj in enumerate(marker["requests"]):
            r = by_id[f"trace_0274#{i}.{j}"]
            assert r.arrival_s == pytest.approx(marker["t"] + obj["t"])
            assert r.model == obj["model"] == "claude-haiku-4-5-20251001"
            assert r.after == (None if j == 0 else f"trace_0274#{i}.{j - 1}")
            assert r.prompt_len == obj["in"]
    parents = [r for r in cc if r.session == "trace_0274"]
    assert len(parents) == len(raw["requests"]) - len(markers)
    # the parent's next request after the markers follows its previous one
    kinds = [o["type"] for o in raw["requests"]]
    i = markers[0][0]
    nxt = next(k for k in range(i, len(kinds)) if kinds[k] != "subagent")
    assert kinds[i - 1] != "subagent"
    assert by_id[f"trace_0274#{nxt}"].after == f"trace_0274#{i - 1}"


def test_tester_closed_loop_fields(cc):
    raw = raw_tester("trace_0002.json.gz")["requests"]
    r0, r1 = (next(r for r in cc if r.request_id == f"trace_0002#{i}") for i in (0, 1))
    assert r0.after is None and r0.think_s == 0.0
    assert r1.after == "trace_0002#0" and r1.think_s == raw[1]["think_time"]
    assert r1.session == "trace_0002"


def test_tester_ids_are_local_to_a_file(cc):
    # trace_0002 and trace_0039 both start with ids [1, 2, 3, 4]: no key in common.
    a = next(r for r in cc if r.request_id == "trace_0002#0")
    b = next(r for r in cc if r.request_id == "trace_0039#0")
    assert raw_tester("trace_0002.json.gz")["requests"][0]["hash_ids"][:4] == [1, 2, 3, 4]
    assert raw_tester("trace_0039.json.gz")["requests"][0]["hash_ids"][:4] == [1, 2, 3, 4]
    assert not set(a.hashes.tolist()) & set(b.hashes.tolist())
    # consecutive turns of one conversation share their common id prefix
    c = next(r for r in cc if r.request_id == "trace_0002#1")
    assert c.hashes[:240].tolist() == a.hashes[:240].tolist()


def conv_doc(requests, **top) -> dict:
    return {"id": "t", "block_size": 64, "hash_id_scope": "local", "requests": requests, **top}


def req(t=0.0, model="m", n_in=128, out=10, ids=(1, 2), **extra) -> dict:
    return {"t": t, "type": "n", "model": model, "in": n_in, "out": out,
            "hash_ids": list(ids), "think_time": 0.0, **extra}


def write_json(path: Path, doc, gz: bool = False) -> Path:
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_tester_models_do_not_share_kv(tmp_path):
    p = write_json(tmp_path / "x.json", conv_doc([req(model="a"), req(t=1, model="b"),
                                                    req(t=2, model="a")]))
    w = load_kv_cache_tester(p)
    ha, hb, ha2 = (r.hashes[:2].tolist() for r in w)
    assert ha == ha2 and not set(ha) & set(hb)


def test_tester_finer_blocks_and_tail(tmp_path):
    # 150 tokens: 2 full 64-blocks hashed (ids 7, 8); at b=16, 9 prompt blocks: 8 from the ids,
    # one (tokens 128..143) unique to the request.
    p = write_json(tmp_path / "x.json.gz", conv_doc([req(n_in=150, ids=(7, 8)),
                                                       req(t=1, n_in=150, ids=(7, 8))]), gz=True)
    w = load_kv_cache_tester(p, hash_block_size=16)
    a, b = w[0].hashes, w[1].hashes
    assert len(a) == (150 + 10) // 16 == 10
    assert a[:8].tolist() == b[:8].tolist()
    assert a[8] != b[8]


def test_load_trace_detects_formats(tmp_path):
    assert len(load_trace(CC_DIR / "trace_0086.json.gz")) == 24
    p = tmp_path / "trace.txt"
    p.write_text(MOONCAKE.read_text().split("\n", 1)[0] + "\n")
    assert len(load_trace(p)) == 1
    one_line = tmp_path / "one.data"
    write_json(one_line, conv_doc([req()]))
    assert load_trace(one_line)[0].request_id == "one.data#0"  # only a trace suffix is cut


# ---- malformed input ------------------------------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}

MOONCAKE_BAD = {
    "missing field": ([GOOD, {"timestamp": 1, "output_length": 5, "hash_ids": []}],
                      ":2: missing field 'input_length'"),
    "negative length": ([GOOD, {**GOOD, "output_length": -3}],
                        ":2: field 'output_length' must be an int >= 0, got -3"),
    "zero prompt": ([{**GOOD, "input_length": 0}], ":1: field 'input_length' must be an int >= 1"),
    "bool length": ([{**GOOD, "input_length": True}], ":1: field 'input_length'"),
    "non-monotone": ([GOOD, {**GOOD, "timestamp": 50}, {**GOOD, "timestamp": 20}],
                     ":3: timestamp 20 is before the previous line's 50"),
    "negative time": ([{**GOOD, "timestamp": -1}], ":1: field 'timestamp' must be a finite"),
    "too many ids": ([{**GOOD, "hash_ids": [1, 2, 3]}], ":1: 3 hash_ids for a 600-token prompt"),
    "bad id": ([{**GOOD, "hash_ids": [1, "x"]}], ":1: hash_ids[1] must be an int >= 0"),
    "not an object": ([GOOD, [1, 2]], ":2: expected a JSON object, got list"),
    "tester doc": ([conv_doc([req()])], ":1: a kv-cache-tester JSON trace, not Mooncake"),
}


@pytest.mark.parametrize("case", list(MOONCAKE_BAD), ids=list(MOONCAKE_BAD))
def test_mooncake_bad_input(tmp_path, case):
    lines, message = MOONCAKE_BAD[case]
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    with pytest.raises(TraceError) as e:
        load_mooncake(p)
    assert str(e.value).startswith(str(p))
    assert message in str(e.value)


def test_mooncake_bad_json_empty_and_binary(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n\n" + '{"timestamp": 1, "input_length": \n')
    with pytest.raises(TraceError, match=r"t\.jsonl:3: bad JSON"):
        load_mooncake(p)
    p.write_text("\n  \n")
    with pytest.raises(TraceError, match=r"t\.jsonl: empty file"):
        load_mooncake(p)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_mooncake(p)
    p.write_bytes(gzip.compress(b"x")[:-4])
    with pytest.raises(TraceError, match="bad gzip"):
        load_mooncake(p)
    with pytest.raises(TraceError, match="does not divide the trace block size 512"):
        load_mooncake(MOONCAKE, hash_block_size=48)
    with pytest.raises(TraceError, match="cannot read"):
        load_mooncake(tmp_path / "missing.jsonl")


TESTER_BAD = {
    "missing model": (conv_doc([req(), {k: v for k, v in req(t=1).items() if k != "model"}]),
                      "requests[1]: missing field 'model'"),
    "negative out": (conv_doc([req(out=-1)]), "requests[0]: field 'out' must be an int >= 0"),
    "non-monotone": (conv_doc([req(t=5), req(t=4)]), "requests[1]: t=4 is before"),
    "nested non-monotone": (
        conv_doc([req(), {"t": 1, "type": "subagent", "requests": [req(t=2), req(t=1)]}]),
        "requests[1].requests[1]: t=1 is before"),
    "nested missing requests": (conv_doc([{"t": 1, "type": "subagent"}]),
                                "requests[0]: missing field 'requests'"),
    "nested bad field": (
        conv_doc([{"t": 1, "type": "subagent", "requests": [req(n_in=-5)]}]),
        "requests[0].requests[0]: field 'in' must be an int >= 1, got -5"),
    "too many ids": (conv_doc([req(n_in=64, ids=(1, 2))]), "requests[0]: 2 hash_ids"),
    "negative think": (conv_doc([req(think_time=-1)]), "requests[0]: field 'think_time'"),
    "no block size": ({"requests": [req()]}, "top level: missing field 'block_size'"),
    "bad scope": (conv_doc([req()], hash_id_scope="weird"), "top level: hash_id_scope"),
    "no requests": (conv_doc([]), "no requests"),
    "not an object": ([req()], "expected a JSON object with 'requests', got list"),
}


@pytest.mark.parametrize("case", list(TESTER_BAD), ids=list(TESTER_BAD))
def test_tester_bad_input(tmp_path, case):
    doc, message = TESTER_BAD[case]
    p = write_json(tmp_path / "conv.json.gz", doc, gz=True)
    with pytest.raises(TraceError) as e:
        load_kv_cache_tester(p)
    assert str(e.value).startswith(str(p))
    assert message in str(e.value)


def test_tester_bad_json_empty_and_wrong_format(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{\n  "block_size": 64,\n  "requests": [,]\n}')
    with pytest.raises(TraceError, match=r"c\.json:3: bad JSON"):
        load_kv_cache_tester(p)
    p.write_text("")
    with pytest.raises(TraceError, match=r"c\.json: empty file"):
        load_kv_cache_tester(p)
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(TraceError, match="a Mooncake JSONL trace"):
        load_kv_cache_tester(p)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"no \*\.json or \*\.json\.gz trace"):
        load_kv_cache_tester(empty)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04 not a trace")
    with pytest.raises(TraceError, match="not a Mooncake JSONL or kv-cache-tester JSON"):
        load_trace(junk)


# ---- continuation hints: kv-cache-tester stop reasons, the Mooncake hint field -------------------


def raw_stops() -> dict[str, object]:
    """The ``stop`` of every request of the shipped sample, by the id the loader gives it
    (``<stem>#<i>``, ``<stem>#<i>.<j>`` inside a sub-agent marker), read from the raw files."""
    out: dict[str, object] = {}

    def walk(items: list, stem: str, index: str) -> None:
        for i, obj in enumerate(items):
            if obj.get("type") == "subagent":
                walk(obj["requests"], stem, f"{index}{i}.")
            else:
                out[f"{stem}#{index}{i}"] = obj.get("stop", "<missing>")

    for f in sorted(CC_DIR.glob("*.json.gz")):
        walk(json.loads(gzip.decompress(f.read_bytes()))["requests"],
             f.name.removesuffix(".json.gz"), "")
    return out


def hints(w: Workload) -> list[str | None]:
    return [r.hint for r in w]


def treq(t: float = 0.0, **extra) -> dict:
    return {"t": t, "type": "n", "model": "m", "in": 128, "out": 10, "hash_ids": [1, 2],
            "think_time": 0.0, **extra}


def test_shipped_sample_hints():
    stops = raw_stops()
    w = load_kv_cache_tester(CC_DIR)
    assert {r.request_id for r in w} == set(stops)
    for r in w:
        assert r.hint == ("continue" if stops[r.request_id] == "tool_use" else None), r.request_id
    counts = Counter(hints(w))
    n_tool_use = sum(s == "tool_use" for s in stops.values())
    assert counts == {"continue": n_tool_use, None: len(stops) - n_tool_use}
    assert set(stops.values()) <= set(STOP_REASONS)  # every shipped stop reason is known
    assert n_tool_use > 0 and counts[None] > 0
    s = trace_stats(w)
    assert s["hints"] == {"continue": n_tool_use, "close": 0, "none": len(stops) - n_tool_use}


def test_every_known_stop_reason(tmp_path):
    reasons = sorted(STOP_REASONS)
    doc = conv_doc([treq(t=i, stop=s) for i, s in enumerate(reasons)] + [treq(t=len(reasons))])
    w = load_kv_cache_tester(write_json(tmp_path / "c.json.gz", doc, gz=True))
    got = {r.request_id: r.hint for r in w}
    for i, s in enumerate(reasons):
        assert got[f"c#{i}"] == ("continue" if s == "tool_use" else None)
    assert got[f"c#{len(reasons)}"] is None  # no stop field: no hint
    assert set(STOP_REASONS) == {"tool_use", "end_turn", "max_tokens", "stop_sequence",
                                 "pause_turn", "refusal", ""}


STOP_BAD = {
    "number": ([treq(), treq(t=1, stop=3)], "requests[1]: field 'stop' must be a string, got 3"),
    "null": ([treq(stop=None)], "requests[0]: field 'stop' must be a string, got None"),
    "list": ([treq(stop=["tool_use"])], "requests[0]: field 'stop' must be a string, got "
                                        "['tool_use']"),
    "unknown": ([treq(stop="tool_call")], "requests[0]: field 'stop' is not a known stop reason: "
                                          "'tool_call'"),
    "case": ([treq(stop="TOOL_USE")], "requests[0]: field 'stop' is not a known stop reason: "
                                      "'TOOL_USE'"),
    "nested": ([treq(), {"t": 1, "type": "subagent", "requests": [treq(t=0, stop="later")]}],
               "requests[1].requests[0]: field 'stop' is not a known stop reason: 'later'"),
}


@pytest.mark.parametrize("case", list(STOP_BAD))
def test_bad_stop(tmp_path, case):
    requests, message = STOP_BAD[case]
    p = write_json(tmp_path / "conv.json.gz", conv_doc(requests), gz=True)
    with pytest.raises(TraceError) as e:
        load_kv_cache_tester(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value)


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


def test_mooncake_hints(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": "continue"},
                                           {**GOOD, "hint": "close"}, {**GOOD, "hint": None}])
    assert hints(load_mooncake(p)) == [None, "continue", "close", None]
    assert hints(load_trace(p)) == [None, "continue", "close", None]
    shipped = load_trace(data_path("mooncake_synthetic_trace.jsonl"))
    assert set(hints(shipped)) == {None}  # the shipped trace has none


@pytest.mark.parametrize("bad", ["maybe", "", "Close", 1, True, ["continue"], {"a": 1}])
def test_mooncake_bad_hint(tmp_path, bad):
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": bad}])
    with pytest.raises(TraceError) as e:
        load_mooncake(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: field 'hint' must be null or one of") and repr(bad) in msg


# ---- odd names, separators, files without end ----------------------------------------------------


def test_dotted_file_names_do_not_collide(tmp_path):
    for i in (1, 2):
        (tmp_path / f"conv.{i}.json").write_text(json.dumps(conv_doc([req(), req(t=1)])))
    w = load_trace(tmp_path)
    assert sorted(r.request_id for r in w) == ["conv.1#0", "conv.1#1", "conv.2#0", "conv.2#1"]


@pytest.mark.parametrize("char", ["\u2028", "\u0085", "\u000b", "\u001c"])
def test_line_separators_inside_json_strings(tmp_path, char):
    line = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2],
            "note": f"a{char}b"}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line, ensure_ascii=False) + "\n" + json.dumps(line) + "\n",
                    encoding="utf-8")
    assert len(load_mooncake(path)) == 2


def test_gzip_bomb_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(traces_module, "MAX_TRACE_BYTES", 1 << 20)
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" * (8 << 20)))
    with pytest.raises(ValueError, match="larger than 1,048,576 bytes"):
        load_mooncake(path)
