"""Every error and warning sharddbg raises on purpose. Each names what was wrong and what to do."""


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

    ``report`` is a :class:`sharddbg.cluster.diagnose.HangReport`: which ranks finished, which did not,
    and for each unfinished rank its Python stack and the collective it waits in.
    """

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class RankError(ShardDbgError):
    """Code failed on one or more ranks. ``errors`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, message, errors=None):
        super().__init__(message)
        self.errors = errors or {}


class TraceFileError(ShardDbgError, ValueError):
    """A trace file is not a sharddbg trace, is corrupt, or has an unsupported version."""


class ShardDbgWarning(UserWarning):
    """Warnings sharddbg issues (untested versions, dropped events, ...)."""
