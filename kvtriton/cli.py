"""The ``kvtriton`` command: ``simulate``, ``replay`` and ``trace-stats``.

Every error a user can cause (a bad file, an impossible size, an unknown name) is one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

__all__ = ["main"]


class _UsageError(Exception):
    """A bad argument or input, reported as one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other input error
        raise _UsageError(message)


#: The largest integer a flag takes: what a 64-bit count can hold.
_MAX_INT = (1 << 63) - 1


def _number(kind: type, allow_zero: bool):
    """An argparse type: a finite ``kind`` above 0 (or at least 0), named in its error, written
    in the one number syntax of the setup grammar (``kvtriton.setups.NUMBER``: ``1e6`` is a
    count, ``1e+6``, ``1_000`` and ``inf`` are not numbers; an integer must be whole)."""
    noun = "an integer" if kind is int else "a number"
    if kind is int:
        rule = "must be >= 0" if allow_zero else "must be positive"
    else:
        rule = "must be a finite number >= 0" if allow_zero else "must be a positive finite number"

    def parse(text: str):
        from kvtriton.setups import NUMBER_SYNTAX, read_number

        negative = text.startswith("-")  # named by its rule, not as a bad spelling
        try:
            d = read_number(text[1:] if negative else text)
        except ValueError:
            d = None
        if d is None or (negative and not d):
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun} ({NUMBER_SYNTAX})")
        if kind is int and d != d.to_integral_value():
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        if negative or (d == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        if kind is int:
            if d.adjusted() > 18 or int(d) > _MAX_INT:  # sized before a huge int is built
                raise argparse.ArgumentTypeError(f"{text!r} is too large (at most 2**63 - 1)")
            return int(d)
        v = float(d)
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return v

    return parse


_positive_int = _number(int, allow_zero=False)
_positive_float = _number(float, allow_zero=False)
_non_negative_int = _number(int, allow_zero=True)
_non_negative_float = _number(float, allow_zero=True)


def _gib(text: str) -> float:
    v = _positive_float(text)
    if v * (1 << 30) >= 1 << 63:  # bytes a 64-bit size can hold
        raise argparse.ArgumentTypeError(f"{text!r} GiB is too large")
    return v


def _setups(text: str) -> list[str]:
    """Presets or compositions, each checked here so that a typo fails before any run."""
    from kvtriton.setups import tier_setup

    items = _csv(text)
    for item in items:
        try:
            tier_setup(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return items


class _RenamedFlag(argparse.Action):
    """An old spelling of a flag: stores into the new one's ``dest`` and warns once on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"kvtriton: warning: {option_string} is now {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    if not all(items):
        empty = [i for i, t in enumerate(items, 1) if not t]
        raise argparse.ArgumentTypeError(
            f"{text!r}: entry {', '.join(map(str, empty))} of {len(items)} is empty")
    twice = sorted({t for t in items if items.count(t) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} listed more than once")
    return items


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="agent", metavar="NAME|PATH",
                   help="agent (generator), chat (the generator's sequential-chat shape, fixed), "
                        "mooncake, cc_agentic or glm5 (shipped traces), or a "
                        "trace file/folder (Mooncake JSONL or kv-cache-tester JSON); default: "
                        "agent")
    g.add_argument("--trace-block-size", type=_positive_int, default=None,
                   help="tokens per block id of a Mooncake-format trace given by path (default "
                        "512)")
    g.add_argument("--block-size", type=_positive_int, default=16,
                   help="simulated block size in tokens (divides the trace's block size)")
    g.add_argument("--limit", type=_positive_int, default=None,
                   help="keep only the first N requests (and the turns they lead to)")
    g.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="multiply arrival and think times (>1 lightens the load)")
    g.add_argument("--seed", type=_non_negative_int, default=0, help="generator seed")
    g.add_argument("--conversations", type=_positive_int, default=32,
                   help="agent: concurrent conversations")
    g.add_argument("--turns", type=_positive_int, nargs=2, default=(10, 50), metavar=("MIN", "MAX"),
                   help="agent: turns per conversation")
    g.add_argument("--system-prompt", type=_positive_int, default=2048,
                   help="agent: shared system prompt tokens")
    g.add_argument("--think-s", type=_non_negative_float, default=8.0,
                   help="agent: mean think time, seconds")


def load_workload(args: argparse.Namespace):
    """The workload named by ``--workload`` at ``--block-size`` (``kvtriton.sim.workloads``)."""
    from kvtriton.sim.workload import AgentConfig
    from kvtriton.sim.workloads import load_workload as load

    agent = None
    if args.workload == "agent":
        lo, hi = args.turns
        if lo > hi:
            raise _UsageError(f"--turns {lo} {hi}: MIN must not exceed MAX")
        agent = AgentConfig(num_conversations=args.conversations, min_turns=lo, max_turns=hi,
                            system_prompt_tokens=args.system_prompt,
                            think_s_mean=args.think_s, seed=args.seed)
    return load(args.workload, block_size=args.block_size, limit=args.limit,
                time_scale=args.time_scale, agent=agent, trace_block_size=args.trace_block_size)


def _capacity(args, prefix: str) -> dict:
    out = {}
    for unit in ("tokens", "gib", "blocks"):
        v = getattr(args, f"{prefix}_{unit}")
        if v is not None:
            out[f"{prefix}_{unit}"] = v
    if len(out) > 1:
        raise _UsageError(f"give one of --{prefix}-tokens, --{prefix}-gib, --{prefix}-blocks")
    return out


def _check_output(flag: str, path: str | None) -> None:
    """Fail before a long run, not after it, when an output path cannot be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise _UsageError(f"{flag} {path}: is a folder, expected a file path")
    folder = p.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise _UsageError(f"{flag} {path}: cannot write there ({folder} is not a writable folder)")


def _write_json(path: str, doc: dict) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise _UsageError(f"--json {path}: cannot write: {e.strerror or e}") from None


def _write_outputs(args, doc: dict, plot) -> None:
    """``--json`` and ``--plot`` of a subcommand, each reported with its path."""
    if args.json:
        _write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(args.plot)
        except OSError as e:
            raise _UsageError(f"--plot {args.plot}: cannot write: {e.strerror or e}") from None
        print(f"wrote {args.plot}")


# simulate's parameters that are flags here: an error that starts with one names the flag.
_FLAGS = ("integrity_backend", "integrity", "max_running", "token_budget",
          "sync_load_budget_bytes")
_FLAG_OF = {"sync_load_budget_bytes": "--sync-load-budget"}


def _as_flag(message: str) -> str:
    """``message`` with the ``simulate`` parameter it starts with written as its flag."""
    for name in _FLAGS:
        if message.startswith((f"{name} ", f"{name}:")):
            return _FLAG_OF.get(name, "--" + name.replace("_", "-")) + message[len(name):]
    return message


def _cmd_simulate(args) -> int:
    from kvtriton.sim import simulate
    from kvtriton.specs import preset

    layout = preset(args.model, block_size=args.block_size)
    if layout.hash_block_size != args.block_size:
        sizes = ", ".join(str(g.block_size) for g in layout.groups)
        raise _UsageError(f"--block-size {args.block_size} does not fit --model {args.model}: "
                          f"its group block sizes ({sizes} tokens) must all be multiples of it")
    _check_output("--json", args.json)
    _check_output("--plot", args.plot)
    if args.store_blocks is not None:
        from kvtriton.setups import tier_setup

        if not any(tier_setup(s).second_tier for s in args.setups):
            raise _UsageError(f"--store-blocks {args.store_blocks}: no setup in --setups has "
                              "'shared', the second tier it sizes")
    wl = load_workload(args)
    kw = {**_capacity(args, "gpu"), **_capacity(args, "cpu")}
    vllm = args.engine == "vllm"
    try:
        # simulate checks every argument for the chosen engine before it runs anything.
        res = simulate(wl, model=args.model, gpu=args.gpu, setups=args.setups,
                       token_budget=args.token_budget, max_running=args.max_running,
                       integrity=args.integrity, integrity_backend=args.integrity_backend,
                       bound=not args.no_bound, progress=not args.quiet, engine=args.engine,
                       store_blocks=args.store_blocks,
                       sync_load_budget_bytes=args.sync_load_budget, **kw)
    except (ValueError, ImportError) as e:
        if os.environ.get("KVTRITON_DEBUG"):
            raise
        prefix = "--engine vllm: " if vllm else ""
        raise _UsageError(f"{prefix}{_as_flag(str(e))}" if str(e) else type(e).__name__) \
            from None
    except (RuntimeError, AssertionError) as e:
        # vLLM's scheduler stalling or failing a check of its own on these settings: still one
        # line like every other error of this command; KVTRITON_DEBUG shows the stack.
        if not vllm or os.environ.get("KVTRITON_DEBUG"):
            raise
        raise _UsageError(f"--engine vllm: vLLM's scheduler failed: {type(e).__name__}: {e}") \
            from None
    except Exception as e:
        # A broken vLLM install can raise anything on import: still one line, never a traceback.
        if not vllm or os.environ.get("KVTRITON_DEBUG"):
            raise
        raise _UsageError(f"--engine vllm: vLLM did not import: {type(e).__name__}: {e}") \
            from None
    c = res.conditions
    n_rejected = c["rejected"]
    rejected = (f" ({n_rejected:,} rejected: larger than the GPU; hit rates and the bound "
                "cover the others)" if n_rejected else "")
    engine = f"vLLM {c['vllm']} scheduler" if vllm else "kvtriton ServingLoop"
    print(f"{wl.name}: {len(wl)} requests{rejected}; {c['layout']}; GPU {c['gpu_blocks']:,} "
          f"blocks ({c['gpu_gib']:.1f} GiB), CPU {c['cpu_blocks']:,} blocks "
          f"({c['cpu_gib']:.1f} GiB); {engine}, {args.gpu} cost model")
    print(res.table())
    if res.bound is not None:
        print(f"bound: {res.bound['setup']}: {res.bound['hit_rate']:.1%}")
    from kvtriton.plots import plot_simulation

    doc = res.to_dict()
    doc["engine"] = args.engine
    _write_outputs(args, doc, lambda path: plot_simulation(res, path))
    return 0


def _cmd_replay(args) -> int:
    from kvtriton.sim import capacity_sweep
    from kvtriton.sim.progress import Progress

    _check_output("--json", args.json)
    _check_output("--plot", args.plot)
    wl = load_workload(args)
    if not len(wl):
        raise _UsageError(f"workload {wl.name!r} has no requests: nothing to replay")
    caps = args.capacities
    b = wl.hash_block_size
    for c in caps or ():
        if c % b:
            raise _UsageError(f"--capacities {c}: not a whole number of {b}-token blocks "
                              f"(use {max(b, c // b * b)} or {-(-c // b) * b})")
    n_runs = len(args.evictions) * (len(caps) if caps else 6)
    bar = Progress("replay", enabled=not args.quiet)
    done = [0]

    def tick(_r):
        done[0] += 1
        bar(done[0], n_runs)

    res = capacity_sweep(wl, caps, args.evictions, progress=tick)
    print(f"{wl.name}: {res.requests} requests, {res.prompt_tokens:,} prompt tokens, "
          f"{res.hash_block_size}-token blocks")
    print(res.table())
    from kvtriton.plots import plot_sweep

    _write_outputs(args, res.to_dict(), lambda path: plot_sweep(res, path))
    return 0


def _cmd_trace_stats(args) -> int:
    from kvtriton.sim import trace_stats
    from kvtriton.sim.workloads import trace_source

    _check_output("--json", args.json)
    path, trace_block_size = trace_source(args.file, args.trace_block_size)
    stats = trace_stats(path, hash_block_size=args.block_size, trace_block_size=trace_block_size)
    if args.json:
        _write_json(args.json, stats)
    width = max(len(k) for k in stats)
    for k, v in stats.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        print(f"{k:<{width}}  {v}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvtriton.setups import DEFAULT_SETUPS, grammar_help
    from kvtriton.sim.cost import GPUS
    from kvtriton.sim.replay import DEFAULT_EVICTIONS
    from kvtriton.sim.simulate import ENGINES
    from kvtriton.specs import PRESETS

    ap = _Parser(prog="kvtriton", description="A CPU tier for an LLM server's KV cache: "
                 "simulate setups, replay traces through one cache tier, describe traces.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("simulate", help="serving-loop simulation, setups side by side")
    _add_workload_args(s)
    s.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    s.add_argument("--gpu", default="H100", choices=sorted(GPUS))
    for tier in ("gpu", "cpu"):
        s.add_argument(f"--{tier}-tokens", type=_positive_int, default=None,
                       help=f"{tier.upper()} capacity in tokens")
        s.add_argument(f"--{tier}-gib", type=_gib, default=None,
                       help=f"{tier.upper()} capacity in GiB of KV")
        s.add_argument(f"--{tier}-blocks", type=_positive_int, default=None,
                       help=f"{tier.upper()} capacity in blocks")
    s.add_argument("--store-blocks", type=_positive_int, default=None,
                   help="capacity of the shared second tier of setups with 'shared', blocks "
                        "(its link: Mooncake Store over loopback TCP as measured here); refused "
                        "when no setup in --setups has 'shared'")
    s.add_argument("--setups", type=_setups, default=list(DEFAULT_SETUPS),
                   help="comma-separated tier setups, e.g. eager+restore:0.5+tail, lazy+hints: "
                        + grammar_help().replace("%", "%%"))
    s.add_argument("--policies", type=_setups, dest="setups", action=_RenamedFlag, new="--setups",
                   help=argparse.SUPPRESS)
    s.add_argument("--token-budget", type=_positive_int, default=8192)
    s.add_argument("--sync-load-budget", type=_non_negative_int, default=0, metavar="BYTES",
                   help="bytes of CPU hits per step loaded and computed in the step that admits "
                        "them, their load ahead of its compute (the connector's "
                        "sync_load_budget_bytes; default 0: every CPU hit waits a step for its "
                        "load)")
    s.add_argument("--max-running", type=_positive_int, default=256)
    s.add_argument("--integrity", action="store_true",
                   help="move real bytes through the TransferEngine and check every block "
                        "when it is loaded or registered under a key")
    # None, not "torch", so that --engine vllm can tell a given backend from the default.
    s.add_argument("--integrity-backend", choices=("torch", "triton"), default=None,
                   help="torch or triton (default: torch); only with --integrity")
    s.add_argument("--no-bound", action="store_true",
                   help="skip the references: the next-use (oracle) and unbounded-tier "
                        "(upper bound) runs and the cache-only Belady replay")
    s.add_argument("--json", metavar="PATH")
    s.add_argument("--plot", metavar="PATH", help="PNG: hit rate and TTFT per setup")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--engine", choices=ENGINES, default="kvtriton",
                   help="which scheduler runs the workload: kvtriton's own ServingLoop "
                        "(default) or vLLM's real Scheduler with the kvtriton connector, timed "
                        "by the same cost model (no model runs)")
    s.set_defaults(func=_cmd_simulate)

    r = sub.add_parser("replay", help="cache-only replay: hit rate vs capacity per eviction rule")
    _add_workload_args(r)
    r.add_argument("--capacities", type=lambda t: [_positive_int(x) for x in _csv(t)],
                   default=None, help="comma-separated capacities in tokens (default: a sweep)")
    r.add_argument("--evictions", type=_csv, default=list(DEFAULT_EVICTIONS),
                   help="comma-separated, from: lru, arc, s3fifo, belady")
    r.add_argument("--json", metavar="PATH")
    r.add_argument("--plot", metavar="PATH", help="PNG: hit rate vs capacity")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_cmd_replay)

    t = sub.add_parser("trace-stats", help="describe a trace file or folder")
    t.add_argument("file", help="a trace file or folder, or a shipped trace by name (mooncake, "
                                "cc_agentic, glm5)")
    t.add_argument("--trace-block-size", type=_positive_int, default=None,
                   help="tokens per block id of a Mooncake-format file (default 512)")
    t.add_argument("--block-size", type=_positive_int, default=None,
                   help="hash block size (default: the trace's own)")
    t.add_argument("--json", metavar="PATH")
    t.set_defaults(func=_cmd_trace_stats)
    return ap


def _one_line(message: str) -> str:
    """``message`` on one line: a newline inside a path or a value is shown escaped."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def main(argv: list[str] | None = None) -> int:
    from kvtriton.sim.errors import IntegrityError, UncleanEndError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except IntegrityError as e:
        print(f"kvtriton: integrity check failed: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except UncleanEndError as e:  # a bug, not bad input: exit 1 like a failed check
        print(f"kvtriton: the run did not end clean: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except _UsageError as e:
        print(f"kvtriton: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as e:
        if os.environ.get("KVTRITON_DEBUG"):
            raise
        # TraceError is a ValueError; its message already names the file and line.
        msg = _one_line(str(e)) if str(e) else type(e).__name__
        print(f"kvtriton: error: {msg}", file=sys.stderr)
        return 2
    except MemoryError:
        # A size far beyond this machine (a capacity, a request length in a trace): a bad input.
        print("kvtriton: error: out of memory: a capacity or a request length is too large for "
              "this machine", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtriton: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
