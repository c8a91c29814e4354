"""The README's and the docs' examples run as written, and the settings they document are the
code's."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@pytest.mark.parametrize("page", [README, DOCS / "simulator.md"], ids=lambda p: p.name)
def test_python_examples_run(page, capsys):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    # The vLLM example needs a model folder and a GPU box: its settings are checked below.
    blocks = [b for b in blocks if "from vllm" not in b]
    assert blocks, f"{page.name} has no python example"
    for code in blocks:
        exec(compile(code, str(page), "exec"), {})
    out = capsys.readouterr().out
    assert "eager+restore+tail" in out and "hit rate" in out


def test_every_docs_page_is_linked_from_the_readme_and_links_resolve():
    text = README.read_text()
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"
    for page in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, not found"


def test_readme_connector_settings_match_the_code():
    """Every ``kv_connector_extra_config`` key is in docs/vllm.md's table with its real default,
    and the table names no key the connector does not know; the README's serve line's JSON
    parses and its settings are accepted."""
    import json
    from dataclasses import fields

    from kvtriton.vllm.config import ConnectorConfig, parse_extra_config

    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", (DOCS / "vllm.md").read_text(),
                           flags=re.M))
    code = {f.name: json.dumps(f.default) for f in fields(ConnectorConfig)}
    assert rows == code
    text = README.read_text()
    serves = re.findall(r"--kv-transfer-config \\\n\s+'(\{.*\})'", text)
    assert serves, "README.md has no vllm serve line"
    for serve in serves:
        cfg = json.loads(serve)
        assert cfg["kv_connector"] == "KVTritonConnector"
        assert cfg["kv_connector_module_path"] == "kvtriton.vllm"
        parse_extra_config(cfg["kv_connector_extra_config"])
    # The second tier's line names a store.
    assert any("second_tier" in json.loads(s)["kv_connector_extra_config"] for s in serves)


def test_the_integrity_example_passes():
    """docs/simulator.md's ``--integrity`` command runs as written (progress bar off) and checks
    real bytes: every setup's row reports checked loads and registrations."""
    import json
    import shlex
    import tempfile

    from kvtriton.cli import main

    lines = [ln.split("#")[0].strip() for ln in (DOCS / "simulator.md").read_text().splitlines()
             if ln.startswith("kvtriton simulate") and "--integrity" in ln]
    assert lines, "docs/simulator.md has no --integrity example"
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.json"
        assert main([*shlex.split(lines[0])[1:], "--quiet", "--json", out]) == 0
        rows = json.loads(Path(out).read_text())["rows"]
    assert rows and all(r["integrity_registrations_checked"] > 0 for r in rows)
    assert any(r["integrity_blocks_checked"] > 0 for r in rows)
