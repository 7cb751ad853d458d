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

From a notebook the functions are called through ``Cluster.apply`` (``cl.apply(api.status)``), which answers
in rank order; what one raises on a rank reaches the notebook as a ``RankError`` that names the rank and the
exception. In a ``%%px`` cell they can be called directly.
"""

from __future__ import annotations

from typing import Any

# ---- control channel: request type -> reply type ------------------------------------------------
from .control import CLOCK_REPLY, CLOCK_REQUEST, DIAGNOSE_REPLY, DIAGNOSE_REQUEST, RELEASE_REPLY, RELEASE_REQUEST

__all__ = ["DIAGNOSE_REQUEST", "DIAGNOSE_REPLY", "CLOCK_REQUEST", "CLOCK_REPLY", "RELEASE_REQUEST", "RELEASE_REPLY", "rank", "init_rank", "teardown",
           "status", "user_value", "user_eval", "tensor_snapshot", "recording_start", "recording_stop",
           "recording_peek", "is_recording", "replica_differences", "replica_release", "parameter_digests",
           "parameter_differences"]


# ---- set-up -------------------------------------------------------------------------------------
def rank() -> int | None:
    """This engine's global rank, as the fork server assigned it (``rank_state``).

    Known from the fork, before torch.distributed is set up: the cluster reads it to put its engines in
    rank order.

    Returns
    -------
    int or None
        The rank; None in a process that no sharddbg fork server started.

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> cl.apply(api.rank)
    [0, 1, 2, 3]
    """
    from .rank_state import STATE

    return STATE.rank


def init_rank(world_size: int, mesh_shape, backend: str, master_port: int, collective_timeout_s: float,
              use_cuda: bool) -> dict:
    """As the rank the fork server gave this engine (``rank_state``): join torch.distributed on a fresh port,
    build the mesh, fill physicsnemo's manager; returns ``status()`` (``bootstrap.init_rank``).

    A collective: every rank of the world calls it at once. Before joining, physicsnemo is imported and its
    shard patches registered (on a CPU host sharddbg registers them), and a process group already up on this
    rank is torn down (``teardown()``). The rendezvous store listens on 127.0.0.1 only (rank 0 serves it).
    The mesh is the ``("ddp", "domain")`` DeviceMesh; with ``use_cuda`` the rank runs on its own GPU and
    makes one small collective on the world and on each mesh dim's group, so that their NCCL communicators
    exist before any user code. Then the ``%px`` namespace gets ``torch``, ``nn``, ``F``,
    ``dist``, ``physicsnemo``, ``sharddbg``, ``ShardTensor``, ``Shard``, ``Replicate``, ``Partial``,
    ``rank``, ``world_size`` and ``mesh``, and the control channel's handlers are installed.

    Parameters
    ----------
    world_size : int
        The number of ranks.
    mesh_shape : tuple of int
        ``(ddp, domain)``; their product is ``world_size``.
    backend : str
        torch.distributed's backend, ``"gloo"`` or ``"nccl"``.
    master_port : int
        The port of the rendezvous store on 127.0.0.1 (a free one: rank 0 listens on it).
    collective_timeout_s : float
        The process group's collective timeout, in seconds (the store waits at least 30 s).
    use_cuda : bool
        Run on a GPU (one per rank, ``rank % torch.cuda.device_count()``); else on the CPU.

    Returns
    -------
    dict
        The ``status()`` row after the set-up, with ``t_init_s`` (the seconds it took) added.

    Raises
    ------
    ShardDbgError
        This process has no rank: only engines forked by a sharddbg cluster can join one.
    RuntimeError
        torch.distributed's own set-up failed (``DistStoreError``, a subclass: the rendezvous store could
        not be reached in time).

    Examples
    --------
    What the cluster sends to every rank at start (and, after ``teardown()``, on ``cl.remesh``):

    >>> from sharddbg.engine import api
    >>> rows = cl.apply(api.init_rank, world_size=4, mesh_shape=(2, 2), backend="gloo", master_port=29533,
    ...                 collective_timeout_s=60.0, use_cuda=False)
    >>> [(row["ddp"], row["domain"]) for row in rows]
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    from . import bootstrap

    return bootstrap.init_rank(world_size, mesh_shape, backend, master_port, collective_timeout_s, use_cuda)


