"""IPython magics: a thin layer that parses arguments and calls the API (ipyparallel's style).

``%shard_cluster start|status|stop|restart|recover|diagnose``, ``%px`` / ``%%px`` (bounded waits on the
sharddbg cluster), ``%%shard_trace`` (run a cell under the recorder on every rank), ``%shard_inspect``.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, cell_magic, magics_class

from . import errors


class _Parser(argparse.ArgumentParser):
    """argparse that raises a UsageError instead of exiting the kernel."""

    def error(self, message):
        from IPython.core.error import UsageError

        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):
        from IPython.core.error import UsageError

        if message:
            raise UsageError(message)
        raise UsageError(self.format_help())


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (NaN, inf, 0 and words are refused here, before
    anything is sent to a rank)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds above 0")
    return value


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def split_words(line: str, prog: str) -> list[str]:
    """``shlex.split`` with a usage error (not a raw ValueError) for an unbalanced quote."""
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot read the options ({exc}): {line!r}") from None


def _cluster_parser() -> _Parser:
    parser = _Parser(prog="%shard_cluster", description="Start, inspect and stop the sharddbg cluster.")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)
    start = sub.add_parser("start", help="start N ranks (CPU+gloo here, GPU+NCCL where GPUs exist)")
    start.add_argument("-n", type=count, default=None, help="number of ranks")
    start.add_argument("--mesh", default=None, help="e.g. ddp=1,domain=4 (one axis may be left out)")
    start.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    start.add_argument("--timeout", type=seconds, default=60.0, help="default wait for engine calls, seconds")
    start.add_argument("--collective-timeout", type=seconds, default=60.0,
                       help="torch.distributed collective timeout, seconds")
    start.add_argument("--force", action="store_true",
                       help="start even when the ranks would not fit in the memory available now")
    sub.add_parser("status", help="one row per rank")
    stop = sub.add_parser("stop", help="stop the active cluster")
    stop.add_argument("--all", action="store_true",
                      help="also reap every cluster sharddbg left behind on this machine (owner process gone)")
    sub.add_parser("restart", help="new engines, same settings")
    recover = sub.add_parser("recover", help="release ranks blocked in a collective, new process group")
    recover.add_argument("--timeout", type=seconds, default=None)
    diagnose = sub.add_parser("diagnose", help="where is every rank now (stack, pending collective)")
    diagnose.add_argument("--timeout", type=seconds, default=5.0)
    return parser


def _px_parser() -> _Parser:
    parser = _Parser(prog="%px", description="Run code on the ranks of the sharddbg cluster, with a bounded wait.")
    parser.add_argument("--timeout", type=seconds, default=None, help="seconds to wait (default: the cluster's)")
    parser.add_argument("--targets", "-t", default=None, help="ranks, e.g. 0 or 0,2 or 1:3 or 2:")
    return parser


def _trace_parser() -> _Parser:
    parser = _Parser(prog="%%shard_trace", description="Run the cell on every rank under the recorder.")
    parser.add_argument("--max-events", type=count, default=200_000)
    parser.add_argument("--timeout", type=seconds, default=None)
    parser.add_argument("--no-unmask", action="store_true",
                        help="leave the generic 'unsupported operand type(s)' TypeError as PyTorch raises it")
    parser.add_argument("--quiet", action="store_true", help="no summary line after the cell")
    return parser


_TARGET = re.compile(r"^-?\d+$")
_SLICE = re.compile(r"^(-?\d*):(-?\d*)(?::(-?\d*))?$")


def parse_targets(text: str | None, n: int | None = None):
    """``-t`` as ranks: "2" -> [2], "0,2" -> [0, 2], "1:3" / "2:" / "::2" -> a slice (resolved against the
    ``n`` ranks when given). A usage error for anything else, or for a choice that names no rank."""
    if text is None:
        return None
    text = text.strip()
    m = _SLICE.match(text)
    if m:
        parts = [int(p) if p else None for p in m.groups()]
        if parts[2] == 0:
            raise UsageError(f"-t {text}: a slice step cannot be 0")
        chosen = slice(*parts)
        if n is not None:
            chosen = list(range(n))[chosen]
            if not chosen:
                raise UsageError(f"-t {text} names no rank; the cluster has ranks 0..{n - 1}")
        return chosen
    words = [w.strip() for w in text.split(",")]
    if not words or not all(_TARGET.match(w) for w in words):
        raise UsageError(f"-t {text}: ranks are written 2, or 0,2, or 1:3, or 2: (a slice)")
    return [int(w) for w in words]


_PX_OPTION = re.compile(r"^\s*(--timeout|--targets|-t)(?:=|\s+)(\S+)")


def split_px_line(line: str):
    """``--timeout 5 -t 0,1 print(rank)`` -> (options, "print(rank)"): options first, then code verbatim."""
    words = []
    while (match := _PX_OPTION.match(line)) is not None:
        words += [match.group(1), match.group(2)]
        line = line[match.end():]
    return _px_parser().parse_args(words), line.strip()


def hide_own_frames() -> bool:
    """sharddbg's own frames are left out of tracebacks, unless ``SHARDDBG_DEBUG=1`` (for debugging sharddbg)."""
    return errors.hide_own_frames()


