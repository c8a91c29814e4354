"""Trace loaders: Mooncake JSONL and kv-cache-tester JSON(.gz), mapped onto a hash block size.

Both formats give, per request, a list of block ids of the prompt at the trace's block size B
(512 tokens for Mooncake, 64 for kv-cache-tester); equal ids mean equal prefix up to and
including that block. A simulated ``hash_block_size`` b must divide B. Block id ``h`` at trace
position i becomes B/b keys: an id-level chain value ``c_i = mix64(c_{i-1} ^ mix64(h + SALT))``
started from the file's namespace, then ``mix64(c_i ^ SUB_j)`` for j = 0..B/b-1. Chaining makes
equal keys mean equal prefixes even for a trace whose ids were not prefix-consistent; for the
shipped traces (where they are) it is the mapping (h, j) of the MANIFEST. Only the prompt's full
b-blocks are hashed (a trailing partial trace block gives the b-blocks it fully covers); prompt
blocks past the trace's ids and every output block get hashes unique to the request, so a hit
never reaches past the trace's own granularity.

Ids are local to a file, and KV is only shareable within one model, so the namespace is the
file's name plus the model (plus only the model for a kv-cache-tester file whose
``hash_id_scope`` is ``"global"``).

Continuation hints (``WorkloadRequest.hint``): a Mooncake line may carry ``"hint"`` (one of
``HINTS`` or null); a kv-cache-tester request's ``stop`` (the model's stop reason) gives
``"continue"`` for ``"tool_use"`` and no hint for the other stop reasons (``STOP_REASONS``).

Bad input raises ``TraceError`` (a ``ValueError``) naming the file and the line (JSONL) or the
request's index path (JSON) and the problem.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvtriton.hashing import mix64, mix64_array
from kvtriton.sim.workload import HINTS, Workload, WorkloadRequest
from kvtriton.validation import is_finite_number, is_int

__all__ = [
    "CC_AGENTIC_SAMPLE",
    "GLM5_BLOCK_SIZE",
    "GLM5_SAMPLE",
    "KV_CACHE_TESTER_BLOCK_SIZE",
    "MAX_TRACE_BYTES",
    "MOONCAKE_BLOCK_SIZE",
    "MOONCAKE_SYNTHETIC",
    "STOP_REASONS",
    "TraceError",
    "data_path",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "map_block_ids",
    "namespace",
]

MOONCAKE_BLOCK_SIZE = 512
KV_CACHE_TESTER_BLOCK_SIZE = 64
# The most bytes a loader reads from one trace file (after gunzip): the shipped traces are about
# 1 MB, and without a cap a device such as /dev/zero would be read until memory runs out.
MAX_TRACE_BYTES = 1 << 30

# The development traces shipped in kvtriton/sim/data/ (provenance and licence: MANIFEST.md).
MOONCAKE_SYNTHETIC = "mooncake_synthetic_trace.jsonl"
CC_AGENTIC_SAMPLE = "cc_agentic_sample"
# Alibaba's GLM-5 prefill sample (alibaba/tair-kvcache): Mooncake's format with ``block_ids`` of
# 256-token blocks and Unix-time timestamps.
GLM5_SAMPLE = "glm5_sample.jsonl"
GLM5_BLOCK_SIZE = 256
_DATA = Path(__file__).resolve().parent / "data"

# The hint of each stop reason a kv-cache-tester request may record in ``stop`` (Anthropic's API
# stop reasons; "" and a missing field are no reason): a turn that ended in a tool call is
# followed by the tool's result, so its context is reused soon. Any other ``stop`` is an error.
STOP_REASONS: dict[str, str | None] = {
    "tool_use": "continue",
    "end_turn": None,
    "max_tokens": None,
    "stop_sequence": None,
    "pause_turn": None,
    "refusal": None,
    "": None,
}

_ID_SALT = 0x7472_6163_655F_6964  # "trace_id"
_SUB_SALT = 0x9E37_79B9_7F4A_7C15  # golden ratio, spreads sub-block indices
_UNIQUE_SALT = 0x756E_6971_7565_5F68  # "unique_h"


class TraceError(ValueError):
    """A trace file that cannot be read as its format promises (file and line in the message)."""


def data_path(name: str = "") -> Path:
    """Path of a file or folder shipped in ``kvtriton/sim/data/`` (``MOONCAKE_SYNTHETIC``,
    ``CC_AGENTIC_SAMPLE``, ``GLM5_SAMPLE``, ``"MANIFEST.md"``); the folder itself for ``""``."""
    p = _DATA / name
    if not p.exists():
        shipped = sorted(q.name for q in _DATA.iterdir())
        raise FileNotFoundError(f"{name!r} is not among the shipped traces: {shipped}")
    return p


# ---- hashing -------------------------------------------------------------------------------


def namespace(*parts: str) -> int:
    """A 64-bit namespace for block ids from their scope (file name, model)."""
    data = "\x00".join(parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _IdChain:
    """Id-level chain values, reusing those of the longest prefix shared with the previous
    request of the same namespace (a conversation's turns share almost all of it)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def values(self, ids: list[int], ns: int) -> np.ndarray:
        arr = np.array(ids, dtype=np.uint64)
        chain = np.empty(len(ids), dtype=np.uint64)
        k = 0
        if ns in self._last:
            last_ids, last_chain = self._last[ns]
            n = min(len(arr), len(last_ids))
            diff = np.flatnonzero(arr[:n] != last_ids[:n])
            k = int(diff[0]) if len(diff) else n
            chain[:k] = last_chain[:k]
        c = int(chain[k - 1]) if k else ns
        for i in range(k, len(ids)):
            c = mix64(c ^ mix64(ids[i] + _ID_SALT))
            chain[i] = c
        self._last[ns] = (arr, chain)
        return chain


def map_block_ids(
    block_ids: Iterable[int],
    prompt_len: int,
    output_len: int,
    *,
    trace_block_size: int,
    hash_block_size: int,
    ns: int,
    unique_salt: int,
    chainer: _IdChain | None = None,
) -> np.ndarray:
    """uint64 chain hashes at ``hash_block_size`` of a request whose prompt has ``block_ids`` at
    ``trace_block_size``: ``(prompt_len + output_len) // hash_block_size`` of them (see the
    module docstring). ``unique_salt`` must differ between requests of one namespace; a
    ``chainer`` shared by the requests of a file reuses the chain of a common prefix."""
    if trace_block_size % hash_block_size:
        raise ValueError(f"hash_block_size={hash_block_size} does not divide the trace block "
                         f"size {trace_block_size}")
    r = trace_block_size // hash_block_size
    n_prompt = prompt_len // hash_block_size
    n_total = (prompt_len + output_len) // hash_block_size
    chain = (chainer or _IdChain()).values(list(block_ids), ns)
    sub = mix64_array(np.arange(1, r + 1, dtype=np.uint64) * np.uint64(_SUB_SALT))
    keys = mix64_array(chain[:, None] ^ sub[None, :]).ravel()[:n_prompt]
    n_known = len(keys)
    if n_known == n_total:
        return keys
    salt = np.uint64(mix64(ns ^ mix64(unique_salt ^ _UNIQUE_SALT)))
    positions = np.arange(n_known, n_total, dtype=np.uint64)
    unique = mix64_array((positions + np.uint64(1)) * np.uint64(_SUB_SALT) ^ salt)
    return np.concatenate([keys, unique])


# ---- field checks --------------------------------------------------------------------------


def _shown(v: object, limit: int = 40) -> str:
    """``repr(v)`` cut to ``limit`` characters, so an error stays one readable line."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _stem(path: Path) -> str:
    """The file name without its trace suffix: ``conv.1.json.gz`` -> ``conv.1``."""
    name = path.name
    for suffix in (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".gz"):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


class _Where:
    """Formats error locations: ``path:line`` or ``path: requests[3].requests[1]``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, where: str, problem: str) -> TraceError:
        sep = "" if where.startswith(":") else ": "
        return TraceError(f"{self.path}{sep}{where}: {problem}")

    def field(self, obj: dict, name: str, where: str, kind: str):
        if name not in obj:
            raise self.error(where, f"missing field {name!r}")
        v = obj[name]
        if kind == "count" and not (is_int(v) and v >= 0):
            raise self.error(where, f"field {name!r} must be an int >= 0, got {_shown(v)}")
        if kind == "positive" and not (is_int(v) and v >= 1):
            raise self.error(where, f"field {name!r} must be an int >= 1, got {_shown(v)}")
        if kind == "time" and not (is_finite_number(v) and v >= 0):
            raise self.error(where, f"field {name!r} must be a finite number >= 0, got {_shown(v)}")
        if kind == "str" and not isinstance(v, str):
            raise self.error(where, f"field {name!r} must be a string, got {_shown(v)}")
        if kind == "list" and not isinstance(v, list):
            raise self.error(where, f"field {name!r} must be a list, got {type(v).__name__}")
        return v

    def block_ids(self, obj: dict, where: str, prompt_len: int, block_size: int,
                  name: str = "hash_ids") -> list[int]:
        ids = self.field(obj, name, where, "list")
        for j, h in enumerate(ids):
            if not (is_int(h) and h >= 0):
                raise self.error(where, f"{name}[{j}] must be an int >= 0, got {_shown(h)}")
            if h >> 64:
                raise self.error(where, f"{name}[{j}]={_shown(h)} does not fit in 64 bits")
        most = -(-prompt_len // block_size)
        if len(ids) > most:
            raise self.error(where, f"{len(ids)} {name} for a {prompt_len}-token prompt: at "
                                    f"most ceil({prompt_len} / {block_size}) = {most} (ids of "
                                    f"smaller blocks? give the trace's block size: "
                                    f"trace_block_size, --trace-block-size)")
        return ids


def _check_hash_block_size(hash_block_size: int, trace_block_size: int, path: Path) -> None:
    if not is_int(hash_block_size) or hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
    if trace_block_size % hash_block_size:
        raise TraceError(f"{path}: hash_block_size={hash_block_size} does not divide the trace "
                         f"block size {trace_block_size}")


# ---- Mooncake JSONL ------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    """A trace file's bytes, gunzipped when it starts with the gzip magic; at most
    ``MAX_TRACE_BYTES`` of them, else ``TraceError``."""
    limit = MAX_TRACE_BYTES
    too_big = TraceError(f"{path}: larger than {limit:,} bytes, the most a trace loader reads "
                         "(kvtriton.sim.traces.MAX_TRACE_BYTES)")
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as z:
                raw = z.read(limit + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: bad gzip data: {e}") from None
    if len(raw) > limit:
        raise too_big
    return raw


def load_mooncake(
    path: str | Path,
    *,
    hash_block_size: int = MOONCAKE_BLOCK_SIZE,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    model: str | None = None,
    name: str | None = None,
) -> Workload:
    """A Mooncake trace: one JSON object per line with ``timestamp`` (ms, never decreasing;
    arrivals count from the first line's), ``input_length``, ``output_length`` and ``hash_ids``
    (``trace_block_size``-token blocks, at most ``ceil(input_length / trace_block_size)`` of
    them). ``block_ids`` is read as another name of ``hash_ids`` (Alibaba's GLM-5 sample,
    ``GLM5_SAMPLE``, whose timestamps are Unix times in ms), the one a file's first line uses
    throughout.

    Requests are ``<file stem>:<line>``, with no session (open loop). ``model`` (optional)
    labels every request and joins the namespace. An optional ``hint`` (one of ``HINTS``, or
    null) becomes the request's continuation hint.
    """
    path = Path(path)
    _check_hash_block_size(hash_block_size, trace_block_size, path)
    w = _Where(path)
    ns = namespace(path.name, model or "")
    stem = _stem(path)
    raw = _read_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (byte {e.start}); is it a JSONL trace?") from None
    requests: list[WorkloadRequest] = []
    chainer = _IdChain()
    last_ts = -math.inf
    first_ts = ids_name = None
    # Split on newlines only: str.splitlines() also splits at U+2028, U+0085 and other characters
    # that JSON allows raw inside a string.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        at = f":{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise w.error(at, f"bad JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise w.error(at, "bad JSON: nested too deeply") from None
        if not isinstance(obj, dict):
            raise w.error(at, f"expected a JSON object, got {type(obj).__name__}")
        if "requests" in obj and "timestamp" not in obj:
            raise w.error(at, "a kv-cache-tester JSON trace, not Mooncake JSONL "
                              "(use load_kv_cache_tester or load_trace)")
        ts = w.field(obj, "timestamp", at, "time")
        prompt_len = w.field(obj, "input_length", at, "positive")
        output_len = w.field(obj, "output_length", at, "count")
        if ids_name is None:
            ids_name = "block_ids" if "block_ids" in obj and "hash_ids" not in obj else "hash_ids"
        ids = w.block_ids(obj, at, prompt_len, trace_block_size, ids_name)
        if ts < last_ts:
            raise w.error(at, f"timestamp {ts} is before the previous line's {last_ts}: "
                              "timestamps must not decrease")
        last_ts = ts
        if first_ts is None:
            first_ts = ts
        hint = obj.get("hint")
        if hint is not None and not (isinstance(hint, str) and hint in HINTS):
            raise w.error(at, f"field 'hint' must be null or one of {HINTS}, got {_shown(hint)}")
        hashes = map_block_ids(ids, prompt_len, output_len, trace_block_size=trace_block_size,
                               hash_block_size=hash_block_size, ns=ns, unique_salt=lineno,
                               chainer=chainer)
        requests.append(WorkloadRequest(f"{stem}:{lineno}", (ts - first_ts) / 1000.0, prompt_len,
                                        output_len, hashes, model=model, hint=hint))
    if not requests:
        raise TraceError(f"{path}: empty file (no requests)")
    return Workload(requests, hash_block_size, name or path.name)


# ---- kv-cache-tester JSON ------------------------------------------------------------------


def _read_json(path: Path):
    raw = _read_bytes(path)
    if not raw.strip():
        raise TraceError(f"{path}: empty file (no requests)")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text (byte {e.start}); is it a JSON trace?") from None
    except json.JSONDecodeError as e:
        hint = " (several JSON values: a Mooncake JSONL trace?)" if e.msg == "Extra data" else ""
        raise TraceError(f"{path}:{e.lineno}: bad JSON: {e.msg} (column {e.colno}){hint}") from None
    except RecursionError:
        raise TraceError(f"{path}: bad JSON: nested too deeply") from None


def _tester_file(path: Path, hash_block_size: int | None, offset_s: float
                 ) -> tuple[list[WorkloadRequest], int]:
    """The requests of one file, and the hash block size they were mapped at (the file's own
    block size when ``hash_block_size`` is None)."""
    w = _Where(path)
    doc = _read_json(path)
    if not isinstance(doc, dict):
        raise TraceError(f"{path}: expected a JSON object with 'requests', got "
                         f"{type(doc).__name__} (a JSONL trace? use load_mooncake)")
    top = "top level"
    trace_block = w.field(doc, "block_size", top, "positive")
    reqs = w.field(doc, "requests", top, "list")
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise w.error(top, f"hash_id_scope must be 'local' or 'global', got {scope!r}")
    if hash_block_size is None:
        hash_block_size = trace_block
    _check_hash_block_size(hash_block_size, trace_block, path)
    stem = _stem(path)
    out: list[WorkloadRequest] = []
    namespaces: dict[str, int] = {}
    chainer = _IdChain()

    def walk(items: list, prefix: str, index: str, base_s: float, session: str) -> None:
        last_t = -math.inf
        prev_id: str | None = None
        for i, obj in enumerate(items):
            where = f"{prefix}[{i}]"
            rid = f"{stem}#{index}{i}"
            if not isinstance(obj, dict):
                raise w.error(where, f"expected a JSON object, got {type(obj).__name__}")
            t = w.field(obj, "t", where, "time")
            if t < last_t:
                raise w.error(where, f"t={t} is before the previous request's t={last_t}: "
                                     "times must not decrease")
            last_t = t
            kind = obj.get("type", "n")
            if kind == "subagent":
                sub = w.field(obj, "requests", where, "list")
                agent = obj.get("agent_id")
                label = agent if isinstance(agent, str) and agent else f"sub{i}"
                walk(sub, f"{where}.requests", f"{index}{i}.", base_s + t, f"{session}/{label}")
                continue
            model = w.field(obj, "model", where, "str")
            prompt_len = w.field(obj, "in", where, "positive")
            output_len = w.field(obj, "out", where, "count")
            ids = w.block_ids(obj, where, prompt_len, trace_block)
            think = obj.get("think_time", 0.0)
            if not (is_finite_number(think) and think >= 0):
                raise w.error(where, f"field 'think_time' must be a finite number >= 0, "
                                     f"got {_shown(think)}")
            stop = obj.get("stop", "")
            if not isinstance(stop, str):
                raise w.error(where, f"field 'stop' must be a string, got {_shown(stop)}")
            if stop not in STOP_REASONS:
                raise w.error(where, f"field 'stop' is not a known stop reason: {_shown(stop)} "
                                     f"(known: {sorted(STOP_REASONS)})")
            ns = namespaces.get(model)
            if ns is None:
                ns = namespaces[model] = (namespace(path.name, model) if scope == "local"
                                          else namespace("global", model))
            hashes = map_block_ids(ids, prompt_len, output_len, trace_block_size=trace_block,
                                   hash_block_size=hash_block_size, ns=ns,
                                   unique_salt=namespace(path.name, rid), chainer=chainer)
            out.append(WorkloadRequest(rid, offset_s + base_s + t, prompt_len, output_len,
                                       hashes, session=session, after=prev_id,
                                       think_s=float(think) if prev_id else 0.0, model=model,
                                       hint=STOP_REASONS[stop]))
            prev_id = rid

    try:
        walk(reqs, "requests", "", 0.0, stem)
    except RecursionError:
        raise TraceError(f"{path}: subagent requests nested too deeply") from None
    if not out:
        raise TraceError(f"{path}: no requests")
    return out, hash_block_size


def _tester_paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(paths, str | Path):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            try:
                names = os.listdir(p)
            except OSError as e:
                raise TraceError(f"{p}: cannot read folder: {e.strerror or e}") from None
            found = sorted(p / n for n in names if n.lower().endswith((".json", ".json.gz"))
                           and (p / n).is_file())
            if not found:
                raise TraceError(f"{p}: no *.json or *.json.gz trace in this folder")
            out.extend(found)
        else:
            out.append(p)
    if not out:
        raise TraceError("no trace files given")
    return out


def load_kv_cache_tester(
    paths: str | Path | Iterable[str | Path],
    *,
    hash_block_size: int | None = None,
    stagger_s: float = 0.0,
    name: str | None = None,
) -> Workload:
    """kv-cache-tester conversations (one JSON or gzip'd JSON per file, or a folder of them).

    Each top-level request is ``<file stem>#<i>``, in session ``<stem>``, closed loop after the
    previous one with its ``think_time``. A ``subagent`` marker's nested requests (times relative
    to the marker) become ``<stem>#<i>.<j>`` in session ``<stem>/<agent_id>``, chained among
    themselves; the first starts at the marker's time. A request's ``stop`` gives its hint:
    ``"continue"`` for ``"tool_use"``, none for the other ``STOP_REASONS`` or no ``stop``; the
    traces record no session close (``kvtriton.sim.workload.mark_session_close`` derives one).
    File k's times are shifted by ``k * stagger_s`` seconds. Requests come out in arrival order.
    ``hash_block_size`` defaults to the files' own ``block_size`` (every file must then have the
    same one).
    """
    if not (is_finite_number(stagger_s) and stagger_s >= 0):
        raise ValueError(f"stagger_s must be a finite number >= 0, got {stagger_s!r}")
    files = _tester_paths(paths)
    requests: list[WorkloadRequest] = []
    sizes: dict[int, Path] = {}
    for k, p in enumerate(files):
        reqs, size = _tester_file(p, hash_block_size, k * stagger_s)
        sizes.setdefault(size, p)
        if len(sizes) > 1:
            (a, pa), (b, _) = sizes.items()
            raise TraceError(f"{p}: block_size {b} differs from {a} in {pa}; give a "
                             "hash_block_size that divides both")
        requests.extend(reqs)
    (hash_block_size,) = sizes
    requests.sort(key=lambda r: r.arrival_s)
    if name is None:
        name = files[0].parent.name if len(files) > 1 else files[0].name
    return Workload(requests, hash_block_size, name)


# ---- format detection ----------------------------------------------------------------------


def load_trace(path: str | Path, *, hash_block_size: int | None = None,
               trace_block_size: int | None = None) -> Workload:
    """Load a trace by its format: a folder or a ``.json``/``.json.gz`` file is kv-cache-tester,
    a ``.jsonl``/``.jsonl.gz`` file is Mooncake; another name is told by its first 64 KiB
    (gzip data, or a first line that is not one JSON object holding ``requests``:
    kv-cache-tester; one JSON object per line: Mooncake). ``trace_block_size``: the tokens per
    block id of a Mooncake-format file (default Mooncake's 512; a kv-cache-tester file says its
    own); ``hash_block_size`` defaults to the trace's block size."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or folder")
    suffixes = "".join(path.suffixes[-2:]).lower()
    if path.is_dir() or suffixes.endswith((".json", ".json.gz")):
        fmt = "tester"
    elif suffixes.endswith((".jsonl", ".jsonl.gz")):
        fmt = "mooncake"
    else:
        fmt = _sniff(path)
    if fmt == "tester":
        if trace_block_size is not None:
            raise ValueError(f"{path}: a kv-cache-tester trace names its own block size; "
                             f"trace_block_size={trace_block_size} is for Mooncake's format")
        return load_kv_cache_tester(path, hash_block_size=hash_block_size)
    block = trace_block_size or MOONCAKE_BLOCK_SIZE
    return load_mooncake(path, hash_block_size=hash_block_size or block, trace_block_size=block)


def _sniff(path: Path) -> str:
    """The format of a trace file whose name does not say it: ``"tester"`` for gzip or a JSON
    document with ``requests``, ``"mooncake"`` for JSON lines. Reads at most 64 KiB."""
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    if head[:2] == b"\x1f\x8b":
        return "tester"
    first = head.lstrip()[:1]
    if not first:
        raise TraceError(f"{path}: empty file (no requests)")
    if first != b"{":
        raise TraceError(f"{path}: not a Mooncake JSONL or kv-cache-tester JSON trace "
                         f"(starts with {head.lstrip()[:16]!r})")
    first_line = head.lstrip().split(b"\n", 1)[0]
    try:
        obj = json.loads(first_line)
    except (ValueError, RecursionError):
        return "tester"  # a multi-line (or long) JSON document: its loader says what is wrong
    return "tester" if isinstance(obj, dict) and "requests" in obj else "mooncake"