def teardown(release_pids=()) -> None:
    """Destroy this rank's process groups; ``release_pids``: peers blocked in a collective with it, whose
    connections are shut first so they are released at once (``bootstrap.teardown``).

    A recording cut short is stopped first (its hooks removed, nothing kept). Then the process group is
    destroyed, rank 0's rendezvous socket closed, physicsnemo's ``DistributedManager`` state cleared and the
    mesh forgotten (also the ``mesh`` name of the ``%px`` namespace), and garbage is collected so that the
    gloo sockets close. Nothing is raised when no group is up.

    Parameters
    ----------
    release_pids : iterable of int, default ()
        Process ids of engines blocked in a collective with this rank. This rank's TCP connections to them
        are shut down first, so their pending gloo operation fails at once ("connection closed by peer")
        instead of waiting for the collective timeout.

    Examples
    --------
    What ``cl.remesh`` sends to every rank before it brings the group up again with ``init_rank()``:

    >>> from sharddbg.engine import api
    >>> cl.apply(api.teardown)
    [None, None, None, None]
    >>> [row["dist_initialized"] for row in cl.apply(api.status)]
    [False, False, False, False]
    """
    from . import bootstrap

    bootstrap.teardown(release_pids)


def status() -> dict:
    """One row of ``Cluster.status()`` (``bootstrap.status``).

    What this rank is and runs, read locally (no communication).

    Returns
    -------
    dict
        ``rank``, ``pid``, ``host``, ``device`` (``"cpu"``, ``"cuda:0"``; None before the set-up),
        ``backend``, ``dist_initialized``, ``ddp`` and ``domain`` (the rank's mesh coordinate, from the mesh
        shape: 1 x 1 before the set-up), ``torch``, ``physicsnemo``, ``python`` (versions),
        ``patch_mode`` (``"registered-by-physicsnemo"``, ``"registered-by-sharddbg"`` or ``"none"``),
        ``n_patches``, ``patch_reason``, ``collective_timeout_s``, ``threads`` (torch's intra-op threads),
        ``argv0``.

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> row = cl.apply(api.status)[1]
    >>> row["rank"], row["ddp"], row["domain"], row["backend"], row["device"]
    (1, 0, 1, 'gloo', 'cpu')
    """
    from . import bootstrap

    return bootstrap.status()


# ---- the user's namespace -----------------------------------------------------------------------
def user_value(name: str) -> Any:
    """A variable of the rank's %px namespace (``Cluster.pull``).

    Parameters
    ----------
    name : str
        The variable's name.

    Returns
    -------
    Any
        Its value, the object itself (it travels back pickled).

    Raises
    ------
    NameError
        The namespace has no variable of that name on this rank.

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> cl.apply(api.user_value, "world_size")
    [4, 4, 4, 4]
    """
    from . import bootstrap

    return bootstrap.user_value(name)


def user_eval(expression: str) -> Any:
    """``expression`` evaluated in the rank's %px namespace (``Cluster.eval``).

    Parameters
    ----------
    expression : str
        A Python expression, evaluated with the namespace as its globals.

    Returns
    -------
    Any
        Its value (it travels back pickled).

    Raises
    ------
    Exception
        Whatever compiling or evaluating the expression raises (``SyntaxError``, ``NameError``, ...).

    Examples
    --------
    ``x`` scattered along dim 2 (66 rows over 4 ranks):

    >>> from sharddbg.engine import api
    >>> cl.apply(api.user_eval, "tuple(x._local_tensor.shape)")
    [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 16, 64), (1, 3, 16, 64)]
    """
    from . import bootstrap

    return bootstrap.user_eval(expression)


def tensor_snapshot(name: str) -> dict:
    """The shard inspector's record of the tensor ``name`` (or a dotted path) on this rank, read without
    communication (``snapshot.snapshot_named``).

    Nothing that could communicate is called: no ``full_tensor()``, no ``t.shape`` of a ShardTensor, no
    ``spec.sharding_shapes()``. What one rank cannot see (the other ranks' real shapes) the client checks
    when it puts the ranks' records together.

    Parameters
    ----------
    name : str
        A variable of the rank's ``%px`` namespace, or a dotted path from one (``"model.weight"``).

    Returns
    -------
    dict
        ``version``, ``name``, ``rank`` and ``status``: ``"missing"`` (no such variable or attribute),
        ``"not_a_tensor"`` (with ``type`` and ``repr``) or ``"ok"``, with ``kind`` (``"ShardTensor"``,
        ``"DTensor"``, ``"Tensor"``), ``type``, ``global_shape``, ``local_shape``, ``dtype``, ``device``,
        ``requires_grad``, ``element_size``, ``local_bytes``, ``mesh`` (dim names, shape, ranks, this rank's
        coordinate, device type; None for a plain tensor), ``placements``, ``sharding_shapes``,
        ``spec_local_shape`` and ``spec_offsets`` (what the spec says this rank holds, and where) and
        ``problems`` (what this rank alone sees is inconsistent).

    Examples
    --------
    ``x`` scattered along dim 2 (66 rows over 4 ranks):

    >>> from sharddbg.engine import api
    >>> snap = cl.apply(api.tensor_snapshot, "x")[2]
    >>> snap["status"], snap["kind"], snap["local_shape"], snap["spec_offsets"]
    ('ok', 'ShardTensor', [1, 3, 16, 64], [0, 0, 34, 0])
    >>> snap["placements"]
    [{'type': 'shard', 'dim': 2, 'text': 'Shard(dim=2)'}]
    """
    from .snapshot import snapshot_named

    return snapshot_named(name)


