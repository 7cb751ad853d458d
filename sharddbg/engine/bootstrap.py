"""Per-rank set-up inside an engine: physicsnemo import and patch registration, torch.distributed, the
named ("ddp", "domain") mesh and the DistributedManager state that physicsnemo's helpers read.

The fork server calls ``import_physicsnemo`` and ``on_fork``; the client reaches the rest through
``sharddbg.engine.api``. Everything returned is plain data. The facts of the set-up are written to
``rank_state.STATE``, where every other engine module reads them.
"""

from __future__ import annotations

import faulthandler
import os
import platform
import signal
import socket
import sys
import time
from datetime import timedelta

from ..errors import ShardDbgError
from . import control
from .rank_state import STATE, PatchFacts


def _count_patches() -> int:
    from physicsnemo.domain_parallel import ShardTensor

    return sum(
        len(getattr(ShardTensor, name, {}) or {})
        for name in ("_function_registry", "_named_function_registry", "_dispatch_registry", "_dispatch_registry_by_name")
    )


def import_physicsnemo(register_on_cpu: bool = True) -> dict:
    """Import physicsnemo's domain_parallel and make sure its shard patches are registered.

    physicsnemo registers them itself only when CUDA is available; on a CPU host we call its own
    ``register_custom_ops()`` (all of it, not a subset). Returns the patch mode and why.
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        # warp prints a CUDA-driver warning on CPU hosts and physicsnemo a FutureWarning: known noise.
        warnings.simplefilter("ignore", FutureWarning)
        import physicsnemo  # noqa: F401
        import physicsnemo.distributed  # noqa: F401
        import physicsnemo.domain_parallel as dp

    version = getattr(physicsnemo, "__version__", "unknown")
    if torch.cuda.is_available() and _count_patches() > 0:
        mode, reason = "registered-by-physicsnemo", ""
    elif not register_on_cpu:
        mode, reason = "none", "registration not requested"
    else:
        try:
            dp.register_custom_ops()
            mode, reason = "registered-by-sharddbg", "CPU host: physicsnemo registers patches only when CUDA is available"
        except Exception as exc:  # reported per rank, never fatal: the fallback paths still run
            mode, reason = "none", f"register_custom_ops() failed: {type(exc).__name__}: {exc}"
    STATE.patches = PatchFacts(physicsnemo=version, patch_mode=mode, patch_reason=reason, n_patches=_count_patches())
    return {"physicsnemo": version, "patch_mode": mode, "patch_reason": reason, "n_patches": STATE.patches.n_patches}


def on_fork(rank: int) -> None:
    """First thing in a freshly forked engine, before ipyparallel starts: this process is rank ``rank``."""
    STATE.rank = rank
    # A C-level stack dump on SIGUSR1, for a rank so stuck that even the control thread cannot answer.
    # The file is this user's only (0600), like everything in the state folder.
    log_dir = os.environ.get("SHARDDBG_LOG_DIR")
    if log_dir:
        fd = os.open(os.path.join(log_dir, f"stack-rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        dump = os.fdopen(fd, "w")  # lives with the process
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)


def _fill_distributed_manager(rank, world_size, local_rank, device, mesh, mesh_shape) -> None:
    """What physicsnemo's ``scatter_tensor``/``get_mesh_group`` read from the manager.

    ``DistributedManager.initialize()`` fails on CPU hosts (it needs LOCAL_RANK and an accelerator
    device_id), and on GPU hosts it would pick its own port and timeout, so we fill its shared state.
    """
    import torch
    from physicsnemo.distributed import DistributedManager

    state = DistributedManager._shared_state
    state.clear()
    state.update(
        _is_initialized=True,
        _distributed=True,
        _rank=rank,
        _world_size=world_size,
        _local_rank=local_rank,
        _device=device,
        _cuda=device.type == "cuda",
        _initialization_method="sharddbg",
        _global_mesh=mesh,
        _mesh_dims={"ddp": mesh_shape[0], "domain": mesh_shape[1]},
    )
    DistributedManager()  # fills remaining defaults; raises if the state were unusable
    assert isinstance(device, torch.device)


def init_rank(world_size: int, mesh_shape, backend: str, master_port: int, collective_timeout_s: float,
              use_cuda: bool) -> dict:
    """Initialise torch.distributed on a fresh port, build the mesh, fill the manager. Returns status().

    The rank is the one the fork server gave this process (``on_fork``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = STATE.rank
    if rank is None:
        raise ShardDbgError("this process has no rank: only engines forked by a sharddbg cluster can join one")
    t0 = time.perf_counter()
    if STATE.patches is None:
        import_physicsnemo(register_on_cpu=True)
    if dist.is_initialized():
        teardown()
    _flight_recorder_env(torch.__version__)
    # the rank on its host: given by the launcher when engines span hosts (SHARDDBG_LOCAL_RANK), else the rank
    local_rank = int(os.environ.get("SHARDDBG_LOCAL_RANK", rank))
    if use_cuda:
        local_rank = local_rank % torch.cuda.device_count()
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    STATE.group_created_ns = time.time_ns()
    # No device_id: NCCL communicators are then made at the first collective (on the current device, set
    # above) instead of eagerly, and the mesh's subgroups are their own communicators rather than splits of
    # the world's. Split communicators crash the process (SIGSEGV, seen on 2 H200s with torch 2.11) when
    # they are aborted to release a hung rank and the group is then re-created (Cluster.recover).
    dist.init_process_group(
        backend,
        store=_loopback_store(rank, world_size, master_port, collective_timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    mesh = init_device_mesh(device.type, tuple(mesh_shape), mesh_dim_names=("ddp", "domain"))
    if use_cuda:
        _make_communicators(mesh, device)
    _fill_distributed_manager(rank, world_size, local_rank, device, mesh, mesh_shape)
    STATE.world_size = world_size
    STATE.mesh_shape = tuple(mesh_shape)
    STATE.backend = backend
    STATE.device = str(device)
    STATE.mesh = mesh
    STATE.collective_timeout_s = collective_timeout_s
    STATE.dist_inits += 1
    _silence_known_noise()
    _install_user_namespace()
    control.install_handlers()
    out = status()
    out["t_init_s"] = time.perf_counter() - t0
    return out


def _make_communicators(mesh, device) -> None:
    """One tiny collective on the world group and on each mesh dim's group, here where every rank takes
    part: NCCL creates a group's communicator at its first collective, and a rank blocked in that creation
    (a peer that never comes) cannot be released, while one blocked in a collective's kernel can (its
    communicator is aborted). Later hangs then always wait in a kernel."""
    import torch
    import torch.distributed as dist

    one = torch.ones(1, device=device)
    dist.all_reduce(one)
    for dim in mesh.mesh_dim_names:
        group = mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(one, group=group)
    torch.cuda.synchronize(device)


def _flight_recorder_env(torch_version: str) -> None:
    """The Flight Recorder's buffer size (the hang reports read it) under the name this torch reads: 2.13 and
    later read TORCH_FR_BUFFER_SIZE and warn on every rank about the older TORCH_NCCL_TRACE_BUFFER_SIZE,
    which earlier versions need (the cluster sets both)."""
    try:
        major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return
    if (major, minor) >= (2, 13) and "TORCH_FR_BUFFER_SIZE" in os.environ:
        os.environ.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)


def _silence_known_noise() -> None:
    """physicsnemo 2.2.2 calls funcol.all_gather_tensor in a way torch deprecates: one FutureWarning per
    gather, about physicsnemo's code, not the user's."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*all_gather_tensor.*", category=FutureWarning)


def _loopback_store(rank: int, world_size: int, port: int, timeout_s: float):
    """The rendezvous store, listening on 127.0.0.1 only (``tcp://`` init would listen on every interface); on
    rank 0's address of the interface the user named when the ranks span hosts (``SHARDDBG_MASTER_ADDR``)."""
    import torch.distributed as dist

    address = os.environ.get("SHARDDBG_MASTER_ADDR") or "127.0.0.1"
    timeout = timedelta(seconds=max(timeout_s, 30))
    if rank != 0:
        return dist.TCPStore(address, port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(max(64, world_size))
    store = dist.TCPStore(address, port, world_size, True, timeout,
                          master_listen_fd=listener.fileno(), use_libuv=True)
    STATE.store_listener = listener  # the store serves on this socket: keep it open with the store
    return store


def teardown(release_pids=()) -> None:
    """Destroy this rank's process groups (releases peers blocked in a collective with it).

    ``release_pids``: engines blocked in a collective with this rank. Our TCP connections to them are
    shut down first, so their pending gloo operation fails at once with "connection closed by peer"
    instead of waiting for the collective timeout.

    The gloo sockets close only when the process-group objects are freed, so drop every reference we
    hold (the manager's group cache, the mesh in the user namespace) and collect.
    """
    import gc

    import torch.distributed as dist

    from . import recorder

    recorder.abandon()  # a recording cut short by a hang: unhook before anything else
    if release_pids:
        control.sever_connections_to(release_pids)
    if dist.is_initialized():
        dist.destroy_process_group()
    listener, STATE.store_listener = STATE.store_listener, None
    if listener is not None:
        listener.close()
    try:
        from physicsnemo.distributed import DistributedManager

        DistributedManager._shared_state.clear()
    except ImportError:
        pass
    STATE.mesh = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.user_ns.pop("mesh", None)
    except ImportError:
        pass
    gc.collect()


def _install_user_namespace() -> None:
    """Names a %px cell can use without imports (documented in the README)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    from .recorder.cells import install_notebook_cells

    install_notebook_cells(shell)  # cells named by the notebook's count, never this rank's
    import physicsnemo
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Partial, Replicate, Shard

    import sharddbg

    shell.user_ns.update(
        torch=torch, nn=nn, F=F, dist=dist, physicsnemo=physicsnemo, sharddbg=sharddbg,
        ShardTensor=ShardTensor, Shard=Shard, Replicate=Replicate, Partial=Partial,
        rank=STATE.rank, world_size=STATE.world_size, mesh=STATE.mesh,
    )


def status() -> dict:
    """One row of ``Cluster.status()``."""
    import torch

    mesh_shape = STATE.mesh_shape or (1, 1)
    rank = STATE.rank
    patches = STATE.patches or PatchFacts()
    # a plain str: torch's own version object would make the client import torch (seconds) to unpickle the row
    versions = {"torch": str(torch.__version__), "physicsnemo": patches.physicsnemo or "not imported",
                "python": platform.python_version()}
    try:
        import torch.distributed as dist

        dist_up = dist.is_initialized()
    except Exception:
        dist_up = False
    return {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": STATE.device,
        "backend": STATE.backend,
        "dist_initialized": dist_up,
        "ddp": None if rank is None else rank // mesh_shape[1],
        "domain": None if rank is None else rank % mesh_shape[1],
        "torch": versions["torch"],
        "physicsnemo": versions["physicsnemo"],
        "python": versions["python"],
        "patch_mode": patches.patch_mode,
        "n_patches": patches.n_patches,
        "patch_reason": patches.patch_reason,
        "collective_timeout_s": STATE.collective_timeout_s,
        "threads": torch.get_num_threads(),
        "argv0": sys.argv[0] if sys.argv else "",
    }


def user_value(name: str):
    """A variable of the rank's %px namespace (for ``Cluster.pull``)."""
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    if name not in namespace:
        raise NameError(f"no variable {name!r} on rank {STATE.rank}; define it in a %px cell first")
    return namespace[name]


def user_eval(expression: str):
    """Evaluate ``expression`` in the rank's %px namespace (for ``Cluster.eval``)."""
    from IPython import get_ipython

    return eval(expression, get_ipython().user_ns)  # noqa: S307 - the user's own code, on their own engines
