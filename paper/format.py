"""How the paper writes a number, a machine and a table: every section formats through these."""

from __future__ import annotations


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def fmt_ms(x: float) -> str:
    return f"{x:.3g} ms" if x < 10 else f"{x:.0f} ms"


def machine_line(doc: dict | None) -> str:
    if not doc:
        return "not run"
    m = doc["machine"]
    gpu = m["gpu"] or "no GPU"
    return (f"{m['cpu']} ({m['cpu_cores']} cores), {gpu}; torch {m['torch']}, triton "
            f"{m['triton']}; commit {m['git_sha']}, {m['date_utc']}")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---"
                                                             for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def share_pct(x) -> str:
    """A share (of an upper bound's headroom, or of a budget) as a whole percent; "-" for None."""
    return "-" if x is None else f"{100 * x:.0f}%"


def points(x) -> str:
    """Points of hit rate with their sign; "-" for None."""
    return "-" if x is None else f"{x:+.1f}"


def run_range(row: dict, key: str, fmt) -> str:
    """`` (lo-hi)`` over a row's repeated engine runs, or nothing for one run."""
    r = row.get(f"{key}_range")
    return "" if not r else f" ({fmt(r[0])}-{fmt(r[1])})"


def verdict_word(ok: bool) -> str:
    return "met" if ok else "**missed**"