# ---- recording ----------------------------------------------------------------------------------
def recording_start(options: dict | None = None, preflight_token: str | None = None) -> dict:
    """Start the recorder on this rank with ``options`` (``RecordingOptions.as_dict()``; None: the defaults):
    {"rank", "t_start_ns"} (``recorder.start``). ``preflight_token`` names the recording's store keys, the
    same on every rank.

    The recorder's hooks are installed until ``recording_stop()``; the copies the previous recording kept
    for ``replica_differences()`` are dropped.

    Parameters
    ----------
    options : dict or None, default None
        ``RecordingOptions.as_dict()`` (a ``RecordingOptions`` itself is taken too), checked again here;
        None or ``{}``: the defaults.
    preflight_token : str or None, default None
        Names this recording's keys in the rendezvous store (with ``preflight``), the same on every rank;
        None: counted per process.

    Returns
    -------
    dict
        ``{"rank": ..., "t_start_ns": ...}``: this rank and when the recording started (its clock, in ns).

    Raises
    ------
    RecordingOptionsError
        ``options`` names an option that does not exist or holds a value that is not allowed.
    RecorderError
        A recorder already runs on this rank (nested recorders are refused).

    Examples
    --------
    A recording by hand, as ``cl.trace`` makes one:

    >>> from sharddbg.engine import api
    >>> from sharddbg.options import RecordingOptions
    >>> cl.apply(api.recording_start, RecordingOptions(replicas=True).as_dict())  # doctest: +ELLIPSIS
    [{'rank': 0, 't_start_ns': ...}, {'rank': 1, 't_start_ns': ...}, {'rank': 2, ...}, {'rank': 3, ...}]
    >>> outputs = cl.run("y = net(x)")
    >>> payloads = cl.apply(api.recording_stop)
    """
    from . import recorder

    return recorder.start(options or {}, preflight_token=preflight_token)


def recording_stop(columns_from: int | None = None) -> dict:
    """Stop it: the rank's payload (``sharddbg.schema``; ``recorder.stop``).

    Stops the recording ``recording_start()`` began: every hook is put back, then the events are
    formatted. ``recording_peek()`` returns the same payload until the next recording starts.

    Parameters
    ----------
    columns_from : int or None, default None
        From this many records on, the payload carries them as Arrow columns (``columnar.payload_as_columns``:
        ``events_as_columns`` instead of ``events``), which ``Trace.from_payloads`` reads without unpickling
        and checking a dict per record. None: always a list of dicts.

    Returns
    -------
    dict
        The rank's payload (``schema.PAYLOAD_FIELDS``): ``format``, ``schema_version``, ``rank``,
        ``world_size``, ``complete`` (True), ``events`` (the op and collective records, by ``seq``),
        ``dropped`` (records lost to a full buffer), ``clock`` and ``meta`` (versions, patch mode, the
        recording options); with ``columns_from`` and that many records or more, ``events_as_columns`` (the
        Arrow IPC stream of their columns) instead of ``events``.

    Raises
    ------
    RecorderError
        No recording was started on this rank with ``recording_start()``, or putting the hooks back
        failed.

    Examples
    --------
    After ``recording_start()`` and a cell:

    >>> from sharddbg.engine import api
    >>> payloads = cl.apply(api.recording_stop)
    >>> payloads[0]["rank"], payloads[0]["complete"]
    (0, True)
    """
    from . import recorder

    payload = recorder.stop()
    if columns_from is not None and len(payload["events"]) >= columns_from:
        from .. import columnar  # pyarrow only when a big payload is shipped

        try:
            return columnar.payload_as_columns(payload)
        except ValueError:  # a NaN or an infinity, which no column file holds: the records as they are
            pass
    return payload