@magics_class
class ShardMagics(Magics):
    @line_magic
    def shard_cluster(self, line):
        from .cluster import Cluster, active_cluster, registry

        __tracebackhide__ = hide_own_frames()
        args = _cluster_parser().parse_args(split_words(line, "%shard_cluster"))
        if args.action == "start":
            current = active_cluster(required=False)
            if current is not None:
                raise errors.ClusterError(
                    f"a sharddbg cluster is already running ({current.n} ranks, mesh {current.mesh}); "
                    f"%shard_cluster stop it first, or %shard_cluster restart")
            cl = Cluster(n=args.n, mesh=args.mesh, backend=args.backend, timeout=args.timeout,
                         collective_timeout=args.collective_timeout, force=args.force)
            cl.start()
            print(f"sharddbg: {cl.n} ranks ready in {cl.timings['start_s']:.1f} s, mesh ddp={cl.mesh.ddp} x "
                  f"domain={cl.mesh.domain}, backend {cl.backend}, patches {cl.patch_mode}. "
                  f"%px / %%px now run on these ranks.")
            return None
        if args.action == "stop":
            current = active_cluster(required=False)
            if current is None and not args.all:
                raise errors.NoActiveClusterError(
                    "no sharddbg cluster is running in this kernel; nothing to stop "
                    "(%shard_cluster stop --all reaps clusters left by other, dead kernels)")
            if current is not None:
                current.stop()
                print(f"sharddbg: stopped {current.n} ranks in {current.timings['stop_s']:.1f} s")
            if args.all:
                reaped = registry.reap_orphans()
                for cluster_id, pids in reaped.items():
                    print(f"sharddbg: reaped cluster {cluster_id} ({len(pids)} processes)")
                others = [r for r in registry.all_records() if r.owner_alive()]
                if others:
                    owners = ", ".join(f"{r.cluster_id} (owner pid {r.owner.pid})" for r in others)
                    print(f"sharddbg: left alone {len(others)} cluster(s) whose owner still runs: {owners}; "
                          f"`sharddbg reap --all` in a shell stops those too")
            return None
        cl = active_cluster()
        if args.action == "status":
            return cl.status()
        if args.action == "restart":
            cl.restart()
            print(f"sharddbg: restarted {cl.n} ranks in {cl.timings.get('restart_s', cl.timings['start_s']):.1f} s")
            return None
        if args.action == "recover":
            cl.recover(timeout=args.timeout)
            print("sharddbg: process group re-created on every rank; rebuild ShardTensors made before")
            return None
        if args.action == "diagnose":
            busy = cl.busy_ranks()
            report = cl.hang_report(0, [r for r in range(cl.n) if r not in busy], busy, what="their current work",
                                    diagnose_timeout=args.timeout)
            print(report.format() if busy else "every rank is idle")
            return report
        return None

    @line_cell_magic
    def px(self, line, cell=None):
        """Run code on every rank of the sharddbg cluster; output per rank; bounded wait."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args, code = split_px_line(line)
        if cell is not None:
            if code:
                raise UsageError(f"%%px options are --timeout S and --targets RANKS; not understood: {code!r}")
            code = cell
        if not code.strip():
            raise UsageError("%px needs code: %px print(rank)  or a %%px cell")
        cl = active_cluster()
        cl.run(code, timeout=args.timeout, targets=parse_targets(args.targets, cl.n))

    @cell_magic
    def shard_trace(self, line, cell):
        """Run the cell on every rank under the recorder, gather one Trace (``sharddbg.last_trace()``)."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = _trace_parser().parse_args(split_words(line, "%%shard_trace"))
        cl = active_cluster()
        try:
            cl.trace(cell, timeout=args.timeout, max_events=args.max_events, unmask=not args.no_unmask)
        finally:
            # the trace is kept even when the cell failed: summarise it before the error shows
            trace = cl.last_trace(required=False)
            if not args.quiet and trace is not None:
                print(trace_summary(trace))

    @line_magic
    def shard_inspect(self, line):
        """Show the ShardTensor named on the line (a variable on the engines)."""
        __tracebackhide__ = hide_own_frames()
        import sharddbg

        name = line.strip()
        if not name.isidentifier():
            raise UsageError(f"%shard_inspect takes the name of a variable on the engines, got {name!r}")
        return sharddbg.inspect(name)


def trace_summary(trace) -> str:
    """One line after a %%shard_trace cell: what was recorded and where to look next."""
    ops = trace.get_ops()
    fallbacks = trace.get_fallbacks()
    errors_ = trace.get_errors()
    parts = [f"sharddbg: recorded {len(ops)} op calls on {len(trace.ranks)} ranks"]
    if len(fallbacks):
        parts.append(f"{len(fallbacks)} op(s) took a DTensor fallback ({', '.join(map(str, fallbacks['op'][:4]))}"
                     f"{', ...' if len(fallbacks) > 4 else ''})")
    if len(errors_):
        parts.append(f"{len(errors_)} error(s) recorded")
    if trace.incomplete_ranks:
        parts.append(f"ranks {trace.incomplete_ranks} incomplete")
    if trace.dropped:
        parts.append(f"{trace.dropped} events dropped (raise --max-events)")
    return "; ".join(parts) + ". sharddbg.last_trace() has it all."


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(ShardMagics)
