"""The paper's inputs: the command, commit and date behind each results file."""

from __future__ import annotations

import json

from paper import results as paper_results
from paper.format import md_table
from paper.results import INPUTS, load, not_run


def _provenance(name: str, doc: dict, manifest: dict) -> tuple[str, str, bool | None, str]:
    """(writer, commit, clean tracked code, UTC date) of input ``name``: its manifest entry
    where that agrees with the file's own machine block on the commit, else the machine block
    (files written before the manifest existed)."""
    machine = doc.get("machine") or {}
    sha = machine.get("git_sha", "unknown")
    commit, _, dirty = sha.partition("+")
    entry = manifest.get(f"{name}.json")
    if entry is not None and entry["commit"] == commit:
        return entry["writer"]["command"], entry["commit"], entry["clean"], entry["date_utc"]
    return (doc.get("command", "not recorded"), commit,
            None if commit == "unknown" else not dirty, machine.get("date_utc", "unknown"))


def inputs_section(v: dict) -> None:
    """The paper's inputs: where each came from, or why it is absent."""
    path = paper_results.RESULTS / "MANIFEST.json"
    manifest = json.loads(path.read_text())["files"] if path.exists() else {}
    rows, commits, dirty = [], {}, 0
    for name in INPUTS:
        doc = load(name)
        file = f"{name}.json"
        if doc is None:
            rows.append([f"`{file}`", not_run(file), "-", "-", "-"])
            continue
        writer, commit, clean, date = _provenance(name, doc, manifest)
        commits[commit] = commits.get(commit, 0) + 1
        dirty += clean is False
        rows.append([f"`{file}`", f"`{writer}`" if writer != "not recorded" else writer,
                     f"`{commit}`", {True: "yes", False: "**no**", None: "unknown"}[clean],
                     date])
    n = sum(commits.values())
    summary = "No results file behind this paper has been written." if not n else (
        f"The {n} results files behind this paper come from {len(commits)} "
        f"commit{'s' if len(commits) != 1 else ''} ("
        + ", ".join(f"`{c}`: {k}" for c, k in commits.items()) + "); "
        + (f"{dirty} of them {'was' if dirty == 1 else 'were'} written with uncommitted "
           "changes to tracked code." if dirty else "every one with the tracked code clean."))
    v["inputs_text"] = (summary + " Per file: the command that wrote it (from "
                        "`bench/results/MANIFEST.json`; *not recorded* for a file older than "
                        "the manifest), its commit, whether the tracked code was clean, and "
                        "when.\n\n" + md_table(["results file", "written by", "commit",
                                              "tracked code clean", "date (UTC)"], rows))
