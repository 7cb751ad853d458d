"""Every error and warning sharddbg raises on purpose. Each names what was wrong and what to do."""

import os
import re
from typing import NamedTuple


def hide_own_frames() -> bool:
    """sharddbg's frames are left out of the tracebacks it shows, unless ``SHARDDBG_DEBUG=1`` is set (for
    debugging sharddbg itself). Read at each call: set it any time."""
    return os.environ.get("SHARDDBG_DEBUG", "").strip().lower() in ("", "0", "false", "no")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# IPython's own frames between a cell and the code it runs (run_code, a magic's dispatch)
_IPYTHON_MACHINERY = (f"{os.sep}IPython{os.sep}core{os.sep}interactiveshell.py",
                      f"{os.sep}IPython{os.sep}core{os.sep}magic.py", "<decorator-gen-")


def without_own_frames(tb):
    """The traceback ``tb`` without sharddbg's frames and IPython's dispatch of a cell or magic: the user's
    own lines only (None when nothing is left)."""
    import types

    kept = []
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (os.path.abspath(name).startswith(_PACKAGE_DIR) or any(m in name for m in _IPYTHON_MACHINERY)
                or _calls_a_magic(tb)):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for t in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt


def _calls_a_magic(tb) -> bool:
    """The frame is a cell's ``get_ipython().run_cell_magic(...)`` (what IPython makes of ``%%px``, ``%px``): the
    magic's dispatch, not a line the user wrote."""
    called = tb.tb_next
    return (called is not None and called.tb_frame.f_code.co_name in ("run_cell_magic", "run_line_magic")
            and any(m in called.tb_frame.f_code.co_filename for m in _IPYTHON_MACHINERY))


class ShardDbgError(Exception):
    """Base class of sharddbg's own errors."""

    def _render_traceback_(self) -> list[str]:
        """How IPython shows this error (its hook for exceptions that render themselves): the user's frames,
        then the message, which carries the ranks' own tracebacks; sharddbg's frames only with
        ``SHARDDBG_DEBUG=1``."""
        from IPython import get_ipython

        shell = get_ipython()
        tb = self.__traceback__
        if hide_own_frames():
            tb = without_own_frames(tb)
        if shell is None:  # not inside IPython: the standard rendering
            import traceback

            return traceback.format_exception(type(self), self, tb)
        return shell.InteractiveTB.structured_traceback(type(self), self, tb, tb_offset=0)


class MeshError(ShardDbgError, ValueError):
    """The requested mesh does not fit the number of ranks (or is malformed)."""


class ClusterError(ShardDbgError, RuntimeError):
    """Starting, using or stopping a cluster failed."""


class RecordingOptionsError(ClusterError, ValueError):
    """A recording option is of the wrong type or out of range (``RecordingOptions``); refused before anything
    is recorded."""


class NoActiveClusterError(ClusterError):
    """A module-level call needs the active cluster, and none is running."""


class RankTimeoutError(ShardDbgError, TimeoutError):
    """Some ranks did not finish within the timeout.

    ``report`` is a :class:`sharddbg.analysis.hang.HangReport`: which ranks finished, which did not,
    and for each unfinished rank its Python stack and the collective it waits in.
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


# a C++ source location in front of a library's message ("[.../gloo/transport/tcp/pair.cc:561] "), and
# gloo's sign-off after it: neither says what went wrong
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|c|h|hpp):\d+\] ")
_GLOO_SIGN_OFF = re.compile(r"\s*This is typically caused by a remote worker crashing\..*$", re.DOTALL)


def short_message(message: str) -> str:
    """The first line of an exception's message, without a C++ source location or a library's sign-off."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return _GLOO_SIGN_OFF.sub("", _SOURCE_PREFIX.sub("", first))


# a cell's frame as a rank shows it: the notebook's cell "Cell In[7], line 5", or code sent by cl.run from a
# script "Cell sent by cl.run, line 5"
_CELL_FRAME = re.compile(r"^Cell (?:In\[\d+\]|sent by cl\.run), line (\d+)", re.MULTILINE)
_ARROW = re.compile(r"^-+> *\d+ (.*)$", re.MULTILINE)


