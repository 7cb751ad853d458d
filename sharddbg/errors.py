"""Every error and warning sharddbg raises on purpose. Each names what was wrong and what to do."""

from typing import NamedTuple


class ShardDbgError(Exception):
    """Base class of sharddbg's own errors."""


class MeshError(ShardDbgError, ValueError):
    """The requested mesh does not fit the number of ranks (or is malformed)."""


class ClusterError(ShardDbgError, RuntimeError):
    """Starting, using or stopping a cluster failed."""


class NoActiveClusterError(ClusterError):
    """A module-level call needs the active cluster, and none is running."""


class RankTimeoutError(ShardDbgError, TimeoutError):
    """Some ranks did not finish within the timeout.

    ``report`` is a :class:`sharddbg.cluster.hang.HangReport`: which ranks finished, which did not,
    and for each unfinished rank its Python stack and the collective it waits in.
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class RankFailure(NamedTuple):
    """How code failed on one rank (a tuple, so ``ename, message, tb = failure`` works too)."""

    type_name: str  # the exception's class name, e.g. "ScatterError"
    message: str
    traceback: str  # the rank's traceback text, ipyparallel's own frame left out


class RankError(ShardDbgError):
    """Code failed on one or more ranks. ``errors`` maps rank -> :class:`RankFailure`."""

    def __init__(self, message, errors=None):
        super().__init__(message)
        self.errors = errors or {}


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
