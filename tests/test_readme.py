"""The README's Python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # The vLLM example needs a model folder and a GPU box: its settings are checked below.
    blocks = [b for b in blocks if "from vllm" not in b]
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "eager+restore+tail" in out and "hit rate" in out


def test_readme_connector_settings_match_the_code():
    """Every ``kv_connector_extra_config`` key is in the README's table with its real default,
    and the table names no key the connector does not know; the serve line's JSON parses and
    its settings are accepted."""
    import json
    from dataclasses import fields

    from kvtriton.vllm.config import ConnectorConfig, parse_extra_config

    text = README.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", text, flags=re.M))
    code = {f.name: json.dumps(f.default) for f in fields(ConnectorConfig)}
    assert rows == code
    serve = re.search(r"--kv-transfer-config \\\n\s+'(\{.*\})'", text)
    assert serve, "README.md has no vllm serve line"
    cfg = json.loads(serve.group(1))
    assert cfg["kv_connector"] == "KVTritonConnector"
    assert cfg["kv_connector_module_path"] == "kvtriton.vllm"
    parse_extra_config(cfg["kv_connector_extra_config"])


def test_readme_integrity_example_passes():
    """The README's ``--integrity`` command runs as written (progress bar off) and checks real
    bytes: every setup's row reports checked loads and registrations."""
    import json
    import shlex
    import tempfile

    from kvtriton.cli import main

    lines = [ln.split("#")[0].strip() for ln in README.read_text().splitlines()
             if ln.startswith("kvtriton simulate") and "--integrity" in ln]
    assert lines, "README.md has no --integrity example"
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.json"
        assert main([*shlex.split(lines[0])[1:], "--quiet", "--json", out]) == 0
        rows = json.loads(Path(out).read_text())["rows"]
    assert rows and all(r["integrity_registrations_checked"] > 0 for r in rows)
    assert any(r["integrity_blocks_checked"] > 0 for r in rows)
