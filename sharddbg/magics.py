"""IPython magics: a thin layer that parses arguments and calls the API, with ipyparallel's conventions.

``%shard_cluster start|status|stop|connect|disconnect|restart|recover|diagnose`` (subcommands, each with its own options:
``%shard_cluster start --help``); ``%px`` / ``%%px`` (ipyparallel's options:
``--targets``, ``--block`` / ``--noblock``, ``--group-outputs``, ``--stream``, ``--local``, ``--verbose``, ``-o``;
every wait bounded by ``--timeout`` or the cluster's), ``%pxresult``, ``%pxconfig``, ``%autopx``;
``%%shard_trace`` (run a cell under the recorder on every rank), ``%shard_inspect``, ``%%shard_check`` (the
numerical check), ``%%shard_diff`` (the op-by-op diff), ``%shard_doctor`` (the pitfall doctor). Every magic is declared
with IPython's ``magic_arguments``: ``%px?`` shows its options, bad arguments give a ``UsageError``.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
import shlex
from dataclasses import dataclass, field

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, cell_magic, magics_class

from . import errors
from .cluster.arguments import repeated_ranks, variable_name
from .cluster.execution import GROUPINGS
from .options import DEFAULT_MAX_EVENTS, RecordingOptions


def _bounded(text: str, convert, not_a_number: str, allowed, out_of_range: str):
    """``convert(text)`` if it is finite and ``allowed``; else argparse's type error (IPython shows it as a
    usage error, before anything is sent to a rank) reading "'<text>' <not_a_number>" for a word and
    "'<text>' <out_of_range>" for a value out of range."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {not_a_number}") from None
    if math.isnan(value) or math.isinf(value) or not allowed(value):
        raise argparse.ArgumentTypeError(f"{text!r} {out_of_range}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (NaN, inf, 0 and words are refused)."""
    return _bounded(text, float, "is not a number of seconds", lambda v: v > 0,
                    "is not a finite number of seconds above 0")


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    return _bounded(text, int, "is not a whole number", lambda v: v >= 1, "must be at least 1")


def tolerance(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    return _bounded(text, float, "is not a number", lambda v: v >= 0, "is not a finite number of at least 0")


def memory_bytes(text: str) -> float:
    """An argparse type: a finite number of bytes above 0."""
    return _bounded(text, float, "is not a number of bytes", lambda v: v > 0, "is not a number of bytes above 0")


def split_words(line: str, prog: str) -> list[str]:
    """``shlex.split`` with a usage error (not a raw ValueError) for an unbalanced quote; a ``# comment`` after
    the options is left out, as in a cell."""
    try:
        return shlex.split(line, comments=True)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot read the options ({exc}): {line!r}") from None


def parse_options(magic, words: list[str], prog: str) -> argparse.Namespace:
    """``words`` read by the parser IPython's ``magic_arguments`` built for ``magic``; a usage error names the
    magic and where its options are listed."""
    try:
        return magic.parser.parse_args(words)
    except UsageError as exc:
        raise UsageError(f"{prog}: {exc} ({prog}? lists the options)") from None


@dataclass(frozen=True)
class MagicOption:
    """One option of a magic: its flags and the keywords of argparse's ``add_argument``."""

    flags: tuple[str, ...]
    settings: dict = field(default_factory=dict)

    @property
    def takes_value(self) -> bool:
        return self.settings.get("action", "store") == "store"


def with_options(options: list[MagicOption]):
    """Declare ``options`` on a magic (IPython's ``magic_arguments.argument``), listed in their order."""

    def declare(func):
        for option in reversed(options):
            func = magic_arguments.argument(*option.flags, **option.settings)(func)
        return func

    return declare


class HelpShown(Exception):
    """A subcommand's ``--help`` was printed: the magic does nothing else."""


class SubcommandHelpFormatter(magic_arguments.MagicHelpFormatter):
    """IPython's help layout, with argparse's ``usage:`` before the line (printed by ``--help``, and one block
    of the magic's docstring per subcommand)."""

    def add_usage(self, usage, actions, groups, prefix="usage: %"):
        super().add_usage(usage, actions, groups, prefix)


class SubcommandParser(magic_arguments.MagicArgumentParser):
    """The parser of one subcommand: a bad argument is a ``UsageError`` (as for every magic); ``--help`` prints
    its help and raises ``HelpShown`` where argparse would exit the process."""

    def exit(self, status=0, message=None):
        raise HelpShown()


class subcommands(magic_arguments.ArgDecorator):
    """Declare that a magic's first word names a subcommand (``%magic NAME [its options]``), each declared
    below with ``@subcommand``; ``dest``: the attribute of the parsed arguments that holds the name."""

    def __init__(self, dest: str):
        self.dest = dest

    def add_to_parser(self, parser, group):
        # returned as the group the @subcommand declarations below add to, as argument_group's is for arguments
        return parser.add_subparsers(dest=self.dest, required=True, title="subcommands", parser_class=SubcommandParser)


class subcommand(magic_arguments.ArgDecorator):
    """Declare one subcommand of a magic (below its ``@subcommands``): its name, what it does (one line in the
    list of subcommands, and the start of its own help) and exactly its own options. Its help is printed by
    ``%magic NAME --help`` and added to the magic's docstring (``%magic?``)."""

    def __init__(self, name: str, summary: str, *options: MagicOption):
        self.name = name
        self.summary = summary
        self.options = options

    @property
    def flags(self) -> set[str]:
        return {flag for option in self.options for flag in option.flags}

    def add_to_parser(self, parser, group):
        if not hasattr(group, "add_parser"):
            raise TypeError(f"subcommand {self.name!r}: declare @subcommands(...) above the first @subcommand")
        own = group.add_parser(self.name, help=self.summary.replace("%", "%%"), description=self.summary,
                               formatter_class=SubcommandHelpFormatter)
        own.add_argument("-h", "--help", action="help", help="show these options and do nothing else")
        for option in self.options:
            own.add_argument(*option.flags, **option.settings)
        parser.epilog = (parser.epilog or "") + "\n" + own.format_help()
        return group


def parse_subcommand(magic, line: str, prog: str) -> argparse.Namespace | None:
    """``line`` read by the parser of ``magic``, declared with ``@subcommands``; None when a subcommand's
    ``--help`` was printed. A usage error names the magic and where its options are listed; an option of
    another subcommand is named as such."""
    words = split_words(line, prog)
    try:
        args, extras = magic.parser.parse_known_args(words)
    except HelpShown:
        return None
    except UsageError as exc:
        raise UsageError(f"{prog}: {exc} ({prog}? lists the options)") from None
    if not extras:
        return args
    (declared,) = [d for d in magic.decorators if isinstance(d, subcommands)]
    name = getattr(args, declared.dest)
    flag = next((word.split("=", 1)[0] for word in extras if word.startswith("-")), None)
    owners = [d.name for d in reversed(magic.decorators) if isinstance(d, subcommand) and flag in d.flags]
    if name in owners:
        raise UsageError(f"{prog}: {flag} goes after the subcommand: {prog} {name} {flag} "
                         f"({prog} {name} --help lists its options)")
    if owners:
        owners = " and ".join([", ".join(owners[:-1]), owners[-1]] if len(owners) > 1 else owners)
        raise UsageError(f"{prog} {name}: {flag} is an option of {owners} ({prog}? lists the options)")
    raise UsageError(f"{prog} {name}: unrecognized arguments: {' '.join(extras)} "
                     f"({prog} {name} --help lists its options)")


TIMEOUT = MagicOption(("--timeout",), dict(
    type=seconds, default=None, metavar="S",
    help="the cell's time limit in seconds, counted from when it is sent (default: the cluster's, "
         "%%shard_cluster start --timeout). Past it, the ranks still running are reported with where each "
         "waits (RankTimeoutError)"))
TARGETS = MagicOption(("-t", "--targets"), dict(
    default=None, metavar="RANKS",
    help="the ranks to run on, as ipyparallel writes them: 2, 0,2, [0,2], 1:3, 2:, ::2, -1 (the last) or all "
         "(the default)"))
# ipyparallel options that sharddbg has no use for: refused with what to use instead
UNSUPPORTED = {
    "progress_after": "--progress-after: sharddbg shows no progress bar; --stream prints each rank's lines as "
                      "they arrive, and --noblock returns a handle whose wait(seconds) / done() say how far it is",
    "signal_on_interrupt": "--signal-on-interrupt: Ctrl-C stops waiting and leaves the cell running on the ranks; "
                           "%shard_cluster recover releases ranks blocked in a collective and interrupts (SIGINT) "
                           "the ones still running",
}


def _refused_help(dest: str) -> str:
    # argparse %-formats help text: a literal % is written %%
    return "ipyparallel's, refused: " + UNSUPPORTED[dest].split(": ", 1)[1].replace("%", "%%")


EXEC_OPTIONS = [
    TIMEOUT,
    TARGETS,
    MagicOption(("-b", "--block"), dict(action="store_const", const=True, dest="block",
                                        help="wait for the cell, at most its time limit (the default)")),
    MagicOption(("-a", "--noblock"), dict(
        action="store_const", const=False, dest="block",
        help="return at once with the cell's handle (a PendingCell): h.wait(seconds), h.done(), h.get() (waits "
             "at most to the time limit, prints each rank's output), or %%pxresult")),
    MagicOption(("--stream",), dict(action="store_const", const=True, dest="stream",
                                    help="print each rank's lines as they arrive, prefixed with the rank")),
    MagicOption(("--no-stream",), dict(action="store_const", const=False, dest="stream",
                                       help="print each rank's output once the cell is over, in rank order "
                                            "(the default)")),
    MagicOption(("--verbose",), dict(action="store_const", const=True, dest="verbose",
                                     help="say which ranks run the cell, and its time limit")),
    MagicOption(("--no-verbose",), dict(action="store_const", const=False, dest="verbose",
                                        help="say nothing before the output (the default)")),
    MagicOption(("--progress-after",), dict(default=None, metavar="S", help=_refused_help("progress_after"))),
    MagicOption(("--signal-on-interrupt",), dict(default=None, metavar="SIGNAL",
                                                 help=_refused_help("signal_on_interrupt"))),
]
OUTPUT_OPTIONS = [
    MagicOption(("--group-outputs",), dict(
        dest="groupby", choices=GROUPINGS, default=None,
        help="type (the default): every rank's stdout, then every rank's stderr, then rich output, then values; "
             "engine: each rank's output together; order: as type, rich output collated (each rank's first, "
             "then each rank's second, ...). Ranks in rank order in each")),
    MagicOption(("-r",), dict(action="store_const", const="order", dest="groupby",
                              help="same as --group-outputs order")),
    MagicOption(("-e",), dict(action="store_const", const="engine", dest="groupby",
                              help="same as --group-outputs engine")),
    MagicOption(("-o", "--out"), dict(dest="save_name", default=None, metavar="NAME",
                                      help="also keep the cell's handle (a PendingCell) in the variable NAME")),
]
PX_OPTIONS = EXEC_OPTIONS + OUTPUT_OPTIONS + [
    MagicOption(("--local",), dict(action="store_true",
                                   help="also run the cell here, in the notebook, once it was sent to the ranks")),
]
PX_FLAGS = {flag: option for option in PX_OPTIONS for flag in option.flags}


@dataclass
class PxDefaults:
    """What %px / %%px / %autopx do where their options do not say (``%pxconfig`` changes it)."""

    block: bool = True
    targets: str | None = None  # the -t text, read against the active cluster when a cell runs; None: every rank
    timeout: float | None = None  # None: the cluster's
    stream: bool = False
    verbose: bool = False

    def describe(self) -> str:
        """One line: what %px does now."""
        waits = "waits for the cell" if self.block else "returns a handle at once (--noblock)"
        ranks = "every rank" if self.targets is None else f"ranks {self.targets}"
        limit = "the cluster's" if self.timeout is None else f"{self.timeout:g} s"
        output = "as it arrives (--stream)" if self.stream else "in rank order at the end"
        return f"%px {waits}, on {ranks}, time limit {limit}, output {output}{', verbose' if self.verbose else ''}"


def refuse_unsupported(args: argparse.Namespace, prog: str) -> None:
    """A usage error naming sharddbg's way for an ipyparallel option it does not take."""
    for dest, message in UNSUPPORTED.items():
        if getattr(args, dest, None) is not None:
            raise UsageError(f"{prog}: {message}")


_RANK = re.compile(r"^-?\d+$")
_SLICE = re.compile(r"^(-?\d*):(-?\d*)(?::(-?\d*))?$")


def parse_targets(text: str | None, n: int | None = None):
    """``-t`` as ranks, in ipyparallel's forms: "2" -> [2], "0,2" / "[0,2]" / "(0,2)" -> [0, 2], "1:3" / "2:" /
    "::2" -> a slice, "all" -> None (every rank). With the cluster's ``n`` ranks known, a slice becomes its
    ranks and a negative rank counts from the end ("-1": the last). A usage error for anything else, or for a
    choice that names no rank."""
    if text is None:
        return None
    text = text.strip()
    if text == "all":
        return None
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
    if _RANK.match(text) or (len(words) > 1 and all(_RANK.match(w) for w in words)):
        ranks = [int(w) for w in words]
    else:
        try:
            value = ast.literal_eval(text) if text[:1] in "[(" else None
        except (ValueError, SyntaxError):
            value = None
        if not (isinstance(value, (list, tuple)) and value and all(type(r) is int for r in value)):
            raise UsageError(f"-t {text}: ranks are written 2, or 0,2, or [0,2], or 1:3, or 2: (a slice), or all")
        ranks = list(value)
    if n is not None:
        ranks = [r + n if -n <= r < 0 else r for r in ranks]
    repeated = repeated_ranks(ranks)
    if repeated:  # each would run the cell twice, one run after the other
        which = f"rank {repeated[0]}" if len(repeated) == 1 else f"ranks {repeated}"
        raise UsageError(f"-t {text} names {which} more than once; a cell runs once on each rank: give each rank "
                         f"once (-t {','.join(map(str, dict.fromkeys(ranks)))})")
    return ranks


_WORD = re.compile(r"""\s*('[^']*'|"[^"]*"|\S+)""")


def split_px_line(line: str):
    """``--timeout 5 -t 0,1 print(rank)`` -> (options, "print(rank)"): %px's options first, then the code
    verbatim. The options end at the first word that is not one (or at ``--``); an unknown option is an error,
    not code."""
    words = []
    pos = 0
    wants_value = False
    while (match := _WORD.match(line, pos)) is not None:
        word = match.group(1)
        if wants_value:
            words.append(word[1:-1] if word[:1] in "'\"" and word[-1:] == word[:1] and len(word) > 1 else word)
            wants_value = False
        elif word == "--":
            pos = match.end()
            break
        elif word.startswith("-") and len(word) > 1 and not word[1].isdigit():
            flag = word.split("=", 1)[0]
            option = PX_FLAGS.get(flag)
            if option is None and PX_FLAGS.get(word[:2]) is not None and PX_FLAGS[word[:2]].takes_value:
                flag, option = word[:2], PX_FLAGS[word[:2]]  # a short option with its value attached: -t0
                word = f"{flag}={word[2:]}"
            if option is None:
                raise UsageError(f"%px: unknown option {flag} (%px? lists the options; code that starts with - "
                                 f"goes after --)")
            words.append(word)
            wants_value = option.takes_value and "=" not in word
        else:
            break
        pos = match.end()
    return parse_options(ShardMagics.px, words, "%px"), line[pos:].strip()


def hide_own_frames() -> bool:
    """sharddbg's own frames are left out of tracebacks, unless ``SHARDDBG_DEBUG=1`` (for debugging sharddbg)."""
    return errors.hide_own_frames()


# cells that %autopx leaves to run here: the ones that start with a sharddbg magic
_OWN_MAGIC = re.compile(r"^%{1,2}(autopx|px|pxresult|pxconfig|shard_\w+)\b")


@magics_class
class ShardMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.px_defaults = PxDefaults()
        self.last_result = None  # the handle of the last %px cell (%pxresult shows it)
        self.autopx_enabled = False

    @magic_arguments.magic_arguments()
    @subcommands("action")
    @subcommand(
        "start", "start N ranks (CPU+gloo here, GPU+NCCL where GPUs exist)",
        MagicOption(("-n",), dict(type=count, default=None, help="number of ranks")),
        MagicOption(("--mesh",), dict(default=None,
                                      help="e.g. ddp=1,domain=4 (one axis may be left out: it is inferred)")),
        MagicOption(("--backend",), dict(choices=["gloo", "nccl"], default=None,
                                         help="the torch.distributed backend (default: nccl with GPUs, else gloo)")),
        MagicOption(("--timeout",), dict(type=seconds, default=60.0, metavar="S",
                                         help="the default time limit of a cell or call, seconds (60)")),
        MagicOption(("--collective-timeout",), dict(type=seconds, default=60.0, metavar="S",
                                                    help="torch.distributed's collective timeout, seconds (60)")),
        MagicOption(("--force",), dict(action="store_true",
                                       help="start even when the ranks would not fit in the memory available now")))
    @subcommand(
        "status", "one row per rank",
        MagicOption(("--full",), dict(action="store_true",
                                      help="every column (versions, engine ids, patch details), not the 8 that "
                                           "matter first")))
    @subcommand(
        "stop", "stop the active cluster",
        MagicOption(("--all",), dict(action="store_true",
                                     help="also reap every cluster sharddbg left behind on this machine (owner "
                                          "process gone)")))
    @subcommand(
        "connect", "connect to a detached cluster (started in a terminal by `sharddbg cluster start`)",
        MagicOption(("name",), dict(nargs="?", default=None, metavar="NAME",
                                    help="its name (default: the only one; `sharddbg cluster list` shows them)")),
        MagicOption(("--timeout",), dict(type=seconds, default=60.0, metavar="S",
                                         help="the default time limit of a cell or call, seconds (60)")))
    @subcommand("disconnect", "leave the connected detached cluster running and stop using it here")
    @subcommand("restart", "new engines, same settings")
    @subcommand(
        "recover", "release ranks blocked in a collective and make a new process group",
        MagicOption(("--timeout",), dict(type=seconds, default=None, metavar="S",
                                         help="how long ranks get to be released, seconds (default: the "
                                              "cluster's time limit)")))
    @subcommand(
        "diagnose", "where every rank is now (stack, pending collective)",
        MagicOption(("--timeout",), dict(type=seconds, default=5.0, metavar="S",
                                         help="how long each rank gets to answer, seconds (5)")))
    @line_magic
    def shard_cluster(self, line):
        """Start, inspect and stop the sharddbg cluster (the ranks %px runs on). Each subcommand's options are
        below; ``%shard_cluster start --help`` prints one subcommand's (IPython reads ``%shard_cluster start?``
        as help on a variable ``start``)."""
        from .cluster import Cluster, active_cluster, registry

        __tracebackhide__ = hide_own_frames()
        args = parse_subcommand(self.shard_cluster, line, "%shard_cluster")
        if args is None:  # a subcommand's --help was printed
            return None
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
        if args.action == "connect":
            current = active_cluster(required=False)
            if current is not None:
                raise errors.ClusterError(
                    f"a sharddbg cluster is already active in this kernel ({current.n} ranks); %shard_cluster "
                    f"disconnect (a connected one) or %shard_cluster stop it first")
            cl = Cluster.connect(args.name, timeout=args.timeout)
            print(f"sharddbg: connected to {cl.n} ranks in {cl.timings['connect_s']:.1f} s, mesh ddp={cl.mesh.ddp} x "
                  f"domain={cl.mesh.domain}, backend {cl.backend}, patches {cl.patch_mode}"
                  + (f"; its process group is broken: {cl.broken}" if cl.broken else "")
                  + ". %px / %%px now run on these ranks; %shard_cluster disconnect leaves them running.")
            return None
        cl = active_cluster()
        if args.action == "disconnect":
            cl.disconnect()
            print(f"sharddbg: disconnected; the cluster runs on (`sharddbg cluster stop NAME` in a terminal stops it)")
            return None
        if args.action == "status":
            return cl.status(full=args.full)
        if args.action == "restart":
            cl.restart()
            print(f"sharddbg: restarted {cl.n} ranks in {cl.timings.get('restart_s', cl.timings['start_s']):.1f} s")
            return None
        if args.action == "recover":
            cl.recover(timeout=args.timeout)
            print("sharddbg: process group re-created on every rank; rebuild ShardTensors made before")
            return None
        if args.action == "diagnose":
            # printed, not returned: a returned report would also show as its repr (cl.hang_report() gives the object)
            busy = cl.busy_ranks()
            if not busy:
                print("every rank is idle" + (f"\nthe process group is broken: {cl.broken}" if cl.broken else ""))
                return None
            report = cl.hang_report(0, [r for r in range(cl.n) if r not in busy], busy, what="their current work",
                                    diagnose_timeout=args.timeout)
            print(report.format())
            return None
        return None

    @magic_arguments.magic_arguments()
    @with_options(PX_OPTIONS)
    @line_cell_magic
    def px(self, line, cell=None):
        """Run code on the ranks of the sharddbg cluster: ``%px print(rank)`` (options first, then the code) or
        a ``%%px`` cell. ipyparallel's %px options, with one difference: every wait is bounded (``--timeout``,
        default the cluster's). The output comes per rank, each line prefixed with its rank, once the cell is
        over (``--stream``: as it arrives), with each rank's value of the last expression (``[rank 0 Out]``).
        ``%pxconfig`` changes the defaults; ``%autopx`` sends every cell."""
        __tracebackhide__ = hide_own_frames()
        if cell is None:
            args, code = split_px_line(line)
            prog = "%px"
        else:
            args, code, prog = parse_options(self.px, split_words(line, "%%px"), "%%px"), cell, "%%px"
        refuse_unsupported(args, prog)
        if not code.strip():
            raise UsageError("%px needs code: %px print(rank)  or a %%px cell")
        if args.save_name is not None and not args.save_name.isidentifier():
            raise UsageError(f"{prog}: -o takes a variable name, got {args.save_name!r}")
        return self.run_px(code, args)

    def run_px(self, code: str, args: argparse.Namespace):
        """Send ``code`` as %px's ``args`` (and ``%pxconfig``'s defaults) say; its handle when not waited for."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        cl = active_cluster()
        defaults = self.px_defaults
        targets = parse_targets(defaults.targets if args.targets is None else args.targets, cl.n)
        block = defaults.block if args.block is None else args.block
        handle = cl.submit(code, timeout=defaults.timeout if args.timeout is None else args.timeout, targets=targets)
        handle.groupby = args.groupby or "type"
        handle.results = True
        handle.stream = defaults.stream if args.stream is None else args.stream
        self.last_result = handle
        if args.save_name:
            self.shell.user_ns[args.save_name] = handle
        if defaults.verbose if args.verbose is None else args.verbose:
            print(f"{'Parallel' if block else 'Async parallel'} execution on ranks {handle.ranks}, time limit "
                  f"{handle.timeout:g} s")
        if args.local:
            self.shell.run_cell(code)
        if not block:
            return handle
        handle.get()
        return None

    @magic_arguments.magic_arguments()
    @with_options(OUTPUT_OPTIONS + [MagicOption(("--timeout",), dict(
        type=seconds, default=None, metavar="S",
        help="wait at most this long for the cell (default: up to its own time limit); a shorter wait that ends "
             "first raises CellStillRunningError and changes nothing"))])
    @line_magic
    def pxresult(self, line):
        """Show the output of the last %px cell, each rank's in rank order, waiting for it if it still runs (at
        most to its time limit): the cell sent with ``%px --noblock`` comes back here. Raises what the cell
        raised."""
        __tracebackhide__ = hide_own_frames()
        args = parse_options(self.pxresult, split_words(line, "%pxresult"), "%pxresult")
        handle = self.last_result
        if handle is None:
            raise UsageError("%pxresult shows the output of the last %px cell; no %px cell ran yet")
        if args.save_name is not None:
            if not args.save_name.isidentifier():
                raise UsageError(f"%pxresult: -o takes a variable name, got {args.save_name!r}")
            self.shell.user_ns[args.save_name] = handle
            return None
        if args.groupby:
            handle.groupby = args.groupby
        shown_before = handle.shown
        try:
            handle.get(args.timeout)
        finally:
            if shown_before:
                handle.display_outputs()
        return None

    @magic_arguments.magic_arguments()
    @with_options(EXEC_OPTIONS)
    @line_magic
    def pxconfig(self, line):
        """Set what %px, %%px and %autopx do where their own options do not say (the ranks, waiting or not, the
        time limit, streaming, verbose); prints the settings."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = parse_options(self.pxconfig, split_words(line, "%pxconfig"), "%pxconfig")
        refuse_unsupported(args, "%pxconfig")
        defaults = self.px_defaults
        if args.targets is not None:
            current = active_cluster(required=False)
            chosen = parse_targets(args.targets, current.n if current is not None else None)  # refused now if bad
            defaults.targets = None if chosen is None else args.targets
        for name in ("block", "timeout", "stream", "verbose"):
            if getattr(args, name) is not None:
                setattr(defaults, name, getattr(args, name))
        print(defaults.describe())

    @magic_arguments.magic_arguments()
    @line_magic
    def autopx(self, line):
        """Toggle auto-parallel mode: every cell then runs on the ranks as a %%px cell (with %pxconfig's
        settings), except cells that start with a sharddbg magic (%autopx again ends the mode)."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        parse_options(self.autopx, split_words(line, "%autopx"), "%autopx")
        transforms = self.shell.input_transformers_cleanup
        if self.autopx_enabled:
            transforms.remove(self.to_px_cell)
            self.autopx_enabled = False
            print("%autopx disabled")
            return
        active_cluster()  # with no cluster every cell would fail: say so now
        transforms.append(self.to_px_cell)
        self.autopx_enabled = True
        print("%autopx enabled: every cell runs on the ranks (as %%px) until %autopx")

    def to_px_cell(self, lines: list[str]) -> list[str]:
        """%autopx's input transformer: the cell as a %%px cell, unless it is empty or starts with a sharddbg
        magic."""
        first = next((line.strip() for line in lines if line.strip()), "")
        if not first or _OWN_MAGIC.match(first):
            return lines
        return ["%%px\n", *lines]

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--max-events", type=count, default=DEFAULT_MAX_EVENTS, metavar="N",
                              help=f"events kept per rank ({DEFAULT_MAX_EVENTS}); beyond it events are counted as "
                                   f"dropped")
    @magic_arguments.argument("--timeout", type=seconds, default=None, metavar="S",
                              help="the cell's time limit, seconds (default: the cluster's)")
    @magic_arguments.argument("--no-unmask", action="store_true",
                              help="leave the generic 'unsupported operand type(s)' TypeError as PyTorch raises it")
    @magic_arguments.argument("--quiet", action="store_true", help="no summary line after the cell")
    @magic_arguments.argument("--replicas", action="store_true",
                              help="digest every tensor that claims Replicate (op results, promoted weights) after "
                                   "each op and name the first op where the ranks diverge, with the largest "
                                   "difference (sharddbg.last_trace().get_replica_divergence()); costs a copy and a "
                                   "hash per tensor")
    @magic_arguments.argument("--preflight", action="store_true",
                              help="before each collective inside a recorded op, its group compares shapes, dtypes "
                                   "and splits through the rendezvous store (2 s at most): a mismatch raises "
                                   "CollectiveMismatchError on every rank of the group instead of hanging "
                                   "(sharddbg.last_trace().get_preflight())")
    @magic_arguments.argument("--memory", action="store_true",
                              help="on GPU ranks, the CUDA allocator's delta over each op (the mem_delta_bytes "
                                   "column of get_ops()); two counter reads per op")
    @magic_arguments.argument("--no-spec-check", action="store_true",
                              help="do not compare each ShardTensor result's spec with its local tensor (on by "
                                   "default: sharddbg.last_trace().get_spec_mismatches())")
    @cell_magic
    def shard_trace(self, line, cell):
        """Run the cell on every rank under the recorder and gather one Trace (``sharddbg.last_trace()``), kept
        even when the cell fails."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = parse_options(self.shard_trace, split_words(line, "%%shard_trace"), "%%shard_trace")
        options = RecordingOptions(max_events=args.max_events, unmask=not args.no_unmask,
                                   spec_check=not args.no_spec_check, replicas=args.replicas, preflight=args.preflight,
                                   memory=args.memory)
        cl = active_cluster()
        try:
            cl.trace(cell, timeout=args.timeout, options=options)
        finally:
            # the trace is kept even when the cell failed: summarise it before the error shows
            trace = cl.last_trace(required=False)
            if not args.quiet and trace is not None:
                print(trace_summary(trace))

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", nargs="*", metavar="NAME",
                              help="the name of a variable on the ranks that holds a ShardTensor")
    @line_magic
    def shard_inspect(self, line):
        """Show the ShardTensor named on the line (a variable on the ranks): who holds which block."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        name = " ".join(parse_options(self.shard_inspect, split_words(line, "%shard_inspect"), "%shard_inspect").name)
        name = variable_name(name)  # as Python binds it: `µ = ...` (MICRO SIGN) is stored as μ (GREEK MU)
        if not name.isidentifier():
            raise UsageError(f"%shard_inspect takes the name of a variable on the engines, got {name!r}")
        return active_cluster().inspect(name)

    # ---- verification: the numerical check and the pitfall doctor
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--inputs", default=None, metavar="NAMES",
                              help="the names bound to their full_tensor() in the unsharded reference, comma-separated "
                                   "(default: the tensors the cell reads)")
    @magic_arguments.argument("--outputs", default=None, metavar="NAMES",
                              help="the names compared after the cell (default: those it binds)")
    @magic_arguments.argument("--model", default=None, metavar="NAMES",
                              help="the modules copied with rank 0's weights whose parameter gradients are compared "
                                   "(default: the modules the cell reads)")
    @magic_arguments.argument("--loss", default=None, metavar="EXPR",
                              help="the loss the check's backward starts from (default: the sum of the mean squares "
                                   "of the outputs)")
    @magic_arguments.argument("--rtol", type=tolerance, default=None, metavar="R",
                              help="relative tolerance (default by dtype: float32 1e-4, float64 1e-7, ...)")
    @magic_arguments.argument("--atol", type=tolerance, default=None, metavar="A",
                              help="absolute tolerance (default: rtol x the largest magnitude of each reference tensor)")
    @magic_arguments.argument("--no-grads", action="store_true", help="compare the outputs only (no backward)")
    @magic_arguments.argument("--timeout", type=seconds, default=None, metavar="S",
                              help="seconds to wait for each step (default: the cluster's)")
    @cell_magic
    def shard_check(self, line, cell):
        """Run the cell on every rank (sharded), then unsharded in a separate process, and compare every output,
        input gradient and parameter gradient per tensor and rank (``Cluster.check``)."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = parse_options(self.shard_check, split_words(line, "%%shard_check"), "%%shard_check")
        return active_cluster().check(cell, inputs=args.inputs, outputs=args.outputs, model=args.model,
                                      loss=args.loss, rtol=args.rtol, atol=args.atol, grads=not args.no_grads,
                                      timeout=args.timeout)

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--inputs", default=None, metavar="NAMES",
                              help="the names bound to their full_tensor() in the unsharded reference, comma-separated "
                                   "(default: the tensors the cell reads)")
    @magic_arguments.argument("--outputs", default=None, metavar="NAMES",
                              help="the names compared after the cell (default: those it binds)")
    @magic_arguments.argument("--model", default=None, metavar="NAMES",
                              help="the modules copied with rank 0's weights (default: the modules the cell reads)")
    @magic_arguments.argument("--loss", default=None, metavar="EXPR",
                              help="the loss the backward starts from (default: the sum of the mean squares of the "
                                   "outputs)")
    @magic_arguments.argument("--rtol", type=tolerance, default=None, metavar="R",
                              help="relative tolerance (default by dtype: float32 1e-4, float64 1e-7, ...)")
    @magic_arguments.argument("--atol", type=tolerance, default=None, metavar="A",
                              help="absolute tolerance (default: rtol x the largest magnitude of each reference tensor)")
    @magic_arguments.argument("--ops", default=None, metavar="NAMES",
                              help="the ops to compare, comma-separated (conv2d or torch.conv2d; default: every op)")
    @magic_arguments.argument("--max-memory", type=memory_bytes, default=2 * 1024 ** 3, metavar="BYTES",
                              help="bytes the diff may keep on a rank and in the reference (default 2 GiB)")
    @magic_arguments.argument("--no-grads", action="store_true", help="compare the forward only (no backward)")
    @magic_arguments.argument("--blame", action="store_true",
                              help="when an op departs, re-run the cell in plain processes without sharddbg")
    @magic_arguments.argument("--timeout", type=seconds, default=None, metavar="S",
                              help="seconds to wait for each step (default: the cluster's)")
    @cell_magic
    def shard_diff(self, line, cell):
        """Run the cell sharded and unsharded as ``%%shard_check`` does, compare every op's output and gradient,
        and name the first op that departs (``Cluster.diff``)."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = parse_options(self.shard_diff, split_words(line, "%%shard_diff"), "%%shard_diff")
        return active_cluster().diff(cell, inputs=args.inputs, outputs=args.outputs, model=args.model,
                                     loss=args.loss, rtol=args.rtol, atol=args.atol, grads=not args.no_grads,
                                     ops=args.ops, max_memory=args.max_memory, blame=args.blame,
                                     timeout=args.timeout)

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("name", nargs="*", metavar="NAME",
                              help="variables on the ranks to examine (default: every one)")
    @magic_arguments.argument("--timeout", type=seconds, default=None, metavar="S",
                              help="seconds to wait for the ranks (default: the cluster's)")
    @line_magic
    def shard_doctor(self, line):
        """The pitfall doctor: one row per known ShardTensor pitfall, ok / warn / fail / skip, with the fix
        (``Cluster.doctor``)."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster

        args = parse_options(self.shard_doctor, split_words(line, "%shard_doctor"), "%shard_doctor")
        names = [variable_name(n) for word in args.name for n in word.split(",") if n]
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise UsageError(f"%shard_doctor takes names of variables on the engines, got {', '.join(map(repr, bad))}")
        return active_cluster().doctor(*names, timeout=args.timeout)

    # ---- a handler written in the notebook
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("op", metavar="OP",
                              help="the op, as get_fallbacks() names it: torch.diff, torch.nn.functional.silu, "
                                   "Tensor.add, aten.diff.default, mylib.op.default")
    @magic_arguments.argument("--kind", choices=["function", "dispatch"], default="function",
                              help="register_function_handler (default) or register_dispatch_handler")
    @magic_arguments.argument("--name", default=None, metavar="HANDLER",
                              help="the function of the cell to register (default: the one it defines, the last "
                                   "one when there are several)")
    @magic_arguments.argument("--timeout", type=seconds, default=None, metavar="S",
                              help="seconds to wait for the ranks (default: the cluster's)")
    @cell_magic
    def shard_patch(self, line, cell):
        """Define the handler of the cell in the notebook and register it for OP on every rank, by value with its
        globals (``Cluster.patch``); ``cl.check_patch(OP, stmt)`` checks it, ``cl.unpatch(OP)`` takes it back."""
        __tracebackhide__ = hide_own_frames()
        from .cluster import active_cluster
        from .cluster.patching import handler_from_source

        args = parse_options(self.shard_patch, split_words(line, "%%shard_patch"), "%%shard_patch")
        cl = active_cluster()
        handler = handler_from_source(cell, args.name, self.shell.user_ns)
        return cl.patch(args.op, handler, kind=args.kind, timeout=args.timeout)


def trace_summary(trace) -> str:
    """One line after a %%shard_trace cell: what was recorded (``Trace.overview``), what is wrong
    (``Trace.findings``, in their order) and where to look next."""
    parts = [f"sharddbg: recorded {trace.overview.headline()}"] + [f.sentence for f in trace.findings]
    return "; ".join(parts) + ". sharddbg.last_trace().get_op_summary() first; the trace has it all."


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(ShardMagics)
