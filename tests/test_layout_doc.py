"""docs/layout.md maps every package and module of ``kvtriton/``, ``kernels/`` and ``bench/``,
and every path it names exists.

What the doc names (the rule its opening paragraph states):

- a *path* is a backticked token of letters, digits, ``_ . - / *`` that holds a ``/`` or ends in
  a file suffix (``SUFFIXES``); a pattern such as ``test_<module>.py`` is not one;
- in the map (the table before "## Where to start reading") a row's *folder* is its path
  column's first path if that ends in ``/``, else that path's folder; a path anywhere in the row
  names ``folder/path`` where that exists, else ``path`` from the repo root (so ``pairs.py`` in
  the ``kernels/`` row is ``kernels/pairs.py``);
- anywhere else a path is from the repo root, and must exist, but does not put it on the map.

Covered: every folder under ``CODE_ROOTS`` that holds a ``.py`` file (named as ``folder/``) and
every ``.py`` file there but ``__init__.py``, which its folder's entry covers.
"""

import re
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
CODE_ROOTS = ("kvtriton", "kernels", "bench")
SUFFIXES = (".py", ".md", ".json", ".sh", ".toml", ".png")
MAP_HEADER = "| path | holds |"
MAP_END = "## Where to start reading"

_TOKEN = re.compile(r"`([^`]+)`")
_PATH = re.compile(r"[\w.*/-]+")


def _paths(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text)
            if _PATH.fullmatch(t) and ("/" in t or t.endswith(SUFFIXES))]


def _norm(path: str) -> str:
    return str(PurePosixPath(path))  # no trailing slash, no "./"


def named_paths(text: str, root: Path) -> tuple[set[str], list[str]]:
    """The repo-relative paths the map of ``text`` (a layout page) names, and the paths named
    anywhere in it that do not exist, each with the line that names it."""
    head, sep, rest = text.partition(MAP_HEADER)
    assert sep, f"no map table (a {MAP_HEADER!r} header) in the layout page"
    table, end, tail = rest.partition(MAP_END)
    assert end, f"no {MAP_END!r} section after the map"
    named: set[str] = set()
    stale: list[str] = []

    def name(path: str, line: str, folder: str | None = None) -> None:
        if folder is not None and (root / folder / path).exists():
            path = f"{folder}/{path}"
        elif not (root / path).exists():
            stale.append(f"{path!r} in: {line.strip()}")
            return
        if folder is not None:
            named.add(_norm(path))

    for line in (head + tail).splitlines():
        for path in _paths(line):
            name(path, line)
    for line in table.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        first = _paths(line.strip("|").split("|")[0])
        assert first, f"a map row without a path in its path column: {line.strip()}"
        folder = _norm(first[0] if first[0].endswith("/") else str(PurePosixPath(first[0]).parent))
        for path in _paths(line):
            name(path, line, folder)
    return named, stale


def unmapped(root: Path, roots: tuple[str, ...], named: set[str]) -> list[str]:
    """The folders holding ``.py`` files and the modules under ``roots`` not in ``named``."""
    missing = []
    for top in roots:
        for py in sorted((root / top).rglob("*.py")):
            if "__pycache__" in py.parts:
                continue
            rel = py.relative_to(root)
            folder = rel.parent.as_posix()
            if folder not in named:
                missing.append(f"{folder}/")
            if py.name != "__init__.py" and rel.as_posix() not in named:
                missing.append(rel.as_posix())
    return sorted(set(missing))


def test_every_package_and_module_is_on_the_map():
    named, _ = named_paths(LAYOUT.read_text(), ROOT)
    missing = unmapped(ROOT, CODE_ROOTS, named)
    assert not missing, f"docs/layout.md does not name: {', '.join(missing)}"


def test_every_path_the_layout_names_exists():
    _, stale = named_paths(LAYOUT.read_text(), ROOT)
    assert not stale, "docs/layout.md names paths that do not exist:\n" + "\n".join(stale)


def test_the_rule_on_a_planted_tree(tmp_path):
    """A module left off the map, and a path the map names that is gone, are both reported;
    a bare file name resolves against its row's folder, a path elsewhere from the root."""
    for f in ("pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/sub/__init__.py", "pkg/sub/c.py",
              "other/x.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    doc = ("intro naming `other/x.py`\n\n" + MAP_HEADER + "\n|---|---|\n"
           "| `pkg/`: `a.py`, `b.py` | a and b; `sub/` is below |\n"
           "| `pkg/sub/` | `c.py`, with `pkg/a.py` again |\n\n" + MAP_END + "\n\n"
           "| question | files |\n|---|---|\n| q | `pkg/sub/c.py` |\n")
    named, stale = named_paths(doc, tmp_path)
    assert not stale
    assert unmapped(tmp_path, ("pkg",), named) == []
    assert "pkg/sub" in named and "other/x.py" not in named  # named, but not on the map

    planted = doc.replace(", `b.py`", "")
    assert unmapped(tmp_path, ("pkg",), named_paths(planted, tmp_path)[0]) == ["pkg/b.py"]
    # A sub-package's folder must be named too; the reading table names nothing on the map.
    no_sub = doc.replace("| `pkg/sub/` | `c.py`, with `pkg/a.py` again |\n", "")
    assert unmapped(tmp_path, ("pkg",), named_paths(no_sub, tmp_path)[0]) == ["pkg/sub/c.py"]
    no_sub = no_sub.replace("; `sub/` is below", "")
    assert unmapped(tmp_path, ("pkg",), named_paths(no_sub, tmp_path)[0]) == [
        "pkg/sub/", "pkg/sub/c.py"]

    for gone in (doc.replace("`b.py`", "`b.py`, `gone.py`"),
                 doc.replace("`other/x.py`", "`other/y.py`"),
                 doc.replace("| q | `pkg/sub/c.py` |", "| q | `sub/c.py` |")):
        assert len(named_paths(gone, tmp_path)[1]) == 1
