"""``Cluster``: N local ranks of the real PhysicsNeMo ShardTensor stack, driven from one Python process.

Start-up: a fork server imports torch + physicsnemo once (overlapping with the ipyparallel controller's
start) and forks one engine per rank; each engine then joins torch.distributed on a fresh loopback port
with a short collective timeout, builds the ("ddp", "domain") mesh and fills physicsnemo's
DistributedManager. Every wait on engines is bounded; a timeout names the stuck ranks and where they wait.

``Cluster`` is the facade; the work is done by five parts, each behind one object. The facade holds them and
hands each what it needs; none of them reaches back into the facade:

- ``processes.ClusterProcesses``: fork server, controller and engine processes, the registry record,
  stopping and reaping, which ranks died and how;
- ``control.ControlChannel``: requests answered by a rank's control thread even while it is blocked
  (diagnosis, clock, release);
- ``execution.RankExecution``: cells and engine API calls on the ranks, bounded waits, per-rank output,
  ``RankError`` / ``RankTimeoutError`` with their hang reports (it holds the processes and the control
  channel);
- ``group.DistributedGroup``: torch.distributed and the mesh on the ranks, brought up and rebuilt;
- ``recording.CellTracer``: a cell under the recorder on every rank, gathered into a Trace.

The features (``verify``, ``doctor``, ``smoke``, ``replicas``, ``inspect``) are handed the execution (and the
group or mesh where they need it), never the Cluster. What runs on a rank is always a function of
``sharddbg.engine.api`` (or the user's code).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .. import rendering
from ..engine import api
from ..errors import ClusterError, NoActiveClusterError, ShardDbgError, hide_own_frames
from ..options import RecordingOptions
from ..analysis import hang
from . import arguments, registry
from .arguments import check_memory
from .control import ControlChannel
from .execution import PendingCell, RankExecution, RankOutput, engines_in_rank_order, filter_noise
from .group import DistributedGroup
from .mesh import MeshSpec, resolve_mesh
from .engine_launchers import LaunchedProcesses, resolve_launcher
from .processes import ClusterProcesses, choose_backend
from .recording import CellTracer
from .state_file import StateFileWriter
from .versions import TESTED_VERSIONS, check_versions

if TYPE_CHECKING:
    import pandas as pd
    import psutil

    from ..analysis.check import CheckResult
    from ..analysis.diff import DiffResult
    from ..analysis.doctor import DoctorReport
    from ..analysis.patch_check import PatchCheck
    from ..analysis.replica_check import ReplicaCheck
    from ..analysis.smoke import SmokeResult
    from ..trace import Trace
    from .patching import PatchRecord

__all__ = ["Cluster", "RankOutput", "active_cluster", "running_clusters", "filter_noise", "TESTED_VERSIONS"]

# Running clusters in start order (strong references: a cluster started by the magic has no other owner);
# the active one is the last that still runs. stop() removes a cluster.
_STARTED: "list[Cluster]" = []


def running_clusters() -> "list[Cluster]":
    """The clusters of this process that run, in start order (the last is the active one)."""
    return [cluster for cluster in _STARTED if cluster.running]


def active_cluster(required: bool = True) -> "Cluster | None":
    """The cluster started last (by ``Cluster.start`` or ``%shard_cluster start``) and still running."""
    running = running_clusters()
    if running:
        return running[-1]
    if required:
        raise NoActiveClusterError(
            "no sharddbg cluster is running; start one with %shard_cluster start -n 4 "
            "or sharddbg.Cluster(n=4).start()"
        )
    return None


class Cluster:
    """A local cluster of ``n`` ranks, one ipyparallel engine each, on a ``ddp x domain`` mesh.

    Each rank is a process of its own that runs the real PhysicsNeMo ShardTensor stack; this process drives
    them (``run``, ``apply``, ``trace``, the checks). Nothing starts when the object is made: the arguments are
    checked here, and ``start()`` (or a ``with`` block, which stops the cluster at its end) starts the fork
    server, the ipyparallel controller and the engines, and brings up torch.distributed and the mesh on them.
    The cluster started last that still runs is the active one: ``sharddbg.last_trace()``,
    ``sharddbg.inspect()``, ``%px`` and the other magics act on it. A cluster started here ends with this process;
    one started in a terminal (``sharddbg cluster start``) is owned by a keeper process of its own and outlives
    it: ``Cluster.connect(name)`` returns it, and its ``stop()`` asks the keeper to stop it, ``disconnect()`` leaves
    it running, ``restart()`` has the keeper replace its engines.

    Parameters
    ----------
    n : int or None
        The number of ranks. None: the product of the two axes of ``mesh``, which must then give both.
    mesh : dict, str, tuple, MeshSpec or None
        The ``ddp x domain`` mesh: ``{"ddp": 1, "domain": 4}``, ``"ddp=1,domain=4"`` or ``(1, 4)``. One axis
        may be left out (or given as None or -1) and is inferred from ``n``; at most one may be -1, and an axis
        is given once. None: ``ddp=1``, every rank in one domain group (one sample sharded over every rank).
    backend : {"gloo", "nccl"} or None
        torch.distributed's backend. None: chosen at ``start()``, NCCL (one GPU per rank) where the host has
        GPUs, gloo (CPU) where it has none.
    timeout : float
        Seconds a call on the ranks waits at most unless it is given its own ``timeout`` (``run``, ``submit``,
        ``apply``, ``trace``, ``status``, ...); also what ``recover`` and ``remesh`` wait by default.
    start_timeout : float
        Seconds each step of the start-up may take: the controller's start, the fork server's imports of torch
        and physicsnemo, the engines' registration, torch.distributed's start-up on the ranks.
    collective_timeout : float
        torch.distributed's collective timeout on the ranks, in seconds; at least 1, since it also bounds how long
        the ranks wait for each other while torch.distributed connects them at start.
    threads_per_rank : int
        CPU threads of each engine (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``).
    env : dict of str to str or None
        Extra environment variables of the fork server and of every engine it forks; they override sharddbg's
        own (the thread counts, ``GLOO_SOCKET_IFNAME``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ...).
    force : bool
        Skip the check that ``n`` engines (about 0.7 GB each) fit in the memory available now.
    launcher : {None, "mpi", "ssh", "slurm"}
        Who starts the engines. None: sharddbg's fork server on this host (the fast path). ``"mpi"``, ``"ssh"``,
        ``"slurm"``: ipyparallel's own ``MPIEngineSetLauncher``, ``SSHEngineSetLauncher`` or
        ``SlurmEngineSetLauncher``, for ranks on several hosts; each engine's rank is its global rank from the
        launcher (``PMI_RANK``/``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``, or the order of ``hosts`` for ssh),
        ``LOCAL_RANK`` its rank on its host, and torch.distributed meets on rank 0's host. The fork server still
        keeps the controller but preloads nothing: every engine imports torch and physicsnemo itself, at
        ``start()`` and at each ``restart()`` (which starts new engines through the launcher, so it is as slow
        as a start). ``hang reports``, ``recover()`` and tracing work the same; releasing a rank blocked in a
        gloo collective at once, and ``dead_ranks()``, see only this host's engines (one elsewhere shows
        as lost when ipyparallel's heartbeat misses it).
    ip : str or None
        With a launcher: the interface name (``"eth0"``) or this host's address on which the controller listens
        and the engines meet; None keeps everything on loopback (127.0.0.1), for engines on this host only.
    hosts : dict of str to int, list of str, or None
        With ``launcher="ssh"``: the ssh hosts (``"user@host:port"`` allowed) and how many engines each runs;
        ranks are given in this order.
    launcher_config : dict or None
        Settings of ipyparallel's launcher, passed on as they are: ``mpi_args`` (e.g. ``["-hosts", "a,b"]``),
        ``mpi_cmd``, ``ssh_args``, ``scp_args``, ``remote_python``, Slurm's ``options``, ``timelimit``,
        ``queue``, ``account``, ``batch_template``.

    Raises
    ------
    MeshError
        ``n`` is not a positive integer, ``mesh`` is malformed (an axis given twice, both axes -1, ...),
        ``ddp * domain`` cannot be ``n``, or neither ``n`` nor both axes of ``mesh`` are given.
    ClusterError
        ``backend`` is not "gloo", "nccl" or None; ``timeout``, ``start_timeout`` or ``collective_timeout`` is
        not a finite number of seconds above 0, or ``collective_timeout`` is below 1 s; ``threads_per_rank`` is
        not a whole number of at least 1; ``env`` does not map names to string values; or, without ``force``,
        ``n`` engines would not fit in the memory available now. Also, before anything starts: ``launcher`` is
        not one of None, "mpi", "ssh", "slurm"; ``"mpi"`` without ``mpiexec`` (``pip install mpich==4.3.2`` or
        load your MPI module); ``"ssh"`` without ``hosts`` or with counts that do not add up to ``n``;
        ``"slurm"`` without ``sbatch``/``srun``; ``ip`` that is no interface or address of this host.

    Examples
    --------
    >>> cl = sharddbg.Cluster(n=4, mesh={"ddp": 1, "domain": 4})
    >>> cl
    <sharddbg.Cluster stopped n=4 mesh(ddp=1,domain=4) backend=None>
    >>> with sharddbg.Cluster(n=4, mesh="ddp=2,domain=2", timeout=120) as cl:
    ...     outs = cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)")
    """

    def __init__(self, n: int | None = None, mesh=None, *, backend: str | None = None, timeout: float = 60.0,
                 start_timeout: float = 180.0, collective_timeout: float = 60.0, threads_per_rank: int = 1,
                 env: dict | None = None, force: bool = False, launcher: str | None = None, ip: str | None = None,
                 hosts=None, launcher_config: dict | None = None) -> None:
        mesh_spec = resolve_mesh(n, mesh)
        self.n = mesh_spec.size
        self.launcher = resolve_launcher(launcher, self.n, ip=ip, hosts=hosts, launcher_config=launcher_config)
        if backend not in (None, "gloo", "nccl"):
            raise ClusterError(f"backend must be 'gloo', 'nccl' or None (auto), got {backend!r}")
        self.requested_backend = backend
        self.timeout = arguments.seconds("timeout", timeout)
        self.start_timeout = arguments.seconds("start_timeout", start_timeout)
        collective_timeout = arguments.collective_timeout(collective_timeout)
        self.threads_per_rank = arguments.positive_int("threads_per_rank", threads_per_rank)
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise ClusterError(f"env must map variable names to string values, got {env!r}")
        self.extra_env = dict(env or {})
        if not force and (self.launcher is None or not self.launcher.spans_hosts):  # every engine on this host
            check_memory(self.n)
        self.timings: dict[str, float] = {}
        self.running = False
        self._group = DistributedGroup(mesh_spec, collective_timeout)
        self._processes: ClusterProcesses | None = None
        self._execution: RankExecution | None = None
        self._control: ControlChannel | None = None
        self._tracer = CellTracer()
        self._last_check = None  # the CheckResult of the last check() (the doctor reads it)
        self._state_file: StateFileWriter | None = None  # the live state readers outside this process see
        self._keeper = None  # the KeeperLink of a detached cluster this object is connected to (``connect``)

    # ------------------------------------------------------------------ what it is
    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<sharddbg.Cluster {state} n={self.n} mesh({self.mesh}) backend={self.backend}>"

    @property
    def mesh(self) -> MeshSpec:
        """The ``ddp x domain`` mesh the ranks are on (``remesh`` changes it)."""
        return self._group.mesh

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend chosen at start (gloo, or nccl where GPUs are); None before."""
        return self._group.backend

    @property
    def use_cuda(self) -> bool:
        """The ranks run on GPUs (one each)."""
        return self._group.use_cuda

    @property
    def collective_timeout(self) -> float:
        """torch.distributed's collective timeout on the ranks, in seconds."""
        return self._group.collective_timeout

    @property
    def cluster_id(self) -> str | None:
        """The cluster's id in sharddbg's registry of clusters (its log folder is named by it); None before the first
        start, the last one after a stop.
        """
        return self._processes.cluster_id if self._processes else None

    @property
    def log_dir(self) -> str | None:
        """Where the fork server's and each engine's logs are."""
        return self._processes.log_dir if self._processes else None

    @property
    def pids(self) -> dict[int, int]:
        """Rank -> engine process id."""
        return self._processes.pids if self._processes else {}

    @property
    def facts(self) -> dict:
        """What the fork server found on this host: GPU count, versions, patch mode, import times."""
        return self._processes.facts if self._processes else {}

    @property
    def fork_server_pid(self) -> int | None:
        """The fork server's process id (None when it does not run)."""
        return self._processes.fork_server_pid if self._processes else None

    @property
    def controller_pid(self) -> int | None:
        """The ipyparallel controller's process id (None when it does not run)."""
        return self._processes.controller_pid if self._processes else None

    def controller_failure(self) -> str | None:
        """How the ipyparallel controller died, or None while it runs.

        Cheap (a look at the process table, no message to anyone), so it can be asked at any time. Also None when
        no controller is meant to run (before ``start()``, after ``stop()``).

        Returns
        -------
        str or None
            None while the controller runs; else how it died, e.g. ``"the controller (pid 1234) died: killed by
            signal 9 (SIGKILL)"``.

        Examples
        --------
        >>> cl.controller_failure() is None
        True
        """
        return self._processes.controller_failure() if self._processes else None

    @property
    def client(self):
        """The ipyparallel Client connected to the engines (None when not running)."""
        return self._execution.client if self._execution else None

    @property
    def view(self):
        """The ipyparallel DirectView over all ranks, in rank order (None when not running)."""
        return self._execution.view if self._execution else None

    @property
    def engine_ids(self) -> list[int]:
        """The engine id of rank r at index r."""
        return self._execution.engine_ids if self._execution else []

    @property
    def patch_mode(self) -> str | None:
        """How ShardTensor's patches were set up on the ranks at start (rank 0's answer; ``status()`` has
        every rank's): registered-by-physicsnemo, registered-by-sharddbg or none."""
        return self._group.patch_mode

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster that still runs.

        The fork server, the controller and its children (its heart monitor), and the engines, as the cluster's
        registry record names them; empty before the first ``start()`` and after ``stop()``.

        Returns
        -------
        list of psutil.Process
            One per process of the cluster that runs now.

        Examples
        --------
        >>> {p.pid for p in cl.processes()} >= set(cl.pids.values())
        True
        """
        return self._processes.live() if self._processes else []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.running:
            self.stop()

    def start(self) -> "Cluster":
        """Start the controller and the engines, bring up torch.distributed and the mesh; make this the active cluster.

        Clusters whose owning process died are reaped first. Then the fork server starts the ipyparallel
        controller and, meanwhile, imports torch and physicsnemo once; it forks one engine per rank, each engine is
        mapped to its rank, and every rank joins torch.distributed on a fresh loopback port with the backend
        (``backend``, or NCCL where the host has GPUs and gloo where it has none), builds the ``ddp x domain`` mesh
        and fills physicsnemo's DistributedManager. When a step fails, everything started so far is shut down
        before the error is raised. The steps' durations are in ``timings`` (``start_s`` for the whole).
        With a ``launcher``, ssh hosts are first checked to answer without a password; the fork server starts only
        the controller (on ``ip``'s address, else loopback) and ipyparallel's launcher starts the engines, which
        import torch and physicsnemo themselves; ``backend`` None then means NCCL where every engine sees a GPU. An
        untested torch or physicsnemo version on the engines is warned about once (``ShardDbgWarning``); it still
        runs.

        Returns
        -------
        Cluster
            This cluster, running (so ``cl = Cluster(n=4).start()`` works).

        Raises
        ------
        ClusterError
            The cluster is already running (``stop()`` it first, or ``restart()``); NCCL was asked for without a
            GPU per rank; the fork server, the controller or an engine died or did not come up within
            ``start_timeout`` (the message names it and quotes the end of its log); a rank died while joining
            torch.distributed (``RankDiedError``).
        RankError
            A rank raised while joining torch.distributed or building the mesh.
        RankTimeoutError
            A rank did not join torch.distributed within ``start_timeout``; its report says where it waits.
        ipyparallel.error.TimeoutError
            An engine did not say which rank it is within ``timeout``.

        Examples
        --------
        >>> cl = sharddbg.Cluster(n=4).start()
        >>> cl.status()["state"].tolist()
        ['idle', 'idle', 'idle', 'idle']
        """
        __tracebackhide__ = hide_own_frames()
        if self.running:
            raise ClusterError(f"this cluster is already running ({self.n} ranks); stop() it first, or restart()")
        registry.reap_orphans()
        t0 = time.perf_counter()
        settings = dict(threads_per_rank=self.threads_per_rank, requested_backend=self.requested_backend,
                        extra_env=self.extra_env, timings=self.timings)
        self._processes = (ClusterProcesses(**settings) if self.launcher is None else
                           LaunchedProcesses(choice=self.launcher, **settings))
        try:
            facts = self._processes.start(self.start_timeout)
            # launched engines are asked for their GPUs once they run (None: decided then)
            self._launch_engines(None if self.launcher else
                                 choose_backend(self.requested_backend, int(facts.get("cuda_count", 0)), self.n))
            self.running = True
            _STARTED[:] = [c for c in _STARTED if c is not self and c.running] + [self]
            self._state_file = StateFileWriter(self).start()
        except BaseException as exc:
            self._shut_down()
            _advise_start_again(exc, "start")
            raise
        self.timings["start_s"] = time.perf_counter() - t0
        check_versions(self._group.statuses)
        return self

    def _launch_engines(self, backend: str | None) -> None:
        """Engines up and mapped to ranks, then torch.distributed on them with ``backend`` (None: as the
        launched engines' GPUs allow)."""
        t0 = time.perf_counter()
        client = self._processes.launch_engines(self.n, self.start_timeout)
        if backend is None:
            backend = self._processes.engine_backend(self.requested_backend)
        engine_ids = engines_in_rank_order(client, self.n, self.start_timeout)
        self._control = ControlChannel(client, engine_ids)
        self._execution = RankExecution(client, engine_ids, self._processes, self._control, self.timeout)
        self.timings["engines_s"] = time.perf_counter() - t0
        self.timings["dist_init_s"] = self._group.bring_up(self._execution, backend, self.start_timeout)

    def _close_client(self, closed_by: str = "stopped (by cl.stop())") -> None:
        if self._execution is not None:
            self._execution.close(closed_by)
        self._execution = self._control = None

    def _shut_down(self) -> None:
        self._stop_state_file()
        self._close_client()
        if self._processes is not None:
            self._processes.shut_down()
        self.running = False

    def stop(self) -> None:
        """Stop the engines and the controller; check that none of the cluster's processes is left.

        The client is closed; the fork server kills the engines and the controller's whole process group, and
        exits; whatever is left of the cluster's processes is killed, and its registry record and the controller's
        files are removed. The cluster is no longer the active one; ``start()`` starts it again (new processes,
        same settings). The time it took is ``timings["stop_s"]``. A ``with`` block calls it at its end.

        On a cluster this process connected to (``connect``), the cluster's keeper is asked to stop it, and the
        keeper ends too; ``disconnect()`` leaves it running instead.

        Raises
        ------
        ClusterError
            The cluster is not running (it was never started, or was stopped already), or a process of it survived
            SIGKILL (the message lists their pids and command lines).

        Examples
        --------
        >>> cl.stop()
        >>> cl.running, cl.processes()
        (False, [])
        """
        __tracebackhide__ = hide_own_frames()
        if self._keeper is not None:
            return self._leave_keeper(stop=True)
        if not self.running and (self._processes is None or self._processes.fork_server is None):
            raise ClusterError("this cluster is not running (it was never started, or was stopped already)")
        t0 = time.perf_counter()
        self._stop_state_file()
        self._close_client()
        self._processes.stop()
        self.running = False
        _STARTED[:] = [c for c in _STARTED if c is not self]
        self.timings["stop_s"] = time.perf_counter() - t0

    @classmethod
    def connect(cls, name: str | None = None, *, timeout: float = 60.0) -> "Cluster":
        """Connect to a detached cluster (started in a terminal by ``sharddbg cluster start``) and make it the active one.

        The cluster is owned by its keeper process, not by this one: it outlives this process (a kernel restart),
        and its engines keep their variables. This process gets its own ipyparallel client to the cluster's
        controller; the ranks, mesh, backend, patch mode and collective timeout are read back from the engines, a
        broken process group and the last trace from the keeper (which a connected process tells of them).
        Everything works as on a cluster started here. ``stop()`` asks the keeper to stop the cluster (the keeper
        ends too); ``disconnect()`` leaves it running for the next process; ``restart()`` asks the keeper for new
        engines (its fork server stays) and connects to them.

        Parameters
        ----------
        name : str or None
            The cluster's name (``sharddbg cluster list``). None: the only detached cluster of this user.
        timeout : float
            Seconds a call on the ranks waits at most unless given its own (as ``Cluster(timeout=...)``).

        Returns
        -------
        Cluster
            Connected and running (``timings["connect_s"]`` is how long connecting took).

        Raises
        ------
        ClusterError
            No cluster has that name (those that run are listed); it belongs to another user; it was stopped (when and
            how); its keeper is gone; with no name, none or several run; its keeper or controller does not answer.

        Examples
        --------
        >>> cl = sharddbg.Cluster.connect("dev")
        >>> cl.eval("x")
        [1, 1]
        >>> cl.disconnect()
        """
        __tracebackhide__ = hide_own_frames()
        from . import detached

        timeout = arguments.seconds("timeout", timeout)
        link, info = detached.open_link(name)
        cl = cls(n=info["n"], backend=info["backend"], timeout=timeout, collective_timeout=info["collective_timeout"],
                 force=True)
        cl._attach(link, info)
        return cl

    def _attach(self, link, info: dict) -> None:
        """Connect this object to the detached cluster the keeper ``link`` describes in ``info``."""
        from . import detached

        t0 = time.perf_counter()
        processes = detached.KeeperProcesses(link, info)
        client = detached.connect_client(info, self.start_timeout)
        try:
            engine_ids = engines_in_rank_order(client, self.n, self.timeout)
            control = ControlChannel(client, engine_ids)
            execution = detached.ConnectedExecution(client, engine_ids, processes, control, self.timeout, link,
                                                    info.get("broken"))
            found = detached.read_back(execution, self.n, self.timeout)
        except BaseException:
            client.close()
            raise
        self._keeper, self._processes, self._control, self._execution = link, processes, control, execution
        self._group.statuses, self._group.mesh, self._group.backend = found.statuses, found.mesh, found.backend
        self._group.use_cuda = found.use_cuda
        self._group.collective_timeout = found.collective_timeout or self._group.collective_timeout
        self._tracer = detached.ConnectedTracer(link, info["cluster_id"], info.get("last_trace"))
        self.running = True
        _STARTED[:] = [c for c in _STARTED if c is not self and c.running] + [self]
        self.timings["connect_s"] = time.perf_counter() - t0

    def disconnect(self) -> None:
        """Leave a detached cluster running and stop using it from this process (``connect`` again later).

        Raises
        ------
        ClusterError
            This cluster was not connected to with ``connect`` (``stop()`` stops a cluster started here).

        Examples
        --------
        >>> cl.disconnect()
        >>> sharddbg.Cluster.connect("dev").eval("x")
        [1, 1]
        """
        __tracebackhide__ = hide_own_frames()
        if self._keeper is None:
            raise ClusterError("this cluster was started by this process, not connected to: stop() stops it "
                               "(a cluster outlives its process only when started by `sharddbg cluster start`)")
        self._leave_keeper(stop=False)

    def _leave_keeper(self, stop: bool) -> None:
        """Close this process's client; with ``stop``, have the keeper stop the cluster and check nothing is left."""
        from . import detached

        t0 = time.perf_counter()
        link = self._keeper
        self._close_client("stopped (by cl.stop())" if stop else "disconnected (by cl.disconnect())")
        self._processes.close()
        self._keeper, self.running = None, False
        _STARTED[:] = [c for c in _STARTED if c is not self]
        if stop:
            record = detached.find(link.name)
            link.request("stop", timeout=3 * self.start_timeout, reason="stopped by cl.stop() in a connected process")
            report = detached.finish_stop(record, "stopped by cl.stop() in a connected process", t0)
            self.timings["stop_s"] = time.perf_counter() - t0
            if report.survivors:
                raise ClusterError(f"processes of cluster {link.name!r} survived its stop: pids {report.survivors}")

    def _stop_state_file(self) -> None:
        if self._state_file is not None:
            self._state_file.stop()
            self._state_file = None

    def restart(self) -> "Cluster":
        """Replace every engine with a fresh one (new processes, new process group); the same mesh and settings.

        The fork server (torch and physicsnemo already imported) is kept, so this is quicker than a start: the
        client is closed, the engines are killed, the controller is started again, new engines are forked and
        torch.distributed comes up on them with the same backend (``timings["restart_s"]``). Everything the old
        ranks held is gone (variables, ShardTensors, a broken process group); a rank ipyparallel unregistered
        (``lost_ranks()``) is killed like the others and replaced. When the cluster is not running, or
        its fork server is gone, what is left of it is stopped and it is started from scratch (``start()``). When
        replacing the engines fails, the cluster is stopped and the error raised. With a ``launcher`` ("mpi",
        "ssh", "slurm") nothing is forked: the launcher's engines are ended (mpiexec's process tree killed, ssh's
        engines killed, the Slurm job cancelled), the controller started again, and the launcher starts new
        engines, each importing torch and physicsnemo itself, so a restart takes as long as a start. On a cluster
        this process connected to (``connect``), its keeper replaces the engines (keeping its fork server, and the
        mesh last set here) and this process connects to the new ones.

        Returns
        -------
        Cluster
            This cluster, running.

        Raises
        ------
        ClusterError
            The controller or an engine died or did not come up within ``start_timeout``; or, when the cluster is
            started from scratch, what ``start()`` raises.
        RankError
            A rank raised while joining torch.distributed.
        RankTimeoutError
            A rank did not join torch.distributed within ``start_timeout``.

        Examples
        --------
        >>> cl.restart()
        <sharddbg.Cluster running n=4 mesh(ddp=1,domain=4) backend=gloo>
        """
        __tracebackhide__ = hide_own_frames()
        t0 = time.perf_counter()
        if self._keeper is not None:  # the keeper restarts it (its fork server stays), then this process reconnects
            self._close_client("restarted (by cl.restart())")
            self._processes.close()
            try:
                self._attach(self._keeper, self._keeper.request("restart", timeout=3 * self.start_timeout))
            except BaseException:  # the keeper stopped the cluster (a failed restart) or cannot be reached
                self.running = False
                _STARTED[:] = [c for c in _STARTED if c is not self]
                raise
            self.timings["restart_s"] = time.perf_counter() - t0
            return self
        if not self.running or not self._processes.fork_server_alive():
            if self.running or (self._processes is not None and self._processes.fork_server is not None):
                self.stop()
            self.start()
            self.timings["restart_s"] = time.perf_counter() - t0
            return self
        try:
            self._close_client("restarted (by cl.restart())")
            self._processes.replace_engines()
            self._launch_engines(self.backend)
        except BaseException as exc:
            self.stop()
            _advise_start_again(exc, "restart")
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        return self

    def recover(self, timeout: float | None = None) -> None:
        """Release ranks blocked in a collective and re-create the process group, after a hang or a broken group.

        The engines (and their pids) are kept. Every rank ends the collectives it waits in, from its control
        thread (its connections to the other ranks shut: a gloo collective fails at once; its NCCL communicators
        aborted); a rank still busy after that in the user's own code (a loop, a sleep) is interrupted (SIGINT:
        ``KeyboardInterrupt`` in its cell). Then every rank tears the old process group down and joins a new one
        on a fresh port, on the same mesh; calls that timed out are forgotten and ``broken`` is None again.
        Tensors built on the old mesh must be rebuilt. A dead rank cannot be recovered: ``restart()``.

        Parameters
        ----------
        timeout : float or None
            Seconds the teardown and the new group's start-up may each take (released ranks get at most 5 s to
            end their work, twice); None: the cluster's ``timeout``.

        Raises
        ------
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; a rank is dead or
            lost (``RankLostError``: ipyparallel unregistered it); a rank is still busy after it was released and
            interrupted; or the controller died.
        RankError
            A rank raised while tearing the old group down or joining the new one.
        RankTimeoutError
            A rank did not finish that within ``timeout``.

        Examples
        --------
        >>> cl.broken
        'the cell: ranks [0, 1, 2] were left waiting in a collective after 3 s'
        >>> cl.recover()
        >>> cl.broken is None
        True
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        timeout = arguments.seconds("timeout", timeout, allow_none=True) or self.timeout
        self._rebuild_group(self.mesh, timeout)

    def remesh(self, mesh, *, timeout: float | None = None) -> None:
        """Rebuild torch.distributed on the same engines with another ``ddp x domain`` mesh of the same ranks.

        A mesh that does not fit the cluster's size is refused (``MeshError``) before anything changes. As with
        ``recover()``: ranks blocked in a collective are released, every rank tears its process group down and
        joins a new one with the new mesh (the ``mesh`` of a %px cell is the new one); tensors built on the old
        mesh must be rebuilt. ``smoke()`` uses it for each configuration's mesh.

        Parameters
        ----------
        mesh : dict, str, tuple, MeshSpec or None
            The new mesh: ``{"ddp": 2, "domain": 2}``, ``"ddp=2,domain=2"``, ``(2, 2)``; one axis may be left out
            and is inferred from the cluster's size. None: ``ddp=1``, every rank in one domain group.
        timeout : float or None
            Seconds the teardown and the new group's start-up may each take (released ranks get at most 5 s to
            end their work, twice); None: the cluster's ``timeout``.

        Raises
        ------
        MeshError
            ``mesh`` is malformed, or its ``ddp * domain`` is not the cluster's number of ranks.
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; a rank is dead; a
            rank is still busy after it was released and interrupted; or the controller died.
        RankError
            A rank raised while tearing the old group down or joining the new one.
        RankTimeoutError
            A rank did not finish that within ``timeout``.

        Examples
        --------
        >>> cl.remesh({"ddp": 2, "domain": 2})
        >>> cl.mesh
        MeshSpec(ddp=2, domain=2)
        >>> cl.remesh("domain=4")
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        spec = resolve_mesh(self.n, mesh)
        timeout = arguments.seconds("timeout", timeout, allow_none=True) or self.timeout
        self._rebuild_group(spec, timeout)

    def _rebuild_group(self, spec: MeshSpec, timeout: float) -> None:
        """Release blocked ranks, tear the process group down on every rank, bring it up with mesh ``spec``."""
        self.timings["dist_init_s"] = self._group.rebuild(self._execution, spec, timeout)
        if self._keeper is not None:  # a restart by the keeper, or the next process to connect, keeps this mesh
            self._keeper.note(mesh=str(self.mesh))

    # ------------------------------------------------------------------ running code
    def _require_running(self) -> None:
        if not self.running:
            raise ClusterError("this cluster is not running; start() it first")

    def busy_ranks(self) -> list[int]:
        """Ranks whose engine is still running (or has queued) work.

        The controller is asked, unless every request this client sent has its reply (then no rank is busy). Dead
        and lost ranks are not listed (``dead_ranks()`` and ``lost_ranks()`` have them). Only for a running
        cluster.

        Returns
        -------
        list of int
            The busy ranks, in rank order; empty when every live rank is idle.

        Raises
        ------
        ClusterError
            The cluster is not running, or the controller died, or did not answer within 10 s.

        Examples
        --------
        >>> cell = cl.submit("import time; time.sleep(30)")
        >>> cl.busy_ranks()
        [0, 1, 2, 3]
        """
        self._require_running()
        return self._execution.busy_ranks()

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has exited, with how.

        As seen by the fork server, their parent, which reaps them; a rank whose end it has not reported within a
        second "is gone (its process no longer exists)". Empty before the first start.

        Returns
        -------
        dict of int to str
            Rank -> how its process ended, e.g. ``{2: "killed by signal 9 (SIGKILL)"}``; empty while every engine
            runs.

        Examples
        --------
        >>> cl.dead_ranks()
        {}
        """
        return self._processes.dead_ranks() if self._processes else {}

    def lost_ranks(self) -> dict[int, str]:
        """Ranks whose engine ipyparallel unregistered while its process still exists, with the state of that process.

        The controller unregisters an engine that misses its heartbeat for about 5.5 s (its process stopped by
        SIGSTOP or a debugger, or starved); ipyparallel never takes it back, even once the process goes on, so
        every call that needs it raises ``RankLostError`` until ``restart()`` replaces every engine. Empty while
        the cluster does not run.

        Returns
        -------
        dict of int to str
            Rank -> the state of its process, e.g. ``{1: "stopped (SIGSTOP, or a debugger holds it)"}`` or
            ``{1: "alive (sleeping)"}``; empty while every engine is registered.

        Examples
        --------
        >>> cl.lost_ranks()
        {}
        """
        return self._execution.lost_ranks() if self._execution is not None else {}

    def run(self, code: str, *, timeout: float | None = None, targets=None, display: bool = True) -> list[RankOutput]:
        """Execute ``code`` on every rank (or ``targets``); wait at most ``timeout`` seconds.

        Each rank runs it as a %px cell, in its own namespace (``torch``, ``sharddbg``, ``rank``, ``mesh``, ... are
        there without an import). Prints each rank's output in rank order when ``display``, every line prefixed
        with its rank. While it waits it watches for what ends the wait early: a dead controller; a dead rank (the
        others are released from any collective with it); a rank that raised while others wait for it in a
        collective (they are released at once instead of waiting out the collective timeout).

        Parameters
        ----------
        code : str
            Python source, run as a cell on each rank.
        timeout : float or None
            Seconds to wait at most; None: the cluster's ``timeout``.
        targets : int, list of int, range, slice or None
            The ranks that run it; None: every rank.
        display : bool
            Print each rank's output (stdout, stderr, rich output) in rank order.

        Returns
        -------
        list of RankOutput
            One per rank that ran it, in rank order: ``rank``, ``stdout``, ``stderr``, ``result`` (the text IPython
            shows for the cell's last expression; ipyparallel's reply object when the cell ends without one),
            ``error`` (None) and ``displays`` (rich outputs).

        Raises
        ------
        ClusterError
            The cluster is not running; ``code`` is not a string; ``timeout`` is not a finite number of seconds
            above 0; ``targets`` names no rank, a rank twice, a rank that does not exist or a dead one; the
            process group is broken (``recover()`` first); a target still runs an earlier call that timed out, or a
            ``submit()`` cell nothing waited for; or the controller died.
        RankError
            A rank raised: the ranks whose own failure started it come first, with their traceback and the line of
            the cell (``errors``, ``causes``, ``released``, ``report``).
        RankTimeoutError
            A rank did not finish in time; its ``report`` says where each unfinished rank waits. Ranks left waiting
            in a collective leave the process group broken.
        RankDiedError
            A rank's process died meanwhile (a ``ClusterError``): how, and what the other ranks printed and raised;
            also when the cell called ``exit()`` on a rank (once that rank's process is gone).
        RankLostError
            A target stopped answering ipyparallel's heartbeat (stopped by SIGSTOP or a debugger) and was
            unregistered, meanwhile or before (a ``ClusterError``): nothing reaches it until ``restart()``.

        Examples
        --------
        >>> outs = cl.run("print(rank)")
        [rank 0] 0
        [rank 1] 1
        [rank 2] 2
        [rank 3] 3
        >>> [o.result for o in cl.run("rank * 10", display=False)]
        ['0', '10', '20', '30']
        >>> outs = cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)", timeout=60)
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        _check_code(code)
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.run(code, self._execution.ranks(targets), timeout, display)

    def submit(self, code: str, *, timeout: float | None = None, targets=None) -> PendingCell:
        """Send ``code`` to every rank (or ``targets``) and return at once, without waiting (``%px --noblock``).

        The cell's time limit is ``timeout`` (default: the cluster's), counted from now; its handle's
        ``wait(seconds)`` and ``get()`` stay within it, and ``get()`` prints each rank's output and raises what
        ``run()`` raises. New work for its ranks is refused while it runs (it would queue behind it).

        Parameters
        ----------
        code : str
            Python source, run as a cell on each rank.
        timeout : float or None
            The cell's time limit in seconds, from now; None: the cluster's ``timeout``.
        targets : int, list of int, range, slice or None
            The ranks that run it; None: every rank.

        Returns
        -------
        PendingCell
            The cell's handle: ``done()``, ``wait(seconds)``, ``get()``, ``display_outputs()``.

        Raises
        ------
        ClusterError
            The cluster is not running; ``code`` is not a string; ``timeout`` is not a finite number of seconds
            above 0; ``targets`` names no rank, a rank twice, a rank that does not exist or a dead one; the
            process group is broken; a target still runs an earlier call that timed out, or an earlier cell nothing
            waited for; or the controller died.

        Examples
        --------
        >>> cell = cl.submit("import time; time.sleep(20); print(rank)", timeout=60)
        >>> cell.done()
        False
        >>> outs = cell.get()
        [rank 0] 0
        [rank 1] 1
        [rank 2] 2
        [rank 3] 3
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        _check_code(code)
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.submit(code, self._execution.ranks(targets), timeout)

    def apply(self, fn, *args, timeout: float | None = None, targets=None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank (or ``targets``); the results in rank order.

        ``fn`` is normally a function of ``sharddbg.engine.api`` (what a rank answers); it travels to the ranks,
        and its arguments and results back, as ipyparallel sends them (pickled). Each rank's printed output is
        shown in rank order. The process group's state is not checked, so this works while it is broken.

        Parameters
        ----------
        fn : callable
            What each rank calls.
        *args : object
            Its positional arguments, the same on every rank.
        timeout : float or None
            Seconds to wait at most; None: the cluster's ``timeout``.
        targets : int, list of int, range, slice or None
            The ranks that call it; None: every rank.
        **kwargs : object
            Its keyword arguments, the same on every rank (``timeout`` and ``targets`` are this method's own:
            ``fn`` cannot be given keywords of those names).

        Returns
        -------
        list
            What ``fn`` returned on each rank, in rank order.

        Raises
        ------
        ClusterError
            The cluster is not running; ``fn`` is not callable; ``timeout`` is not a finite number of seconds
            above 0; ``targets`` names no rank, a rank twice, a rank that does not exist or a dead one; a target
            still runs an earlier call that timed out, or a cell nothing waited for; or the controller died.
        RankError
            ``fn`` raised on a rank.
        RankTimeoutError
            A rank did not finish in time (with where it waits).
        RankDiedError
            A rank's process died meanwhile.

        Examples
        --------
        >>> from sharddbg.engine import api
        >>> cl.apply(api.rank)
        [0, 1, 2, 3]
        >>> cl.apply(api.user_eval, "world_size", targets=[0])
        [4]
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        if not callable(fn):
            raise ClusterError(f"apply() takes a function, got {type(fn).__name__} {fn!r}")
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.apply(fn, args, kwargs, self._execution.ranks(targets), timeout)

    def pull(self, name: str, *, timeout: float | None = None, targets=None) -> list:
        """The value of variable ``name`` on every rank (or ``targets``), in rank order.

        Read from each rank's %px namespace and sent back pickled; it works while the process group is broken.

        Parameters
        ----------
        name : str
            A variable of the ranks' namespace (an identifier, not an expression: ``eval()`` takes those).
        timeout : float or None
            Seconds to wait at most; None: the cluster's ``timeout``.
        targets : int, list of int, range, slice or None
            The ranks to read; None: every rank.

        Returns
        -------
        list
            The variable's value on each rank, in rank order.

        Raises
        ------
        ClusterError
            ``name`` is not an identifier; or what ``apply()`` raises before it sends anything (the cluster is not
            running, a bad ``timeout`` or ``targets``, a dead or still busy rank, a dead controller).
        RankError
            A rank has no variable ``name`` (``NameError`` there).
        RankTimeoutError
            A rank did not answer in time.
        RankDiedError
            A rank's process died meanwhile.

        Examples
        --------
        >>> cl.pull("rank")
        [0, 1, 2, 3]
        >>> cl.pull("world_size", targets=[0, 2])
        [4, 4]
        """
        __tracebackhide__ = hide_own_frames()
        if not isinstance(name, str) or not arguments.variable_name(name).isidentifier():
            raise ClusterError(f"pull() takes a variable name, got {name!r}")
        return self.apply(api.user_value, arguments.variable_name(name), timeout=timeout, targets=targets)

    def eval(self, expression: str, *, timeout: float | None = None, targets=None) -> list:
        """Evaluate a Python expression in every rank's (or ``targets``') namespace; the values in rank order.

        The expression is evaluated in each rank's %px namespace and the values are sent back pickled; it works
        while the process group is broken.

        Parameters
        ----------
        expression : str
            A Python expression.
        timeout : float or None
            Seconds to wait at most; None: the cluster's ``timeout``.
        targets : int, list of int, range, slice or None
            The ranks that evaluate it; None: every rank.

        Returns
        -------
        list
            The expression's value on each rank, in rank order.

        Raises
        ------
        ClusterError
            ``expression`` is not a string; or what ``apply()`` raises before it sends anything (the cluster is
            not running, a bad ``timeout`` or ``targets``, a dead or still busy rank, a dead controller).
        RankError
            The expression raised on a rank (a ``SyntaxError``, a ``NameError``, ...).
        RankTimeoutError
            A rank did not answer in time.
        RankDiedError
            A rank's process died meanwhile.

        Examples
        --------
        >>> cl.eval("tuple(x._local_tensor.shape)")
        [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 16, 64), (1, 3, 16, 64)]
        """
        __tracebackhide__ = hide_own_frames()
        if not isinstance(expression, str):
            raise ClusterError(f"eval() takes an expression as a string, got {type(expression).__name__}")
        return self.apply(api.user_eval, expression, timeout=timeout, targets=targets)

    # ------------------------------------------------------------------ inspection
    def diagnose(self, ranks=None, timeout: float = 5.0) -> dict[int, dict | None]:
        """Each rank's stack and Flight Recorder, answered by its control thread even while the rank is blocked.

        No cell runs: the request goes to each rank's control thread, which answers while the main thread waits in
        a collective or runs the user's code (``%shard_cluster diagnose`` and the hang reports read the same).

        Parameters
        ----------
        ranks : int, list of int, range, slice or None
            The ranks to ask; None: every rank.
        timeout : float
            Seconds the ranks have to answer, all together.

        Returns
        -------
        dict of int to (dict or None)
            Rank -> its diagnosis, or None for a rank that did not answer in time. A diagnosis holds ``rank``,
            ``pid``, ``stack`` (the main thread's frames, outermost first, each with ``file``, ``line``,
            ``function``, ``code`` and ``user``), ``flight_recorder`` (torch's Flight Recorder entries of its
            collectives), ``groups`` (process-group name -> its ranks), ``mesh_dims`` (process-group name -> the
            mesh dim it serves) and, while a recording runs, ``recording`` (what was recorded so far) or
            ``recording_error``.

        Raises
        ------
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; ``ranks`` names no
            rank, a rank twice, a rank that does not exist or a dead one; or the controller died (nothing can reach the ranks:
            the message says how it died, and that ``restart()`` rebuilds the cluster).

        Examples
        --------
        >>> d = cl.diagnose()
        >>> sorted(d[0])
        ['flight_recorder', 'groups', 'mesh_dims', 'pid', 'rank', 'stack']
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        timeout = arguments.seconds("timeout", timeout)
        answers = self._control.diagnose(self._execution.ranks(arguments.ranks(ranks, self.n, "ranks")), timeout)
        if None in answers.values():
            self._execution.check_controller()  # silent ranks behind a dead controller: say that it died
        return answers

    def hang_report(self, timeout, finished, unfinished, what="the cell", *,
                    diagnose_timeout: float = 5.0, failures=None) -> hang.HangReport:
        """Where the ``unfinished`` ranks wait, after ``timeout`` seconds of ``what``: a hang report.

        Every live rank's diagnosis is asked of its control thread (as ``diagnose()`` does); the report names,
        for each unfinished rank, its stack (the user's code first) and the collective it waits in, with the ranks
        of its group that never issued it. It works from the moment the engines are connected, so a start-up that
        times out is diagnosed too. A ``RankTimeoutError`` carries one (``report``); ``%shard_cluster diagnose``
        prints one.

        Parameters
        ----------
        timeout : float
            Seconds the work has run (the report's words only).
        finished : list of int
            The ranks that finished.
        unfinished : list of int
            The ranks still running it: the report says where each waits.
        what : str
            What they run, in the report's words (``"the cell"``, ``"their current work"``, ...).
        diagnose_timeout : float
            Seconds the ranks' control threads have to answer, all together; each rank's diagnosis is in the
            report's ``diagnoses`` (None for a rank that did not answer).
        failures : dict of int to RankFailure or None
            The ranks that raised meanwhile (rank -> ``RankFailure``), which the report leads with.

        Returns
        -------
        HangReport
            ``finished``, ``unfinished``, ``ranks`` (unfinished rank -> where it waits), ``diagnoses``,
            ``failures``, ``summary()`` (one line) and ``format()`` (the whole text, also ``str()``).

        Raises
        ------
        ClusterError
            The engines are not connected (before ``start()``, after ``stop()``).

        Examples
        --------
        >>> busy = cl.busy_ranks()
        >>> busy
        [3]
        >>> report = cl.hang_report(0, [r for r in range(cl.n) if r not in busy], busy, what="their current work")
        >>> print(report.summary())
        1 of 4 ranks did not finish their current work within 0 s: ranks [3] still running; ranks [0, 1, 2] finished.
        """
        diagnose_timeout = arguments.seconds("diagnose_timeout", diagnose_timeout)
        if self._execution is None:
            raise ClusterError("this cluster is not running; start() it first")
        return self._execution.hang_report(timeout, finished, unfinished, what, diagnose_timeout=diagnose_timeout,
                                           failures=failures)

    def clock_offsets(self, samples: int = 15, timeout: float = 5.0, measure_all: bool = False) -> dict[int, dict]:
        """How far each rank's recorder clock is ahead of this process's ``time.monotonic_ns()``.

        On the control channel, every rank asked once, all at once. A rank on this host reads this process's own
        monotonic clock (one boot of one kernel, one time namespace: ``sharddbg.engine.clock.domain()``), so its
        offset is known: what its sharddbg clock adds (0 but in tests), uncertainty 0, once its reading falls
        within that round trip. Any other rank is measured NTP-style, one after the other: ``samples`` round
        trips; the one with the shortest round trip wins, offset = engine time - midpoint, uncertainty = half its
        round trip. ``trace()`` takes them after each cell to put every rank's events on one time axis.

        Parameters
        ----------
        samples : int
            Round trips per measured rank; at least 1.
        timeout : float
            Seconds each round trip may take.
        measure_all : bool
            Measure every rank by round trips, those that share this process's clock too.

        Returns
        -------
        dict of int to dict
            Rank -> ``{"offset_ns": int, "uncertainty_ns": int}``, for every rank.

        Raises
        ------
        ClusterError
            ``samples`` is not a whole number of at least 1 or ``timeout`` not a number of seconds above 0; the
            cluster is not running; or a rank did not answer a round trip within ``timeout``.

        Examples
        --------
        >>> offsets = cl.clock_offsets()
        >>> sorted(offsets[0])
        ['offset_ns', 'uncertainty_ns']
        """
        samples = arguments.positive_int("samples", samples)
        timeout = arguments.seconds("timeout", timeout)
        measure_all = arguments.flag("measure_all", measure_all)
        self._require_running()
        return self._control.clock_offsets(samples, timeout, measure_all=measure_all)

    def status(self, full: bool = False) -> pd.DataFrame:
        """One row per rank: pid, device, backend, mesh coordinate, patch mode, state and the process group's health.

        Idle ranks are asked now; a busy or dead rank's row is what it said when torch.distributed last came up
        on it (its ``state`` is current).

        Parameters
        ----------
        full : bool
            Every column: also ``host``, ``n_patches``, the ``torch``, ``physicsnemo`` and ``python`` versions,
            ``engine_id``, ``dist_initialized``, ``patch_reason``, ``collective_timeout_s`` and ``threads``.

        Returns
        -------
        pandas.DataFrame
            Indexed by ``rank``; columns ``pid``, ``host`` (only for a cluster started with a ``launcher``: the
            host each engine runs on, as it says itself), ``device``, ``backend``, ``ddp`` and ``domain`` (the mesh
            coordinate), ``patch_mode`` (registered-by-physicsnemo, registered-by-sharddbg or none), ``state``
            (``idle``, ``busy``, ``dead: `` and how it died, or ``lost: `` when ipyparallel unregistered its engine
            while its process lives) and ``process_group`` (``ok``, ``broken at`` and why, or ``broken: `` where
            torch.distributed is not initialized on some ranks); with ``full``, every column of
            ``group.STATUS_COLUMNS`` in that order (one no rank could fill holds None).

        Raises
        ------
        ClusterError
            The cluster is not running, or the controller died.
        RankError
            An idle rank raised while answering.
        RankTimeoutError
            An idle rank did not answer within the cluster's ``timeout``.

        Examples
        --------
        >>> cl.status()["state"].tolist()
        ['idle', 'idle', 'dead: killed by signal 9 (SIGKILL)', 'idle']
        >>> list(cl.status(full=True).columns)[:4]
        ['pid', 'host', 'device', 'backend']
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        return self._group.status_table(self._execution, full, with_host=self.launcher is not None)

    @property
    def broken(self) -> str | None:
        """Why the process group cannot be used (a failed or released collective, a hang, a dead rank), or
        None while it works; cells are refused until ``recover()``."""
        return self._execution.broken.cause if self._execution is not None and self._execution.broken else None

    def inspect(self, name: str, *, timeout: float | None = None) -> Any:
        """The shard inspector for the tensor named ``name`` on the ranks: a widget with its block diagram.

        Every rank sends a snapshot of its part (local reads, no communication between ranks); the snapshots are
        put together in a ``ShardLayout`` (shapes, offsets and placements checked against each other) and shown by
        the inspector widget. A ShardTensor, a DTensor or a plain torch.Tensor can be inspected. See
        ``sharddbg.cluster.inspect``; ``%shard_inspect NAME`` shows the same.

        Parameters
        ----------
        name : str
            A variable of the ranks' %px namespace, or a dotted path to an attribute of one (``"model.weight"``).
        timeout : float or None
            Seconds to wait for the snapshots; None: the cluster's ``timeout``.

        Returns
        -------
        ShardInspector
            The widget (``sharddbg.views.inspector.ShardInspector``): ``get_ranks()`` (one row per rank: local
            shape, offsets, placements, ...), ``text()`` (the inspector as plain text), ``warnings`` and
            ``shard_layout``.

        Raises
        ------
        InspectError
            ``name`` is not a variable name or dotted path, or the variable is missing on some ranks or is not a
            tensor there.
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; a rank is dead, or
            still runs an earlier call that timed out or a cell nothing waited for; or the controller died.
        RankError
            A rank raised while taking its snapshot.
        RankTimeoutError
            A rank did not answer in time.

        Examples
        --------
        >>> outs = cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)")
        >>> w = cl.inspect("x")
        >>> w.get_ranks()["local_shape"].tolist()
        [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 16, 64), (1, 3, 16, 64)]
        """
        __tracebackhide__ = hide_own_frames()
        from .inspect import gather_layout

        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        self._require_running()
        return rendering.inspector(gather_layout(self._execution, self.mesh, name, timeout=timeout))

    # ------------------------------------------------------------------ recording
    def trace(self, code: str, *, timeout: float | None = None, display: bool = True,
              options: RecordingOptions | None = None, max_events: int | None = None, unmask: bool | None = None,
              spec_check: bool | None = None, replicas: bool | None = None, preflight: bool | None = None,
              memory: bool | None = None) -> Trace:
        """Run ``code`` on every rank under the recorder and gather one Trace.

        The recorder starts on every rank, the cell runs (as ``run()``), the recorder stops, and the ranks'
        events are put on one time axis (their clock offsets are measured after the cell). The trace is kept even
        when the cell fails or times out (ranks that timed out contribute their events up to then, marked
        incomplete; a rank that died contributes none): ``last_trace()`` returns it, and the error is re-raised.
        The options are checked first, before anything else, even on a stopped cluster.

        Parameters
        ----------
        code : str
            Python source, run as a cell on every rank.
        timeout : float or None
            Seconds to wait for the cell at most; None: the cluster's ``timeout``.
        display : bool
            Print each rank's output in rank order.
        options : RecordingOptions or None
            The recording options to start from (None: the defaults); the keywords below that are given (not
            None) override it.
        max_events : int or None
            Events kept per rank (default 200000); beyond it events are only counted, as dropped.
        unmask : bool or None
            Re-raise a TypeError that PyTorch would report only as "unsupported operand type(s)" as
            ``UnmaskedOpError``, chained to the real one (on by default).
        spec_check : bool or None
            Flag a ShardTensor result whose spec disagrees with its local tensor (``get_spec_mismatches()``; on by
            default).
        replicas : bool or None
            Digest every tensor that claims Replicate after each op and name the first op where ranks diverge,
            with the largest difference (``get_replica_divergence()``; it costs a copy and a hash per tensor; off
            by default).
        preflight : bool or None
            Compare each collective inside a recorded op across its group before it is issued, so that a mismatch
            raises ``CollectiveMismatchError`` on every rank of the group instead of hanging (``get_preflight()``;
            off by default; it needs ``comm``, which ``options`` can turn off).
        memory : bool or None
            On GPU ranks, the CUDA allocator's delta over each op (``mem_delta_bytes`` of ``get_ops()``; two reads
            of the allocator's counter per op; off by default).

        Returns
        -------
        Trace
            Every rank's events; its meta holds the code, the wall time, the cluster's id, mesh and backend, the
            clock uncertainty, and why ranks are incomplete.

        Raises
        ------
        RecordingOptionsError
            ``options`` is not a RecordingOptions, an option is of the wrong type or out of range, or
            ``preflight`` is asked for without ``comm`` (a ``ClusterError``).
        ClusterError
            The cluster is not running; ``code`` is not a string; ``timeout`` is not a finite number of seconds
            above 0; the process group is broken; a rank still runs an earlier call that timed out, or a cell
            nothing waited for; or the controller died.
        RankError
            The cell raised on a rank (the trace is kept).
        RankTimeoutError
            A rank did not finish the cell in time (the trace is kept, that rank's events marked incomplete).
        RankDiedError
            A rank's process died (during the cell: the trace is kept with the other ranks' events).
        TraceInterrupted
            Ctrl-C ended the wait for the cell (a ``KeyboardInterrupt``): what was recorded until then is kept as
            a trace marked interrupted (``meta["interrupted"]``; ``last_trace()``, and the exception's
            ``trace``). Where the cell still runs, the recorder stops as soon as it ends there.

        Examples
        --------
        >>> t = cl.trace("y = torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3), padding=1)")
        >>> t.ranks
        [0, 1, 2, 3]
        >>> t = cl.trace("loss = net(x).square().mean(); loss.backward()", replicas=True, preflight=True)
        >>> t.checks
        {'spec_check': True, 'replicas': True, 'preflight': True}
        """
        __tracebackhide__ = hide_own_frames()
        options = RecordingOptions.build(options, max_events=max_events, unmask=unmask, spec_check=spec_check,
                                         replicas=replicas, preflight=preflight, memory=memory)
        self._require_running()
        _check_code(code)
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        self._execution.check_group()
        return self._tracer.trace(self._execution, self._control, code, options=options, timeout=timeout,
                                  display=display, cluster={"cluster_id": self.cluster_id,
                                                            "mesh": self.mesh.as_dict(), "backend": self.backend})

    # ------------------------------------------------------------------ verification
    def smoke(self, setup, step, configs=None, *, steps: int = 3, seed: int = 0, lr: float = 0.01,
              rtol: float = 1e-3, timeout: float | None = 300.0, blame: bool = False) -> SmokeResult:
        """The smoke matrix: a model trained in each configuration on these ranks, against a single device.

        The model of ``setup()`` is trained with ``step(model, ctx)`` (which returns the loss) in each
        configuration of ``configs`` on these ranks, and compared with the same model trained on a single device:
        each step's loss and the first step's gradients must agree within ``rtol`` (relative). ``setup`` and
        ``step`` travel to the ranks by value, with the globals they read. The mesh is rebuilt on the same engines
        for each configuration whose mesh differs (``remesh``) and restored at the end: tensors built on the
        cluster's mesh before must then be rebuilt. A configuration that does not behave as expected is a row of
        the result (not ``ok``), not an exception. See ``sharddbg.cluster.smoke``.

        Parameters
        ----------
        setup : callable
            ``setup()`` builds the model (an ``nn.Module``) on a rank.
        step : callable
            ``step(model, ctx)`` runs one step and returns the loss; it draws its data from torch's generator and
            hands it to the ranks with ``ctx.shard(t, dim)`` (split over the domain group) or ``ctx.replicate(t)``.
        configs : None, str or list
            None or ``"full"``: the whole matrix (single device; ddp=N; domain=N; ddp x domain with DDP and with
            FSDP2; FSDP2 with ddp=1; each with and without torch.compile; inference only; a batch of 2 per domain
            group; an invalid mesh, which must fail). ``"reduced"``: the matrix CI runs. Or a non-empty list of
            ``SmokeConfig`` or names of the matrix's configurations.
        steps : int
            SGD steps per configuration, 2 to 100.
        seed : int
            The seed the model and the data are drawn from (0 or more).
        lr : float
            The SGD learning rate (0 or more).
        rtol : float
            The relative tolerance of the losses and gradients (above 0).
        timeout : float or None
            Seconds each configuration may take; None: 300.
        blame : bool
            Run each configuration that was wrong again in plain processes with no sharddbg code loaded (as
            torchrun would: torch.distributed, physicsnemo, ``setup`` and ``step``) and say in its outcome whether
            it "fails without sharddbg too" (what it raised, or how far off it is) or "passes without sharddbg:
            sharddbg's doing" (``result.blames``).

        Returns
        -------
        SmokeResult
            ``ok`` (every configuration as expected), ``table`` (one row per configuration, indexed by its name:
            outcome, loss and gradient error, ms per step, fallbacks and collectives per step, the losses, ...),
            ``failed``, ``trace(name)`` (a configuration's recorded step), ``verdict``, ``show()`` and
            ``plot_losses()``.

        Raises
        ------
        SmokeError
            ``setup`` or ``step`` cannot be called as ``setup()`` / ``step(model, ctx)``; ``steps``, ``seed``,
            ``lr`` or ``rtol`` is out of range; ``configs`` is none of the above, names a configuration twice or
            one that does not exist, or holds a ``SmokeConfig`` that is malformed or whose mesh does not fit the
            cluster (unless it expects ``MeshError``); or the single-device reference run failed, so nothing can
            be compared (a ``ClusterError``).
        ClusterError
            The cluster is not running; the process group is broken; ``timeout`` is not a finite number of
            seconds above 0; or putting the cluster's own mesh back failed.

        Examples
        --------
        >>> def setup():
        ...     from torch import nn
        ...     return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 3, padding=1))
        >>> def step(model, ctx):
        ...     import torch
        ...     x = ctx.shard(torch.randn(1, 3, 34, 16), 2)
        ...     return model(x).pow(2).mean()
        >>> result = cl.smoke(setup, step, "reduced")
        >>> result.ok, result.failed
        (True, [])
        """
        __tracebackhide__ = hide_own_frames()
        from .smoke import run_smoke

        self._require_running()
        self._execution.check_group()
        return run_smoke(self._execution, self._group, setup, step, configs, steps=steps, seed=seed, lr=lr,
                         rtol=rtol, timeout=timeout, blame=blame)

    def check_replicas(self, model: str, *, mesh_dim: str = "domain", timeout: float | None = None) -> ReplicaCheck:
        """Are the parameters and buffers of a model the same on every rank of each ``mesh_dim`` group?

        Every rank digests each parameter and buffer of the nn.Module (no communication); the digests are compared
        within each group of ``mesh_dim``, and for those that differ the largest difference to the group's first
        rank is gathered on the ranks. Parameters sharded over ``mesh_dim`` are not replicas there and are listed
        as such. See ``sharddbg.cluster.replicas``.

        Parameters
        ----------
        model : str
            The nn.Module on the ranks: a variable or an expression of their namespace.
        mesh_dim : {"domain", "ddp"}
            The mesh dim whose groups must hold the same values.
        timeout : float or None
            Seconds each call on the ranks may take; None: the cluster's ``timeout``.

        Returns
        -------
        ReplicaCheck
            ``ok``, ``table`` (one row per parameter or buffer and group: ``name``, ``kind``, ``group_ranks``,
            ``state`` (same, differs, sharded or mismatch), ``ranks_differing``, ``reference_rank``,
            ``max_abs_diff``, ``shape``, ``dtype``, ``placements``, ``detail``), ``differing``, ``verdict`` (a line,
            also the repr) and ``show()``.

        Raises
        ------
        ClusterError
            The cluster is not running; the process group is broken; ``model`` is not a non-empty string;
            ``mesh_dim`` is not an axis of the mesh; ``timeout`` is not a finite number of seconds above 0; or the
            controller died.
        RankError
            The expression raised on a rank, or is not an nn.Module there.
        RankTimeoutError
            A rank did not answer in time.

        Examples
        --------
        >>> r = cl.check_replicas("net")
        >>> r.ok
        True
        >>> cl.check_replicas("net", mesh_dim="ddp").differing
        []
        """
        __tracebackhide__ = hide_own_frames()
        from .replicas import check_replicas

        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        self._require_running()
        self._execution.check_group()
        return check_replicas(self._execution, self.mesh, model, mesh_dim=mesh_dim, timeout=timeout)

    def check(self, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
              rtol: float | None = None, atol: float | None = None, grads: bool = True,
              timeout: float | None = None, display: bool = True, blame: bool = False) -> CheckResult:
        """Run ``stmt`` sharded on the ranks and unsharded in a separate process; compare outputs and gradients.

        Every output, input gradient and parameter gradient is compared per tensor and rank. The result is also
        what ``doctor()`` reads next (a gradient reduced more than once). See ``sharddbg.cluster.verify``.

        Parameters
        ----------
        stmt : str
            The statement (Python source; a whole forward and loss works too).
        inputs : str, list of str or None
            The names bound to their ``full_tensor()`` in the reference (``"x"``, ``"x, y"`` or a list); None: the
            tensors the statement reads.
        outputs : str, list of str or None
            The names compared after it; None: those it binds.
        model : str, list of str or None
            The modules copied with rank 0's weights whose parameter gradients are compared; None: the modules it
            reads.
        loss : str or None
            An expression of the loss; None: the sum of the mean squares of the outputs.
        rtol : float or None
            Relative tolerance (0 or more); None: by dtype.
        atol : float or None
            Absolute tolerance, relative to each tensor's scale (0 or more); None: by dtype.
        grads : bool
            Compare gradients too; False: outputs only.
        timeout : float or None
            Seconds each step may take (on the ranks and in the reference process); None: the cluster's
            ``timeout``.
        display : bool
            Show the statement's output as a cell's.
        blame : bool
            When the check fails, run the statement again in plain processes without any sharddbg code (as
            torchrun would) and say whether it fails there too (``result.blame``, and in the verdict).

        Returns
        -------
        CheckResult
            ``ok``, ``table`` (one row per tensor and rank), ``rows`` (the error per row along each tensor's
            sharded dim), ``failures()``, ``verdict`` (a line, also the repr), ``show()`` and ``plot_rows()``.

        Raises
        ------
        CheckError
            An argument is not as described (``stmt`` or ``loss`` not valid Python, a name not an identifier,
            ``outputs`` naming nothing, a negative tolerance, ``grads`` not a bool, a name both an input and a
            model); the ranks refused the request (names they do not have, ...); or the unsharded reference
            raised, failed, or did not finish within ``timeout``.
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; the process group is
            broken; a rank is dead; or the controller died.
        RankError
            The statement raised on a rank.
        RankTimeoutError
            A rank did not finish a step in time.
        RankDiedError
            A rank's process died meanwhile.

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net")
        >>> r.ok
        True
        >>> cl.check("y = net(x)", grads=False, rtol=1e-4).ok
        True
        """
        __tracebackhide__ = hide_own_frames()
        from .verify import run_check

        self._require_running()
        self._last_check = run_check(self._execution, stmt, inputs=inputs, outputs=outputs, model=model, loss=loss,
                                     rtol=rtol, atol=atol, grads=grads, timeout=timeout, display=display,
                                     blame=blame)
        return self._last_check

    # ------------------------------------------------------------------ handlers written in the notebook
    def patch(self, op, handler, *, kind: str = "function", timeout: float | None = None) -> PatchRecord:
        """Register ``handler`` for ``op`` with ShardTensor on every rank (by value, with its globals).

        Every rank resolves the op, loads the handler and checks its signature first; only when all accepted
        does each register it (``ShardTensor.register_function_handler`` or ``register_dispatch_handler``),
        keeping what the registries held, so that ``unpatch`` puts them back exactly. The handler's source travels
        with it: a traceback through it on a rank shows its own lines. See ``sharddbg.cluster.patching``.

        Parameters
        ----------
        op : str or callable
            The op: its name as ``get_fallbacks()`` prints it (``"torch.diff"``, ``"torch.nn.functional.silu"``,
            ``"Tensor.add"``, ``"aten.diff.default"``, ``"mylib.op.default"``), a dotted name in the ranks'
            namespace (``"F.silu"``), or the function or op overload itself where this process has torch.
        handler : callable
            ``handler(func, types, args, kwargs)`` for ``kind="function"``; ``handler(*args, **kwargs)`` (the
            op's own arguments) for ``kind="dispatch"``. Names it reads that the notebook does not define
            (``torch``, ``ShardTensor``) are the ranks' own.
        kind : {"function", "dispatch"}
            Which registry: ``__torch_function__``'s (torch functions and op overloads) or
            ``__torch_dispatch__``'s (aten op overloads, reached by the autograd engine and compile).
        timeout : float or None
            Seconds to wait; None: the cluster's ``timeout``.

        Returns
        -------
        PatchRecord
            ``op`` (as sharddbg names it), ``kind``, ``handler`` (its name), ``replaces`` (the handler the
            registry held before, None when the op fell back).

        Raises
        ------
        PatchError
            The handler does not pickle, is not callable or has the wrong signature; ``kind`` is unknown; or the
            ranks refused (``op`` names no torch function or op overload there, the handler does not load there):
            one sentence, and nothing was registered on any rank.
        ClusterError
            The cluster is not running, or ``timeout`` is not a finite number of seconds above 0.

        Examples
        --------
        >>> def silu_handler(func, types, args, kwargs):
        ...     x = args[0]
        ...     return ShardTensor.from_local(func(x.to_local()), x._spec.mesh, x._spec.placements,
        ...                                   sharding_shapes=x._spec._sharding_shapes)
        >>> cl.patch("torch.nn.functional.silu", silu_handler)
        PatchRecord(op='torch.nn.functional.silu', kind='function', handler='__main__.silu_handler', replaces=None)
        """
        __tracebackhide__ = hide_own_frames()
        from .patching import patch

        self._require_running()
        return patch(self._execution, op, handler, kind=kind, timeout=timeout)

    def unpatch(self, op, *, timeout: float | None = None) -> PatchRecord:
        """Take back the handler ``patch`` registered for ``op`` on every rank: ShardTensor's registries exactly as
        they were before it (the earlier handler object, or no entry).

        Parameters
        ----------
        op : str or callable
            As for ``patch`` (the name it answered works).
        timeout : float or None
            Seconds to wait; None: the cluster's ``timeout``.

        Returns
        -------
        PatchRecord
            The handler taken back (``replaces`` is None).

        Raises
        ------
        PatchError
            No handler was registered by ``patch`` for ``op``.
        ClusterError
            The cluster is not running, or ``timeout`` is not a finite number of seconds above 0.

        Examples
        --------
        >>> cl.unpatch("torch.nn.functional.silu").op
        'torch.nn.functional.silu'
        """
        __tracebackhide__ = hide_own_frames()
        from .patching import unpatch

        self._require_running()
        return unpatch(self._execution, op, timeout=timeout)

    def check_patch(self, op, stmt: str, handler=None, *, kind: str = "function", inputs=None, outputs=None,
                    model=None, loss: str | None = None, rtol: float | None = None, atol: float | None = None,
                    grads: bool = True, repeat: int = 3, keep: bool = False, before: bool = True,
                    timeout: float | None = None) -> PatchCheck:
        """Run ``stmt`` without and with a handler for ``op``, and compare: correct? faster? what moved?

        Each side is traced (the op's dispatch path, its host time per call, the collectives issued inside its
        calls, ``stmt`` run ``repeat`` times) and checked against one device (``check``: outputs and gradients).
        With ``handler`` it is registered for the second side and taken back after (unless ``keep``); without,
        the handler ``patch`` registered is taken out for the first side and put back. Whatever happens, the
        ranks are left as they were. See ``sharddbg.cluster.patching``.

        Parameters
        ----------
        op : str or callable
            As for ``patch``.
        stmt : str
            The statement that calls the op (Python source, run on every rank).
        handler : callable or None
            The handler to check; None: the one registered by ``patch``.
        kind : {"function", "dispatch"}
            As for ``patch``.
        inputs : str, list of str or None
            As for ``check``.
        outputs : str, list of str or None
            As for ``check``.
        model : str, list of str or None
            As for ``check``.
        loss : str or None
            As for ``check``.
        rtol : float or None
            As for ``check``.
        atol : float or None
            As for ``check``.
        grads : bool
            As for ``check``.
        repeat : int
            Times ``stmt`` runs in each side's trace (the first call on each rank is left out of the time when
            there are more).
        keep : bool
            Leave ``handler`` registered afterwards (as ``patch`` would).
        before : bool
            Also run the fallback side (False: the handler's side only, ``before`` is None; half the time).
        timeout : float or None
            Seconds each step may take; None: the cluster's ``timeout``.

        Returns
        -------
        PatchCheck
            ``verdict`` (a sentence, also the repr: "patched: correct, 1.8x faster, 1 all_gather_into_tensor
            (480 B) replaced by 1 all_to_all_single (24 B) per call and rank"), ``ok``, ``before`` / ``after``
            (path, time, collectives, check), ``table``, ``traces``, ``show()``.

        Raises
        ------
        PatchError
            The arguments are not as described; the handler does not pickle or has the wrong signature; the ranks
            refused it; or it raised on some ranks while the statement ran (one sentence with the handler's own
            line, then the traceback; the handler was taken back).
        CheckError
            The numerical check could not run (see ``check``).
        ClusterError
            The cluster is not running, or ``timeout`` is not a finite number of seconds above 0.

        Examples
        --------
        >>> r = cl.check_patch("torch.diff", "y = torch.diff(x, dim=2)", diff_handler, inputs="x", outputs="y")
        >>> r.verdict  # doctest: +ELLIPSIS
        'patched: correct, ...x faster, 1 all_gather_into_tensor (480 B) replaced by 1 all_to_all_single (24 B) ...'
        """
        __tracebackhide__ = hide_own_frames()
        from .patching import check_patch

        self._require_running()
        return check_patch(self, self._execution, op, stmt, handler, kind=kind, inputs=inputs, outputs=outputs,
                           model=model, loss=loss, rtol=rtol, atol=atol, grads=grads, repeat=repeat, keep=keep,
                           before=before, timeout=timeout)

    def diff(self, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
             rtol: float | None = None, atol: float | None = None, grads: bool = True, ops=None,
             max_memory: float = 2 * 1024 ** 3, blame: bool = False, timeout: float | None = None,
             display: bool = True) -> DiffResult:
        """Which op broke it: ``stmt`` sharded on the ranks and unsharded in one process, compared op by op.

        Runs as ``check()`` does (same inputs, weights, RNG state, TF32 off, the same reference process) and
        keeps every op the user's code calls on both sides, matched by call site, op and occurrence. Each
        rank compares its pieces with its slice of the reference's; the answer names the first op whose
        output (or, in the backward, the gradient reaching it or a parameter's gradient) departs. See
        ``sharddbg.engine.diff``.

        Parameters
        ----------
        stmt : str
            The statement (Python source).
        inputs : str, list of str or None
            As for ``check()``: the names bound to their ``full_tensor()`` in the reference.
        outputs : str, list of str or None
            As for ``check()``: the names compared after it (their ops are compared whatever this says).
        model : str, list of str or None
            As for ``check()``: the modules copied with the group's first rank's weights.
        loss : str or None
            As for ``check()``: the loss the backward starts from.
        rtol : float or None
            Relative tolerance per op output (0 or more); None: by dtype.
        atol : float or None
            Absolute tolerance (0 or more); None: ``rtol`` times each reference output's largest magnitude.
        grads : bool
            Compare the backward too (the gradient reaching each op, the parameters' gradients).
        timeout : float or None
            Seconds each step may take; None: the cluster's ``timeout``.
        display : bool
            Show the statement's output as a cell's.
        ops : str, list of str, callable or None
            The ops to compare: names (``"conv2d"`` or ``"torch.conv2d"``), or a function of the op's name
            returning True for those to compare; None: every op.
        max_memory : float
            Bytes the diff may keep on a rank and in the reference (outputs and their gradients); above it
            the diff is refused, saying what it needs, before the reference runs. Default 2 GiB.
        blame : bool
            When an op departs (or the check fails), re-run the statement in plain processes without any
            sharddbg code and say whether it departs there too (``result.blame``).

        Returns
        -------
        DiffResult
            ``answer`` (also the repr), ``first``, ``ok``, ``get_ops()``, ``get_ranks()``, ``get_skipped()``,
            ``check`` (the ``CheckResult`` of the same run), ``blame`` and ``show()``.

        Raises
        ------
        DiffError
            Bad arguments (as for ``check()``; ``ops`` naming nothing or of the wrong type, ``max_memory`` not
            above 0), ``ops`` matching no op the statement called, or more memory than ``max_memory``.
        CheckError
            The ranks refused the request, or the unsharded reference raised, failed or timed out.
        ClusterError
            The cluster is not running, the process group is broken, a rank is dead.
        RankError
            The statement raised on a rank.

        Examples
        --------
        >>> r = cl.diff("with sharddbg.engine.without_patches(F.conv2d):\\n    y = net(x)")
        >>> r.first.op, r.first.rows
        ('torch.conv2d', '16-18, 33-35, 49-51')
        >>> cl.diff("y = net(x)").ok
        True
        """
        __tracebackhide__ = hide_own_frames()
        from .verify import run_diff

        self._require_running()
        return run_diff(self._execution, stmt, inputs=inputs, outputs=outputs, model=model, loss=loss, rtol=rtol,
                        atol=atol, grads=grads, ops=ops, max_memory=max_memory, blame=blame, timeout=timeout,
                        display=display)

    def doctor(self, *names: str, check=None, trace=None, timeout: float | None = None) -> DoctorReport:
        """The pitfall doctor: one row per known ShardTensor pitfall (ok / warn / fail / skip, what was found, the fix).

        From what the ranks hold, the last ``check()`` (whether gradients were reduced more than once) and the last
        trace (stale entries in DTensor's redistribution plan cache). See ``sharddbg.cluster.doctor``.

        Parameters
        ----------
        *names : str
            The variables of the ranks to examine; none: every one.
        check : CheckResult or None
            The numerical check to read; None: this cluster's last ``check()``.
        trace : Trace or None
            The trace to read; None: this cluster's last ``trace()``.
        timeout : float or None
            Seconds the ranks may take to answer; None: the cluster's ``timeout``.

        Returns
        -------
        DoctorReport
            ``ok`` (no check failed), ``table`` (one row per check: ``check``, ``status``, ``found``, ``fix``,
            ``ranks``), ``failures()``, ``finding(check)``, ``status(check)``, ``verdict`` (a line, also the repr)
            and ``show()``.

        Raises
        ------
        DoctorError
            A name is not an identifier or is missing on some ranks; ``check`` is not a CheckResult; ``trace`` is
            not a Trace.
        ClusterError
            The cluster is not running; ``timeout`` is not a finite number of seconds above 0; a rank is dead or
            still runs an earlier call; or the controller died.
        RankError
            A rank raised while answering.
        RankTimeoutError
            A rank did not answer in time.

        Examples
        --------
        >>> report = cl.doctor("net", "x")
        >>> report.ok
        True
        >>> report.status("weights synced over the domain axis")
        'ok'
        """
        __tracebackhide__ = hide_own_frames()
        from .doctor import run_doctor

        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        self._require_running()
        return run_doctor(self._execution, list(names), check=self._last_check if check is None else check,
                          trace=self._tracer.last if trace is None else trace, timeout=timeout)

    def last_trace(self, required: bool = True) -> Trace | None:
        """The Trace of the last ``trace()`` / ``%%shard_trace`` on this cluster.

        A trace whose cell failed or timed out is kept too; it stays after ``stop()``.

        Parameters
        ----------
        required : bool
            Raise when nothing was traced yet; False: return None instead.

        Returns
        -------
        Trace or None
            The last trace; None when nothing was traced yet and ``required`` is False.

        Raises
        ------
        ShardDbgError
            Nothing was traced on this cluster yet, and ``required``.

        Examples
        --------
        >>> t = cl.last_trace()
        >>> sharddbg.Cluster(n=2).last_trace(required=False) is None
        True
        """
        if self._tracer.last is None and required:
            raise ShardDbgError("nothing was traced on this cluster yet; run a cell with %%shard_trace or cl.trace(code)")
        return self._tracer.last


# Where a rank's error starts its advice for a process group that broke on a running cluster (recover(),
# restart()): after a failed start or restart the cluster is stopped, so that advice cannot be followed.
_RUNNING_CLUSTER_ADVICE = ("The process group is broken now.", "The kernel is free and the engines are kept.",
                           "The process group broke at")


def _advise_start_again(exc: BaseException, step: str) -> None:
    """Replace the running-cluster advice in ``exc``'s message (a failed ``step``, after which everything was
    shut down) with what can be done: start the cluster again."""
    if not isinstance(exc, ShardDbgError) or not exc.args or not isinstance(exc.args[0], str):
        return
    message = exc.args[0]
    cut = min((at for at in map(message.find, _RUNNING_CLUSTER_ADVICE) if at >= 0), default=-1)
    if cut < 0:
        return
    exc.args = (message[:cut].rstrip() + f"\n\nThe cluster's {step} failed and everything it had started was shut "
                "down: there is no process group to recover(). Fix the cause above and start() the cluster again "
                "(%shard_cluster start).",) + exc.args[1:]


def _check_code(code) -> None:
    if not isinstance(code, str):
        raise ClusterError(f"code must be a string of Python source, got {type(code).__name__}")
