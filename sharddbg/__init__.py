"""sharddbg: see inside domain-parallel PyTorch (PhysicsNeMo ShardTensor, DTensor) from one notebook.

Public surface: ``Cluster``, ``engine`` (helpers for code running on the ranks), ``record``,
``RecordingOptions`` (what a recording keeps and checks), ``last_trace``, ``load_trace``, ``inspect``, and
``%load_ext sharddbg``. Importing this package is cheap:
torch is imported only where tensors live (the engines).
"""

import typing

if typing.TYPE_CHECKING:
    from .engine.recorder import Recorder
    from .trace import Trace

__version__ = "0.1.0"

_LAZY = {
    "Cluster": ("sharddbg.cluster", "Cluster"),
    "active_cluster": ("sharddbg.cluster", "active_cluster"),
    "load_trace": ("sharddbg.trace", "load_trace"),
    "Trace": ("sharddbg.trace", "Trace"),
    "RecordingOptions": ("sharddbg.options", "RecordingOptions"),
}


def __getattr__(name):
    import importlib

    if name == "engine":
        return importlib.import_module("sharddbg.engine")
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sharddbg' has no attribute {name!r}")


def record(*args, **kwargs) -> "Recorder":
    """A recorder on one rank, in a plain script: ``with sharddbg.record() as rec: ...``; ``rec.events`` after.

    No cluster is needed: it records the ShardTensor ops (and, with ``comm``, every collective) that run in
    this process while the ``with`` block runs, as the rank this process is (torch.distributed's rank when a
    process group is up; rank 0 of 1 without one). It imports torch. Entering it raises ``RecorderError``
    when another recorder is active in this process, or when it was entered before (a Recorder is entered
    once).

    Parameters
    ----------
    *args : RecordingOptions
        At most one: the options to start from (``options``, which may be given by keyword too; default:
        ``RecordingOptions()``).
    **kwargs : object
        Options that override it, by name (``max_events``, ``unmask``, ``comm``, ``spec_check``,
        ``replicas``, ``preflight``, ``memory``; None leaves one as it is), and ``preflight_token``, which
        names the recording's store keys, the same on every rank (default: counted per process).

    Returns
    -------
    Recorder
        Not started yet: entering it (``with``) starts the recording, leaving it stops it. ``events``: the
        records (``sharddbg.schema``), sorted by ``seq``; ``dropped``: records lost to a full buffer;
        ``payload()``: the rank's payload, which ``Trace.from_payloads`` reads.

    Raises
    ------
    RecordingOptionsError
        ``options`` is not a RecordingOptions, a name is not an option, or a value is not allowed.
    TypeError
        More than one positional argument, or ``options`` given both positionally and by keyword.

    Examples
    --------
    >>> with sharddbg.record(comm=False) as rec:
    ...     y = torch.nn.functional.conv2d(x, w, padding=1)
    >>> rec.dropped
    0
    >>> t = sharddbg.Trace.from_payloads({0: rec.payload()})
    """
    from .engine.recorder import Recorder

    return Recorder(*args, **kwargs)


class recording:  # noqa: N801 - used as a statement, like contextlib's helpers: `with sharddbg.recording():`
    """Mark one step of a job recorded by ``sharddbg record``: ``with sharddbg.recording(): step(batch)``.

    In a recorded job, the blocks count the steps for ``--steps A:B`` (block k is step k) instead of the
    optimizer's ``step()`` calls: the recording runs from the start of block A to the end of block B. Outside
    a recorded job it does nothing, and imports nothing: the job runs the same with or without sharddbg.

    Examples
    --------
    >>> for batch in loader:
    ...     with sharddbg.recording():
    ...         loss = model(batch).mean(); loss.backward(); opt.step()
    """

    def __enter__(self) -> "recording":
        import sys

        worker = sys.modules.get("sharddbg.engine.jobs.worker")  # loaded only in a recording process
        self._job = worker.current() if worker is not None else None
        if self._job is not None:
            self._job.block_entered()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._job is not None:
            self._job.step_ended(from_block=True)
        return False


def last_trace() -> "Trace":
    """The Trace of the last ``%%shard_trace`` / ``Cluster.trace`` on the active cluster.

    The active cluster is the one started last that still runs (``active_cluster()``); a trace whose cell
    failed or timed out is kept too. The same as ``active_cluster().last_trace()``.

    Returns
    -------
    Trace
        The active cluster's last trace.

    Raises
    ------
    NoActiveClusterError
        No sharddbg cluster is running in this process.
    ShardDbgError
        Nothing was traced on the active cluster yet.

    Examples
    --------
    >>> t = sharddbg.last_trace()
    >>> t.ranks
    [0, 1, 2, 3]
    """
    from .cluster import active_cluster

    return active_cluster().last_trace()


def inspect(name: str, **kwargs) -> typing.Any:
    """The shard inspector for the tensor named ``name`` on the active cluster's ranks.

    The same as ``active_cluster().inspect(name, ...)`` (``Cluster.inspect``) and ``%shard_inspect NAME``: a
    ShardTensor, a DTensor or a plain torch.Tensor, from a snapshot of every rank's part (no communication
    between ranks).

    Parameters
    ----------
    name : str
        A variable of the ranks' %px namespace, or a dotted path to an attribute of one (``"model.weight"``).
    **kwargs : object
        Passed on to ``Cluster.inspect``: ``timeout`` (seconds to wait for the snapshots; None: the
        cluster's).

    Returns
    -------
    ShardInspector
        The widget (``sharddbg.views.inspector.ShardInspector``): ``get_ranks()``, ``text()``, ``warnings``.

    Raises
    ------
    NoActiveClusterError
        No sharddbg cluster is running in this process.
    InspectError
        ``name`` is not a variable name or dotted path, or the variable is missing on some ranks or is not a
        tensor there.
    ClusterError
        A bad ``timeout``, a dead rank, a rank still busy with an earlier call, or a dead controller.
    TypeError
        A keyword other than ``timeout``.

    Examples
    --------
    >>> w = sharddbg.inspect("x")
    >>> w.get_ranks()["local_shape"].tolist()
    [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 16, 64), (1, 3, 16, 64)]
    >>> sharddbg.inspect("model.weight", timeout=30).warnings
    []
    """
    from .cluster import active_cluster

    return active_cluster().inspect(name, **kwargs)


def load_ipython_extension(ipython):
    from .magics import load_ipython_extension as _load

    _load(ipython)


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + ["engine"])
