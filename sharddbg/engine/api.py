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
           "recording_peek", "is_recording", "replica_differences", "replica_release", "parameter_digests",
           "parameter_differences"]


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
def recording_start(options: dict | None = None, preflight_token: str | None = None) -> dict:
    """Start the recorder on this rank with ``options`` (``RecordingOptions.as_dict()``; None: the defaults):
    {"rank", "t_start_ns"} (``recorder.start``). ``preflight_token`` names the recording's store keys, the
    same on every rank."""
    from . import recorder

    return recorder.start(options or {}, preflight_token=preflight_token)


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


# ---- replica consistency (recorder/replicas.py) --------------------------------------------------
def replica_differences(keys: list, src: int, group_ranks: list) -> list:
    """For each digest key of the last recording, this rank's largest difference to rank ``src``'s kept copy;
    a collective over the replica group ``group_ranks``, called on all of its ranks (``replicas.differences``)."""
    from .recorder import replicas

    return replicas.differences(list(keys), int(src), [int(r) for r in group_ranks])


def replica_release() -> None:
    """Drop the copies the last recording kept for ``replica_differences`` (``replicas.release_kept``)."""
    from .recorder import replicas

    replicas.release_kept()


def parameter_digests(expression: str) -> list:
    """A digest per parameter and buffer of the nn.Module ``expression`` evaluates to in the rank's namespace
    (``replicas.parameter_digests``); no communication."""
    from . import bootstrap
    from .recorder import replicas

    return replicas.parameter_digests(bootstrap.user_eval(expression), _shard_tensor_class())


def parameter_differences(expression: str, names: list, mesh_dim: str) -> list:
    """For each parameter or buffer of ``names``, this rank's largest difference to the first rank of its group
    along the cluster mesh's ``mesh_dim``; a collective on every rank (``replicas.parameter_differences``)."""
    import torch.distributed as dist

    from . import bootstrap
    from .rank_state import STATE
    from .recorder import replicas

    group = STATE.mesh.get_group(mesh_dim)
    src = dist.get_process_group_ranks(group)[0]
    return replicas.parameter_differences(bootstrap.user_eval(expression), list(names), group, src,
                                          _shard_tensor_class())


def _shard_tensor_class() -> type:
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor


# ---- smoke matrix -------------------------------------------------------------------------------
__all__ += ["smoke_run"]


def smoke_run(setup, step, plan: dict, reference_grads: dict | None = None) -> dict:
    """One configuration of the smoke matrix on this rank, on the rank's current mesh: the user's
    ``setup()`` model trained (or run forward only) with ``step(model, ctx)`` (each the function or
    cloudpickle's bytes of it); each step's loss and time,
    the first step's gradient error against ``reference_grads``, one more step's recorder payload
    (``smoke.run``; ``plan`` is a ``smoke.RunPlan`` as a dict)."""
    from . import smoke

    return smoke.run(setup, step, plan, reference_grads)


# ---- numerical check and pitfall doctor (verify.py) -----------------------------------------------
__all__ += ["check_prepare", "check_backward", "check_compare", "check_finish", "doctor_facts"]


def check_prepare(job_dir: str, stmt: str, loss: str | None, inputs, outputs, models, grads: bool) -> dict:
    """Before the statement runs: the ranks agree on the names, TF32 goes off, gradients are set aside, the
    inputs' and distributed parameters' full tensors are gathered and each domain group's first rank writes
    the reference's bundle under ``job_dir`` (collectives on every rank; ``verify.check_prepare``)."""
    from . import verify

    return verify.check_prepare(job_dir, stmt, loss, inputs, outputs, models, grads)


def check_backward() -> dict:
    """After the statement: the loss and its backward, every compared tensor placed in its global tensor
    (collectives on every rank; ``verify.check_backward``)."""
    from . import verify

    return verify.check_backward()


def check_compare(rtol: float | None, atol: float | None) -> list:
    """This rank's tensors against its group's reference, as records (no communication;
    ``verify.check_compare``)."""
    from . import verify

    return verify.check_compare(rtol, atol)


def check_finish() -> None:
    """Put back the gradients and settings the check changed (no communication; ``verify.check_finish``)."""
    from . import verify

    verify.check_finish()


def doctor_facts(names=None) -> dict:
    """What the pitfall doctor reads on this rank (no communication; ``verify.doctor_facts``)."""
    from . import verify

    return verify.doctor_facts(names)
