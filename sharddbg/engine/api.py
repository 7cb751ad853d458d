"""The engine's whole surface: every function and control message the client sends to a rank.

The client (``sharddbg.cluster``) calls nothing else on a rank. Each function below runs on the rank
(ipyparallel sends a reference to it by name) and returns plain data: dicts, lists, schema payloads
(``sharddbg.schema``), never a tensor or a live object. This module imports nothing heavy itself, so the
client names these functions without importing torch; the work is done by the engine module named in
each docstring.

Control messages are answered on the kernel's control thread, which runs even while the main thread is
blocked in a collective: ``DIAGNOSE_REQUEST`` (stack, Flight Recorder, recording so far),
``CLOCK_REQUEST`` (this rank's clock, for the client's offset estimate) and ``RELEASE_REQUEST`` (end every
collective the rank waits in: its connections to the peers shut, its NCCL communicators aborted). They are defined with their
handlers in ``engine.control`` (a light module) and listed here.
"""

from __future__ import annotations

# ---- control channel: request type -> reply type ------------------------------------------------
from .control import CLOCK_REPLY, CLOCK_REQUEST, DIAGNOSE_REPLY, DIAGNOSE_REQUEST, RELEASE_REPLY, RELEASE_REQUEST

__all__ = ["DIAGNOSE_REQUEST", "DIAGNOSE_REPLY", "CLOCK_REQUEST", "CLOCK_REPLY", "RELEASE_REQUEST", "RELEASE_REPLY", "rank", "init_rank", "teardown",
           "status", "user_value", "user_eval", "tensor_snapshot", "recording_start", "recording_stop",
           "recording_peek", "is_recording"]


# ---- set-up -------------------------------------------------------------------------------------
def rank() -> int | None:
    """This engine's global rank, as the fork server assigned it (``rank_state``)."""
    from .rank_state import STATE

    return STATE.rank


def init_rank(world_size: int, mesh_shape, backend: str, master_port: int, collective_timeout_s: float,
              use_cuda: bool) -> dict:
    """As the rank the fork server gave this engine (``rank_state``): join torch.distributed on a fresh
    port, build the mesh, fill physicsnemo's manager; returns :func:`status` (``bootstrap.init_rank``)."""
    from . import bootstrap

    return bootstrap.init_rank(world_size, mesh_shape, backend, master_port, collective_timeout_s, use_cuda)


def teardown(release_pids=()) -> None:
    """Destroy this rank's process groups; ``release_pids``: peers blocked in a collective with it, whose
    connections are shut first so they are released at once (``bootstrap.teardown``)."""
    from . import bootstrap

    bootstrap.teardown(release_pids)


def status() -> dict:
    """One row of ``Cluster.status()`` (``bootstrap.status``)."""
    from . import bootstrap

    return bootstrap.status()


# ---- the user's namespace -----------------------------------------------------------------------
def user_value(name: str):
    """A variable of the rank's %px namespace (``Cluster.pull``)."""
    from . import bootstrap

    return bootstrap.user_value(name)


def user_eval(expression: str):
    """``expression`` evaluated in the rank's %px namespace (``Cluster.eval``)."""
    from . import bootstrap

    return bootstrap.user_eval(expression)


def tensor_snapshot(name: str) -> dict:
    """The shard inspector's record of the tensor ``name`` (or a dotted path) on this rank, read without
    communication (``snapshot.snapshot_named``)."""
    from .snapshot import snapshot_named

    return snapshot_named(name)


# ---- recording ----------------------------------------------------------------------------------
def recording_start(max_events: int = 200_000, unmask: bool = True, comm: bool = True) -> dict:
    """Start the recorder on this rank: {"rank", "t_start_ns"} (``recorder.start``)."""
    from . import recorder

    return recorder.start(max_events=max_events, unmask=unmask, comm=comm)


def recording_stop() -> dict:
    """Stop it: the rank's payload (``sharddbg.schema``; ``recorder.stop``)."""
    from . import recorder

    return recorder.stop()


def recording_peek() -> dict:
    """What was recorded so far, without stopping (``recorder.peek``)."""
    from . import recorder

    return recorder.peek()


def is_recording() -> bool:
    """A recording runs on this rank (``recorder.is_recording``)."""
    from . import recorder

    return recorder.is_recording()