def recording_peek() -> dict:
    """What was recorded so far, without stopping (``recorder.peek``).

    Safe from another thread while the main thread is blocked (in a collective, say): it copies lists, takes
    no lock, never synchronizes a device or calls a collective. The control channel's diagnosis reads it so.

    Returns
    -------
    dict
        While the recording runs, a payload like ``recording_stop()``'s with ``complete`` False and the ops
        still in flight among the events; after it stopped, the payload ``recording_stop()`` returned.

    Raises
    ------
    RecorderError
        No recording was started on this rank with ``recording_start()``.

    Examples
    --------
    In a ``%%px`` cell, while a recording started by ``recording_start()`` runs:

    >>> from sharddbg.engine import api
    >>> api.recording_peek()["complete"]
    False
    """
    from . import recorder

    return recorder.peek()


def is_recording() -> bool:
    """A recording runs on this rank (``recorder.is_recording``).

    Returns
    -------
    bool
        True between ``recording_start()`` and ``recording_stop()`` (a ``Recorder`` used on its own, as
        a ``with`` block, does not count).

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> cl.apply(api.is_recording)
    [False, False, False, False]
    """
    from . import recorder

    return recorder.is_recording()


# ---- replica consistency (recorder/replicas.py) --------------------------------------------------
def replica_differences(keys: list, src: int, group_ranks: list) -> list[dict]:
    """For each digest key of the last recording, this rank's largest difference to rank ``src``'s kept copy;
    a collective over the replica group ``group_ranks``, called on all of its ranks (``replicas.differences``).

    Needs a last recording made with ``replicas=True`` whose copies are still kept. The ranks first exchange
    each entry's shape and dtype (one ``all_gather_object``), so that every rank makes the same decisions;
    then ``src`` broadcasts its copy of each entry that every rank holds alike, and each rank compares its
    own with it.

    Parameters
    ----------
    keys : list of str
        Digest keys of the last recording, ``"op#call/what"``: the op, which of its forward calls that
        digested something (from 0), and what was digested (``"torch.conv2d#0/parameter 2.weight"``); the
        same list on every rank of the group.
    src : int
        The global rank whose copy is the reference.
    group_ranks : list of int
        The replica group's global ranks, as the recording saw the group.

    Returns
    -------
    list of dict
        One per key, in order: ``shape`` and ``dtype`` of this rank's copy (None where it kept none),
        ``held``, ``max_abs_diff`` (the largest ``|mine - src's|``, in float64; 0.0 when equal; None when not
        compared) and ``note`` (why not: not kept on every rank of the group, shapes or dtypes that differ
        across it, a NaN or an infinity against a number; else None).

    Raises
    ------
    RuntimeError
        No recording with ``replicas=True`` kept copies on this rank (released, or a new recording started
        since), or no process group holds ``group_ranks`` (their values cannot be gathered).

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> rows = cl.apply(api.replica_differences, ["torch.conv2d#0/parameter 2.weight"], 0, [0, 1, 2, 3])
    >>> sorted(rows[3][0])
    ['dtype', 'held', 'max_abs_diff', 'note', 'shape']
    """
    from .recorder import replicas

    return replicas.differences(list(keys), int(src), [int(r) for r in group_ranks])


def replica_release() -> None:
    """Drop the copies the last recording kept for ``replica_differences`` (``replicas.release_kept``).

    Afterwards ``replica_differences()`` raises until a new recording with ``replicas=True`` keeps copies.

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> cl.apply(api.replica_release)
    [None, None, None, None]
    """
    from .recorder import replicas

    replicas.release_kept()