class RankFailure(NamedTuple):
    """How code failed on one rank (a tuple, so ``ename, message, tb = failure`` works too)."""

    type_name: str  # the exception's class name, e.g. "ScatterError"
    message: str
    traceback: str  # the rank's traceback text, ipyparallel's own frame left out

    @property
    def cell_line(self) -> int | None:
        """The line of the cell (1-based) whose statement raised, when the traceback shows the cell."""
        m = _CELL_FRAME.search(self.traceback)
        return int(m.group(1)) if m else None

    @property
    def cell_code(self) -> str | None:
        """That statement's source text."""
        m = _CELL_FRAME.search(self.traceback)
        if not m:
            return None
        arrow = _ARROW.search(self.traceback, m.end())
        return arrow.group(1).strip() if arrow else None

    def headline(self, rank: int) -> str:
        """ "rank 3 raised IndexError: boom (line 2 of the cell: `x = y[5]`)" """
        where = ""
        if self.cell_line is not None:
            code = self.cell_code
            where = f" (line {self.cell_line} of the cell" + (f": `{code}`)" if code else ")")
        return f"rank {rank} raised {self.type_name}: {short_message(self.message)}{where}"


class RankError(ShardDbgError):
    """Code failed on one or more ranks. ``errors`` maps rank -> :class:`RankFailure`.

    ``causes``: the ranks whose own failure started it (the others failed because of them, e.g. in a
    collective that a failed rank never joined); ``released``: ranks sharddbg released from a collective
    that waited for a failed rank; ``report``: where those ranks waited (a
    :class:`sharddbg.analysis.hang.HangReport`), or None.
    """

    def __init__(self, message, errors=None, *, causes=None, released=None, report=None):
        super().__init__(message)
        self.errors = errors or {}
        self.causes = sorted(causes) if causes is not None else sorted(self.errors)
        self.released = sorted(released or [])
        self.report = report


class RankDiedError(ClusterError):
    """A rank's process died while it ran something. ``dead`` maps rank -> how it died; ``outputs``: what
    the surviving ranks printed and raised (``RankOutput`` per rank, in rank order)."""

    def __init__(self, message, dead, outputs=None):
        super().__init__(message)
        self.dead = dict(dead)
        self.outputs = list(outputs or [])


class TraceInterrupted(KeyboardInterrupt):
    """Ctrl-C ended the wait for a traced cell. The recorder was stopped where the cell had finished, and is
    stopped right after it where the cell still runs; what was recorded until then is kept as a Trace marked
    interrupted (``trace``, also the cluster's ``last_trace()``). A KeyboardInterrupt, so that it ends what
    waited for the trace as Ctrl-C does."""

    def __init__(self, message, trace=None):
        super().__init__(message)
        self.trace = trace


class RankLostError(ClusterError):
    """ipyparallel unregistered a rank's engine while its process still exists: it stopped answering the
    controller's heartbeat (stopped by SIGSTOP or a debugger, swapped out, ...). Nothing can reach it any more,
    even once it goes on. ``lost`` maps rank -> the state of its process; ``outputs``: what the other ranks
    printed and raised (``RankOutput`` per rank, in rank order)."""

    def __init__(self, message, lost, outputs=None):
        super().__init__(message)
        self.lost = dict(lost)
        self.outputs = list(outputs or [])


class InspectError(ShardDbgError, ValueError):
    """The named value cannot be inspected (missing on some ranks, not a tensor, ...)."""


class TraceFileError(ShardDbgError, ValueError):
    """A trace file is not a sharddbg trace, is corrupt, or has an unsupported version."""


class RecorderError(ShardDbgError, RuntimeError):
    """The recorder was misused (nested recorders, stop without start, ...)."""


class UnmaskedOpError(ShardDbgError, RuntimeError):
    """A ShardTensor op raised a TypeError that PyTorch would have turned into the generic
    "unsupported operand type(s)" message. The original exception is chained (``__cause__``).

    Deliberately not a TypeError: PyTorch's binary-operator machinery swallows TypeErrors.
    """

    def __init__(self, message: str, op: str = "", rank: int = 0):
        super().__init__(message)
        self.op = op
        self.rank = rank


class NoPatchError(ShardDbgError, KeyError):
    """The op has no ShardTensor patch to remove."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SchemaError(ShardDbgError, ValueError):
    """A record or payload does not follow this schema (corrupt, or from an incompatible sharddbg)."""


class ShardDbgWarning(UserWarning):
    """Warnings sharddbg issues (untested versions, dropped events, ...)."""