def parameter_digests(expression: str) -> list[dict]:
    """A digest per parameter and buffer of the nn.Module ``expression`` evaluates to in the rank's namespace
    (``replicas.parameter_digests``); no communication.

    Of a distributed parameter (DTensor, ShardTensor) the part this rank holds is digested. Each is copied to
    the CPU to be hashed.

    Parameters
    ----------
    expression : str
        A variable or an expression of the rank's ``%px`` namespace that gives the module.

    Returns
    -------
    list of dict
        One per parameter, then one per buffer, in the module's order: ``name``, ``kind`` (``"parameter"``
        or ``"buffer"``), ``shape`` (list), ``dtype`` (``"float32"``), ``placements`` (a distributed
        parameter's, as text; else None), ``sharded_over`` (the mesh dim names it is not Replicate over) and
        ``digest`` (a hex digest of the shape, dtype and bytes: equal digests, equal values).

    Raises
    ------
    TypeError
        ``expression`` gives something other than an nn.Module.
    Exception
        Whatever evaluating ``expression`` raises (``NameError``, ...).

    Examples
    --------
    ``net`` built on every rank from its own seed, never broadcast:

    >>> from sharddbg.engine import api
    >>> rows = cl.apply(api.parameter_digests, "net")
    >>> [(r["name"], r["kind"]) for r in rows[0]]
    [('0.weight', 'parameter'), ('0.bias', 'parameter')]
    >>> rows[0][0]["digest"] == rows[1][0]["digest"]
    False
    """
    from . import bootstrap
    from .recorder import replicas

    return replicas.parameter_digests(bootstrap.user_eval(expression), _shard_tensor_class())


def parameter_differences(expression: str, names: list, mesh_dim: str) -> list:
    """For each parameter or buffer of ``names``, this rank's largest difference to the first rank of its group
    along the cluster mesh's ``mesh_dim``; a collective on every rank (``replicas.parameter_differences``).

    Of a distributed parameter the part this rank holds is compared. The ranks of each group first exchange
    each entry's shape and dtype (one ``all_gather_object``), then the group's first rank broadcasts each
    entry that every rank holds alike.

    Parameters
    ----------
    expression : str
        A variable or an expression of the rank's ``%px`` namespace that gives the module.
    names : list of str
        Parameter and buffer names (``named_parameters()`` / ``named_buffers()``), the same list on every
        rank.
    mesh_dim : str
        The cluster mesh's dim whose groups are compared, ``"domain"`` or ``"ddp"``.

    Returns
    -------
    list of dict
        One per name, in order: ``shape``, ``dtype`` (None where this rank's module has no such name),
        ``held``, ``max_abs_diff`` (the largest difference to the group's first rank, in float64; 0.0 when
        equal; None when not compared) and ``note`` (why not compared, else None).

    Raises
    ------
    TypeError
        ``expression`` gives something other than an nn.Module.
    KeyError
        ``mesh_dim`` is not a dim of the cluster's mesh.
    AttributeError
        torch.distributed is not set up on this engine (there is no mesh to take the group from).
    Exception
        Whatever evaluating ``expression`` raises (``NameError``, ...).

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> rows = cl.apply(api.parameter_differences, "net", ["0.weight"], "domain")
    >>> rows[0][0]["max_abs_diff"]
    0.0
    >>> rows[1][0]["max_abs_diff"] > 0
    True
    """
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
    cloudpickle's bytes of it); each step's loss and time, the first step's gradient error against
    ``reference_grads``, one more step's recorder payload (``smoke.run``; ``plan`` is a ``smoke.RunPlan`` as
    a dict).

    Called on every rank of the mesh (the single-device reference on one rank). The model is built from
    ``plan["seed"]`` on the rank's device; over a domain group of more than one rank its parameters and
    buffers are broadcast from the group's first rank; compiled configurations compile each child module
    (``dynamic=False``) before wrapping, with dynamo reset before and after and the on-disk compile caches
    off; then the wrapper (``"ddp"``: DDP over the ``ddp`` sub-mesh's group, ``"fsdp2"``: ``fully_shard``
    over the ``ddp`` sub-mesh) and, for training, SGD with ``plan["lr"]``. Each step's data is drawn from
    torch's generator seeded alike for each step and sample in every configuration; forward only runs under
    ``torch.no_grad()`` in eval mode.

    Parameters
    ----------
    setup : callable or bytes
        ``setup()`` returns the model (a ``torch.nn.Module``); or cloudpickle's bytes of the function.
    step : callable or bytes
        ``step(model, ctx)`` runs one step's forward and returns the loss, a tensor of one element (``ctx``,
        a ``smoke.SmokeContext``, hands it the data: ``ctx.shard(t, dim)``, ``ctx.replicate(t)``); or
        cloudpickle's bytes of the function.
    plan : dict
        A ``smoke.RunPlan`` as a dict: ``config``, ``wrapper`` (``"none"``, ``"ddp"``, ``"fsdp2"``),
        ``compiled``, ``training``, ``single_device``, ``samples``, ``samples_per_domain``, ``steps``,
        ``seed``, ``lr``, ``record``, ``return_grads``.
    reference_grads : dict or None, default None
        Parameter name -> the single-device run's first-step gradient (numpy); None: no gradient error.

    Returns
    -------
    dict
        ``rank`` (0 for the single device), ``coordinate`` (the rank's mesh coordinate; None for the single
        device), ``losses`` (each step's loss as this rank sees it; the single device: the mean over the
        step's samples), ``step_s`` (each step's seconds: forward, backward, optimizer step), ``grad_error``
        (the largest error of a first-step gradient relative to that gradient's largest value; None without
        ``reference_grads`` or training) with ``grad_error_abs`` and ``grad_error_param``, ``grads`` (with
        ``return_grads``: name -> the first-step gradient, whole, float32 numpy; else None) and ``payload``
        (with ``record``: the recorder's payload of one more step; else None).

    Raises
    ------
    SmokeStepError
        An unknown wrapper; ``setup()`` returned no ``torch.nn.Module``; ``step`` returned no tensor, or one
        of more than one element; the parameters with a gradient, or a gradient's shape, differ from
        ``reference_grads``.
    ShardDbgError
        torch.distributed is not set up on this engine and the configuration is not the single device.
    ScatterError
        ``ctx.shard`` / ``ctx.replicate`` refused the data.
    TypeError
        ``plan`` lacks a field of ``RunPlan`` or has one it does not know.
    Exception
        Whatever ``setup`` and ``step`` raise.

    Examples
    --------
    What ``cl.smoke`` sends for one configuration (domain=4 on 4 ranks):

    >>> import cloudpickle
    >>> from sharddbg.engine import api
    >>> plan = dict(config="domain=4", wrapper="none", compiled=False, training=True, single_device=False,
    ...             samples=1, samples_per_domain=1, steps=3, seed=0, lr=0.01, record=False, return_grads=False)
    >>> outs = cl.apply(api.smoke_run, cloudpickle.dumps(setup), cloudpickle.dumps(step), plan)
    >>> len(outs[0]["losses"]), outs[0]["coordinate"], outs[0]["payload"]
    (3, [0, 0], None)
    """
    from . import smoke

    return smoke.run(setup, step, plan, reference_grads)


# ---- numerical check and pitfall doctor (verify.py) -----------------------------------------------
__all__ += ["check_prepare", "check_backward", "check_compare", "check_finish", "doctor_facts"]


def check_prepare(job_dir: str, stmt: str, loss: str | None, inputs, outputs, models, grads: bool) -> dict:
    """Before the statement runs: the ranks agree on the names, TF32 goes off, gradients are set aside, the
    inputs' and distributed parameters' full tensors are gathered and each domain group's first rank writes
    the reference's bundle under ``job_dir`` (collectives on every rank; ``verify.check_prepare``).

    The first of the check's four calls (then the statement as a cell, ``check_backward()``,
    ``check_compare()``, and ``check_finish()`` also after a failure). A check still in progress on this
    rank is finished first. Every rank reads the names the statement (then the loss) reads before binding
    them; the ranks agree in one ``all_gather_object`` that the request is sound before any data moves, and
    find the plain parameters whose values differ across a domain group (another). Then TF32 goes off and
    deterministic algorithms on (warnings only), the RNG state is kept for the reference, and the bundle
    holds each input's ``full_tensor()``, the models (distributed parameters gathered whole), the other
    values the statement reads, and that RNG state.

    Parameters
    ----------
    job_dir : str
        The check's private folder; each domain group's bundle goes into its own folder under it.
    stmt : str
        The statement, Python source.
    loss : str or None
        An expression for the loss; None: the sum over the outputs that require grad of the mean of their
        squares.
    inputs : list of str or None
        Names bound to their ``full_tensor()`` in the reference; None: the tensors the statement reads.
    outputs : list of str or None
        Names compared after the statement; None: the names it binds (those that are no tensor then are
        left out).
    models : list of str or None
        Modules copied to the reference (DDP unwrapped) whose parameter gradients are compared; None: the
        modules the statement reads.
    grads : bool
        Compare gradients: the inputs' and parameters' gradients are set aside now (put back by
        ``check_finish()``).

    Returns
    -------
    dict
        ``rank``, ``group`` (its domain group's ddp index), ``inputs``, ``models``, ``outputs`` (the names
        taken), ``device``, ``tf32`` (``was_on``, ``applies``, ``cuda_matmul_allow_tf32``,
        ``cudnn_allow_tf32``, ``float32_matmul_precision``, as they were), ``deterministic_before`` and
        ``unsynced`` (the plain parameters, ``"model.param"``, whose values differ across this rank's domain
        group).

    Raises
    ------
    CheckSetupError
        On every rank alike when any rank finds the request wrong: a name the ranks do not have, an input
        that is no tensor or a model that is no module, a model wrapped by FSDP1 or ``fully_shard``, a
        distributed tensor the statement reads that is not in ``inputs``, a module with distributed
        parameters that is not in ``models``, ranks that disagree about the names; also not in an IPython
        kernel, and, on a group's first rank, models that cannot be copied to the reference process.
    SyntaxError
        ``stmt`` or ``loss`` is not valid Python.

    Examples
    --------
    ``cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net")``, step by step:

    >>> import tempfile
    >>> from sharddbg.engine import api
    >>> job = tempfile.mkdtemp(prefix="sharddbg-check-")
    >>> prepared = cl.apply(api.check_prepare, job, "y = net(x)", None, ["x"], ["y"], ["net"], True)
    >>> prepared[0]["group"], prepared[0]["inputs"], prepared[0]["models"], prepared[0]["unsynced"]
    (0, ['x'], ['net'], [])
    >>> outputs = cl.run("y = net(x)")
    >>> after = cl.apply(api.check_backward)
    """
    from . import verify

    return verify.check_prepare(job_dir, stmt, loss, inputs, outputs, models, grads)


def check_backward() -> dict:
    """After the statement: the loss and its backward, every compared tensor placed in its global tensor
    (collectives on every rank; ``verify.check_backward``).

    The outputs are taken as the statement left them. The backward runs only when gradients are compared,
    something compared requires grad, the statement ran none itself (then its gradients are compared) and
    every output's spec agrees with its data; a backward that raises on every rank (told through the
    rendezvous store, within 10 s) is a finding, not an error. Every compared tensor's local data is placed
    in its global tensor from the layouts of all ranks (one ``all_gather_object``).

    Returns
    -------
    dict
        ``rank``, ``loss`` (the loss's value summed whole, as a float, when the check ran the backward; else
        None), ``backward`` (``"check"``, ``"statement"``, ``"none"``, ``"skipped"`` or ``"failed"``),
        ``note`` (why, in words) and ``outputs`` (the names compared).

    Raises
    ------
    CheckSetupError
        No check is in progress on this rank (``check_prepare()`` first), or an output named in ``outputs``
        is missing or no tensor after the statement (on every rank alike).
    Exception
        What the loss expression or the backward raised, when the backward did not fail on every rank.

    Examples
    --------
    After ``check_prepare()`` and the statement:

    >>> from sharddbg.engine import api
    >>> after = cl.apply(api.check_backward)
    >>> after[0]["backward"], after[0]["outputs"]
    ('check', ['y'])
    """
    from . import verify

    return verify.check_backward()


def check_compare(rtol: float | None, atol: float | None) -> list[dict]:
    """This rank's tensors against its group's reference, as records (no communication;
    ``verify.check_compare``).

    Reads the reference the unsharded process wrote for this rank's domain group under the check's folder,
    and compares each tensor of ``check_backward()`` with its slice there, in float64 (complex128).

    Parameters
    ----------
    rtol : float or None
        The relative tolerance; None: by the reference's dtype (float64 1e-7, float32 1e-4, float16 5e-3,
        bfloat16 2e-2, complex128 1e-7, complex64 1e-4; other dtypes must match exactly).
    atol : float or None
        The absolute tolerance; None: ``rtol`` times the tensor's largest reference magnitude.

    Returns
    -------
    list of dict
        One record per compared tensor (``analysis.check.check_tables`` reads them): ``tensor``, ``kind``,
        ``rank``, ``group``, ``compared``, ``dtype``, ``shape``, ``reference_shape``, ``max_abs``,
        ``max_rel``, ``ratio``, ``rtol``, ``atol``, ``bad``, ``numel``, ``ok``, ``row_dim``, ``row_start``,
        ``rows`` (``(row, max_abs, ok)`` per row along the sharded dim) and ``note``.

    Raises
    ------
    CheckSetupError
        No check is in progress on this rank (``check_prepare()`` first).
    FileNotFoundError
        The reference process has not written this group's reference.

    Examples
    --------
    After the reference process ran:

    >>> from sharddbg.engine import api
    >>> records = cl.apply(api.check_compare, None, None)
    >>> [(r["tensor"], r["ok"]) for r in records[0]]
    [('y', True), ('x.grad', True), ('net.0.weight.grad', True), ('net.0.bias.grad', True)]
    """
    from . import verify

    return verify.check_compare(rtol, atol)


def check_finish() -> None:
    """Put back the gradients and settings the check changed (no communication; ``verify.check_finish``).

    The gradients set aside, TF32 and the determinism settings as they were before ``check_prepare()``;
    this rank's key in the rendezvous store, where its backward raised, is deleted. Does nothing when no
    check is in progress, so it is safe after a failure.

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> cl.apply(api.check_finish)
    [None, None, None, None]
    """
    from . import verify

    verify.check_finish()


def doctor_facts(names=None) -> dict:
    """What the pitfall doctor reads on this rank (no communication; ``verify.doctor_facts``).

    ``analysis.doctor.examine`` compares the ranks' answers. A parameter reached through two variables (a
    model and its DDP wrapper) counts once.

    Parameters
    ----------
    names : list of str or None, default None
        The variables to examine; None (or empty): every variable of the ``%px`` namespace but those whose
        name starts with ``_``, IPython's own (``In``, ``Out``, ``exit``, ``quit``, ``get_ipython``),
        modules, classes and functions.

    Returns
    -------
    dict
        ``rank``, ``ddp``, ``domain`` (its mesh coordinate), ``missing`` (the ``names`` not found),
        ``params`` (per parameter of each module: ``module``, ``param``, ``kind``, ``shape``, and for a plain
        one its ``digest``), ``shard_tensors`` (per ShardTensor: global shape, sharded dims, mesh dims,
        requires-grad flags as ShardTensor, autograd and its local tensor see them, ``is_leaf``),
        ``async_tensors`` (variables holding an unwaited AsyncCollectiveTensor), ``optimizers`` (per
        parameter group: foreach, fused, distributed and plain parameter counts, CUDA), ``fsdp1``,
        ``ddp_wrappers`` (each with its process group's ranks), ``physicsnemo`` (its version),
        ``requires_grad_works`` (whether ``requires_grad_(True)`` sets autograd's flag on a ShardTensor
        here; None without one), ``unwaited`` (functional collectives never waited), ``plan_cache_entries``
        (DTensor's redistribution plan cache now), ``ddp_group`` and ``domain_group`` (this rank's groups'
        ranks).

    Raises
    ------
    CheckSetupError
        Not in an IPython kernel (the engines of a sharddbg cluster are).

    Examples
    --------
    >>> from sharddbg.engine import api
    >>> facts = cl.apply(api.doctor_facts, ["net", "x"])
    >>> facts[2]["missing"], facts[2]["domain_group"], [p["param"] for p in facts[2]["params"]]
    ([], [0, 1, 2, 3], ['0.weight', '0.bias'])
    """
    from . import verify

    return verify.doctor_facts(names)


# ---- handlers registered from the notebook (Cluster.patch / unpatch / check_patch) ---------------------------
def patch_prepare(op: str, kind: str, payload: bytes, source: str | None, filename: str | None) -> dict:
    """Resolve ``op``, load and check the handler, keep it pending; nothing changes yet
    (``user_patches.prepare``). Raises ``PatchRefused`` with one sentence when this rank refuses."""
    from . import user_patches

    return user_patches.prepare(op, kind, payload, source, filename)


def patch_commit(op: str) -> dict:
    """Register the handler ``patch_prepare`` kept for ``op`` (``user_patches.commit``)."""
    from . import user_patches

    return user_patches.commit(op)


def patch_discard() -> None:
    """Forget the pending handlers (another rank refused; ``user_patches.discard``)."""
    from . import user_patches

    user_patches.discard()


def patch_remove(op: str) -> dict:
    """Take the handler of ``op`` back, every registry entry as it was (``user_patches.remove``)."""
    from . import user_patches

    return user_patches.remove(op)


def patch_suspend(op: str) -> None:
    """Take the handler of ``op`` out of the registries for a while (``user_patches.suspend``)."""
    from . import user_patches

    user_patches.suspend(op)


def patch_resume(op: str) -> None:
    """Put a suspended handler back (``user_patches.resume``)."""
    from . import user_patches

    user_patches.resume(op)


def patch_installed() -> list[dict]:
    """The handlers registered by ``Cluster.patch`` on this rank (``user_patches.installed``)."""
    from . import user_patches

    return user_patches.installed()


def patch_registry_state() -> dict:
    """ShardTensor's four registries as {key: id of the handler} (``user_patches.registry_state``)."""
    from . import user_patches

    return user_patches.registry_state()
