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

from .. import rendering
from ..engine import api
from ..errors import ClusterError, NoActiveClusterError, ShardDbgError, hide_own_frames
from ..options import RecordingOptions
from . import arguments, hang, registry
from .arguments import check_memory
from .control import ControlChannel
from .execution import PendingCell, RankExecution, RankOutput, engines_in_rank_order, filter_noise
from .group import DistributedGroup
from .mesh import MeshSpec, resolve_mesh
from .processes import ClusterProcesses, choose_backend
from .recording import CellTracer
from .versions import TESTED_VERSIONS, check_versions

__all__ = ["Cluster", "RankOutput", "active_cluster", "running_clusters", "filter_noise", "TESTED_VERSIONS"]

# Running clusters in start order (strong references: a cluster started by the magic has no other owner);
# the active one is the last that still runs. stop() removes a cluster.
_STARTED: "list[Cluster]" = []

STATUS_COLUMNS = ["rank", "pid", "host", "device", "backend", "ddp", "domain", "patch_mode", "n_patches",
                  "torch", "physicsnemo", "python", "state", "process_group", "engine_id", "dist_initialized",
                  "patch_reason", "collective_timeout_s", "threads"]


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
    """A local cluster of ``n`` ranks, one ipyparallel engine each, mesh ``ddp x domain``.

    >>> with Cluster(n=4, mesh={"ddp": 1, "domain": 4}) as cl:   # doctest: +SKIP
    ...     cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)")
    """

    def __init__(self, n: int | None = None, mesh=None, *, backend: str | None = None, timeout: float = 60.0,
                 start_timeout: float = 180.0, collective_timeout: float = 60.0, threads_per_rank: int = 1,
                 env: dict | None = None, force: bool = False):
        mesh_spec = resolve_mesh(n, mesh)
        self.n = mesh_spec.size
        if backend not in (None, "gloo", "nccl"):
            raise ClusterError(f"backend must be 'gloo', 'nccl' or None (auto), got {backend!r}")
        self.requested_backend = backend
        self.timeout = arguments.seconds("timeout", timeout)
        self.start_timeout = arguments.seconds("start_timeout", start_timeout)
        collective_timeout = arguments.seconds("collective_timeout", collective_timeout)
        self.threads_per_rank = arguments.positive_int("threads_per_rank", threads_per_rank)
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            raise ClusterError(f"env must map variable names to string values, got {env!r}")
        self.extra_env = dict(env or {})
        if not force:
            check_memory(self.n)
        self.timings: dict[str, float] = {}
        self.running = False
        self._group = DistributedGroup(mesh_spec, collective_timeout)
        self._processes: ClusterProcesses | None = None
        self._execution: RankExecution | None = None
        self._control: ControlChannel | None = None
        self._tracer = CellTracer()
        self._last_check = None  # the CheckResult of the last check() (the doctor reads it)

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
        """None while the controller runs; else how it died ("the controller (pid N) died: killed by ...")."""
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

    def processes(self) -> list:
        """Every process of this cluster that still runs (``psutil.Process``): fork server, controller and
        its children, engines."""
        return self._processes.live() if self._processes else []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.running:
            self.stop()

    def start(self) -> "Cluster":
        """Start controller and engines, initialise torch.distributed and the mesh. Makes this the active cluster."""
        __tracebackhide__ = hide_own_frames()
        if self.running:
            raise ClusterError(f"this cluster is already running ({self.n} ranks); stop() it first, or restart()")
        registry.reap_orphans()
        t0 = time.perf_counter()
        self._processes = ClusterProcesses(threads_per_rank=self.threads_per_rank,
                                           requested_backend=self.requested_backend, extra_env=self.extra_env,
                                           timings=self.timings)
        try:
            facts = self._processes.start(self.start_timeout)
            self._launch_engines(choose_backend(self.requested_backend, int(facts.get("cuda_count", 0)), self.n))
            self.running = True
            _STARTED[:] = [c for c in _STARTED if c is not self and c.running] + [self]
        except BaseException:
            self._shut_down()
            raise
        self.timings["start_s"] = time.perf_counter() - t0
        check_versions(self._group.statuses)
        return self

    def _launch_engines(self, backend: str) -> None:
        """Engines up and mapped to ranks, then torch.distributed on them with ``backend``."""
        t0 = time.perf_counter()
        client = self._processes.launch_engines(self.n, self.start_timeout)
        engine_ids = engines_in_rank_order(client, self.n, self.timeout)
        self._control = ControlChannel(client, engine_ids)
        self._execution = RankExecution(client, engine_ids, self._processes, self._control, self.timeout)
        self.timings["engines_s"] = time.perf_counter() - t0
        self.timings["dist_init_s"] = self._group.bring_up(self._execution, backend, self.start_timeout)

    def _close_client(self) -> None:
        if self._execution is not None:
            self._execution.close()
        self._execution = self._control = None

    def _shut_down(self) -> None:
        self._close_client()
        if self._processes is not None:
            self._processes.shut_down()
        self.running = False

    def stop(self) -> None:
        """Stop engines and controller; check that none of their processes is left."""
        __tracebackhide__ = hide_own_frames()
        if not self.running and (self._processes is None or self._processes.fork_server is None):
            raise ClusterError("this cluster is not running (it was never started, or was stopped already)")
        t0 = time.perf_counter()
        self._close_client()
        self._processes.stop()
        self.running = False
        _STARTED[:] = [c for c in _STARTED if c is not self]
        self.timings["stop_s"] = time.perf_counter() - t0

    def restart(self) -> "Cluster":
        """Replace every engine with a fresh one (new processes, new process group). Same mesh and settings.

        The fork server (torch and physicsnemo already imported) is kept, so this is quicker than a start.
        """
        __tracebackhide__ = hide_own_frames()
        if not self.running or not self._processes.fork_server_alive():
            if self.running or (self._processes is not None and self._processes.fork_server is not None):
                self.stop()
            return self.start()
        t0 = time.perf_counter()
        try:
            self._close_client()
            self._processes.replace_engines()
            self._launch_engines(self.backend)
        except BaseException:
            self.stop()
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        return self

    def recover(self, timeout: float | None = None) -> None:
        """After a hang or a broken process group: release ranks blocked in a collective and re-create the
        process group.

        The engines (and their pids) are kept. Every rank ends the collectives it waits in, from its control
        thread (its connections to the other ranks shut: a gloo collective fails at once; its NCCL
        communicators aborted); then every rank tears the old group down and joins a new one on a fresh
        port. Tensors built on the old mesh must be rebuilt. A dead rank cannot be recovered: restart().
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        timeout = arguments.seconds("timeout", timeout, allow_none=True) or self.timeout
        self._rebuild_group(self.mesh, timeout)

    def remesh(self, mesh, *, timeout: float | None = None) -> None:
        """Rebuild torch.distributed on the same engines with another ``ddp x domain`` mesh of the same
        ranks (``{"ddp": 2, "domain": 2}``, ``"ddp=2,domain=2"``, ``(2, 2)``; one axis may be left out).

        A mesh that does not fit the cluster's size is refused (``MeshError``) before anything changes. As
        with ``recover()``: ranks blocked in a collective are released, every rank tears its process group
        down and joins a new one with the new mesh (the ``mesh`` of a %px cell is the new one); tensors
        built on the old mesh must be rebuilt."""
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        spec = resolve_mesh(self.n, mesh)
        timeout = arguments.seconds("timeout", timeout, allow_none=True) or self.timeout
        self._rebuild_group(spec, timeout)

    def _rebuild_group(self, spec: MeshSpec, timeout: float) -> None:
        """Release blocked ranks, tear the process group down on every rank, bring it up with mesh ``spec``."""
        self.timings["dist_init_s"] = self._group.rebuild(self._execution, spec, timeout)

    # ------------------------------------------------------------------ running code
    def _require_running(self) -> None:
        if not self.running:
            raise ClusterError("this cluster is not running; start() it first")

    def busy_ranks(self) -> list[int]:
        """Ranks whose engine is still running (or queued) work."""
        return self._execution.busy_ranks()

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has exited, with how (as seen by the fork server, which reaps them)."""
        return self._processes.dead_ranks() if self._processes else {}

    def run(self, code: str, *, timeout: float | None = None, targets=None, display: bool = True) -> list[RankOutput]:
        """Execute ``code`` on every rank (or ``targets``), wait at most ``timeout`` seconds.

        Prints each rank's output in rank order when ``display``. Raises :class:`RankError` if a rank
        raised, :class:`RankTimeoutError` (with a hang report) if a rank did not finish in time.
        """
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        _check_code(code)
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.run(code, self._execution.ranks(targets), timeout, display)

    def submit(self, code: str, *, timeout: float | None = None, targets=None) -> PendingCell:
        """Send ``code`` to every rank (or ``targets``) and return at once, without waiting: the cell's
        :class:`~sharddbg.cluster.execution.PendingCell` (``%px --noblock``). Its time limit is ``timeout``
        (default: the cluster's), counted from now; ``wait(seconds)`` and ``get()`` stay within it, and
        ``get()`` prints each rank's output and raises what ``run()`` raises. New work for its ranks is refused
        while it runs (it would queue behind it)."""
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        _check_code(code)
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.submit(code, self._execution.ranks(targets), timeout)

    def apply(self, fn, *args, timeout: float | None = None, targets=None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank (or ``targets``); results in rank order.

        ``fn`` is normally a function of ``sharddbg.engine.api`` (what a rank answers)."""
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        if not callable(fn):
            raise ClusterError(f"apply() takes a function, got {type(fn).__name__} {fn!r}")
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        return self._execution.apply(fn, args, kwargs, self._execution.ranks(targets), timeout)

    def pull(self, name: str, *, timeout: float | None = None, targets=None) -> list:
        """The value of variable ``name`` on every rank (or ``targets``), in rank order."""
        __tracebackhide__ = hide_own_frames()
        if not isinstance(name, str) or not name.isidentifier():
            raise ClusterError(f"pull() takes a variable name, got {name!r}")
        return self.apply(api.user_value, name, timeout=timeout, targets=targets)

    def eval(self, expression: str, *, timeout: float | None = None, targets=None) -> list:
        """Evaluate a Python expression in every rank's namespace; values in rank order."""
        __tracebackhide__ = hide_own_frames()
        if not isinstance(expression, str):
            raise ClusterError(f"eval() takes an expression as a string, got {type(expression).__name__}")
        return self.apply(api.user_eval, expression, timeout=timeout, targets=targets)

    # ------------------------------------------------------------------ inspection
    def diagnose(self, ranks=None, timeout: float = 5.0) -> dict[int, dict | None]:
        """Each rank's stack and Flight Recorder, answered by its control thread even while it is blocked."""
        __tracebackhide__ = hide_own_frames()
        self._require_running()
        timeout = arguments.seconds("timeout", timeout)
        return self._control.diagnose(self._execution.ranks(ranks), timeout)

    def hang_report(self, timeout, finished, unfinished, what="the cell", *,
                    diagnose_timeout: float = 5.0, failures=None) -> hang.HangReport:
        """Where the ``unfinished`` ranks wait, after ``timeout`` seconds of ``what`` (each rank's diagnosis,
        answered within ``diagnose_timeout``, is in the report's ``diagnoses``); ``failures``: the ranks
        that raised meanwhile (rank -> RankFailure), which the report leads with.

        Works from the moment the engines are connected, so a start-up that times out is diagnosed too."""
        if self._execution is None:
            raise ClusterError("this cluster is not running; start() it first")
        return self._execution.hang_report(timeout, finished, unfinished, what, diagnose_timeout=diagnose_timeout,
                                           failures=failures)

    def clock_offsets(self, samples: int = 15, timeout: float = 5.0) -> dict[int, dict]:
        """How far each rank's recorder clock is ahead of this process's ``time.monotonic_ns()``.

        NTP-style: for each rank, ``samples`` round trips on the control channel; the one with the
        shortest round trip wins, offset = engine time - midpoint, uncertainty = half its round trip.
        """
        self._require_running()
        return self._control.clock_offsets(samples, timeout)

    def status(self, full: bool = False):
        """One row per rank (index ``rank``): pid, device, backend, mesh coordinate (``ddp``, ``domain``),
        patch mode, ``state`` idle / busy / dead (and how it died), ``process_group`` ok or why it broke.
        ``full=True``: every column (host, versions, patch count and reason, engine id, threads, ...)."""
        __tracebackhide__ = hide_own_frames()
        import pandas as pd

        self._require_running()
        self._execution.check_controller()
        dead = self.dead_ranks()
        busy = self.busy_ranks()
        idle = [r for r in range(self.n) if r not in busy and r not in dead]
        fresh = dict(zip(idle, self._execution.call(api.status, ranks=idle, what="status()"))) if idle else {}
        broken = self._execution.broken
        rows = []
        for rank in range(self.n):
            statuses = self._group.statuses
            known = statuses[rank] if rank < len(statuses) else {"rank": rank}
            row = dict(fresh.get(rank) or known)
            row["engine_id"] = self.engine_ids[rank]
            row["state"] = f"dead: {dead[rank]}" if rank in dead else "busy" if rank in busy else "idle"
            row["process_group"] = "ok" if broken is None else f"broken at {broken.cause}"
            rows.append(row)
        frame = pd.DataFrame(rows)
        # eight columns by default: the table fits a notebook or terminal without wrapping
        shown = STATUS_COLUMNS if full else ("rank", "pid", "device", "backend", "ddp", "domain", "patch_mode",
                                             "state", "process_group")
        return frame[[c for c in shown if c in frame.columns]].set_index("rank")

    @property
    def broken(self) -> str | None:
        """Why the process group cannot be used (a failed or released collective, a hang, a dead rank), or
        None while it works; cells are refused until ``recover()``."""
        return self._execution.broken.cause if self._execution is not None and self._execution.broken else None

    def inspect(self, name: str, *, timeout: float | None = None):
        """The shard inspector for the ShardTensor named ``name`` on the ranks (see sharddbg.cluster.inspect)."""
        __tracebackhide__ = hide_own_frames()
        from .inspect import gather_layout

        self._require_running()
        return rendering.inspector(gather_layout(self._execution, self.mesh, name, timeout=timeout))

    # ------------------------------------------------------------------ recording
    def trace(self, code: str, *, timeout: float | None = None, display: bool = True,
              options: RecordingOptions | None = None, max_events: int | None = None, unmask: bool | None = None,
              spec_check: bool | None = None, replicas: bool | None = None, preflight: bool | None = None,
              memory: bool | None = None):
        """Run ``code`` on every rank under the recorder and gather one :class:`sharddbg.trace.Trace`.

        The trace is kept even when the cell fails or times out (ranks that timed out contribute their
        events up to then, marked incomplete): ``last_trace()`` returns it, and the error is re-raised.
        Verification while recording: ``spec_check`` flags a ShardTensor result whose spec disagrees with its
        local tensor (``get_spec_mismatches()``); ``replicas`` digests every tensor that claims Replicate after
        each op and names the first op where ranks diverge, with the largest difference
        (``get_replica_divergence()``; it costs a copy and a hash per tensor); ``preflight`` compares each
        collective inside a recorded op across its group before it is issued, so that a mismatch raises
        ``CollectiveMismatchError`` on every rank of the group instead of hanging (``get_preflight()``).
        ``memory``: on GPU ranks, the CUDA allocator's delta over each op (``mem_delta_bytes`` of
        ``get_ops()``); off by default (two reads of the allocator's counter per op). ``options``: a
        ``RecordingOptions`` to start from (the keywords given override it).
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
              rtol: float = 1e-3, timeout: float | None = 300.0):
        """The smoke matrix: the model of ``setup()`` trained with ``step(model, ctx)`` (which returns the
        loss) in each configuration of ``configs`` on these ranks, against the same model trained on a
        single device; a :class:`~sharddbg.cluster.smoke.SmokeResult` (``ok``, ``table``, ``show()``).
        ``setup`` and ``step`` travel to the ranks by value, with the globals they read.

        ``configs``: None (the whole matrix: single device; ddp=N; domain=N; ddp x domain with DDP and with
        FSDP2; FSDP2 with ddp=1; each with and without torch.compile; inference only; an invalid mesh and a
        per-domain batch of 2, which must fail), ``"reduced"``, or a list of ``SmokeConfig`` or names.
        ``steps`` SGD steps (``lr``) per configuration from ``seed``; losses and first-step gradients must
        agree within ``rtol`` (relative); ``timeout`` per configuration. The mesh is rebuilt on the same
        engines for each configuration whose mesh differs (``remesh``) and restored at the end: tensors
        built on the cluster's mesh before must then be rebuilt. See ``sharddbg.cluster.smoke``."""
        __tracebackhide__ = hide_own_frames()
        from .smoke import run_smoke

        self._require_running()
        self._execution.check_group()
        return run_smoke(self._execution, self._group, setup, step, configs, steps=steps, seed=seed, lr=lr,
                         rtol=rtol, timeout=timeout)

    def check_replicas(self, model: str, *, mesh_dim: str = "domain", timeout: float | None = None):
        """Are the parameters and buffers of the nn.Module named ``model`` on the ranks (a variable or an
        expression of their namespace) the same on every rank of each ``mesh_dim`` group? Digests on every rank,
        then, for those that differ, the largest difference to the group's first rank, gathered on the ranks;
        a :class:`~sharddbg.cluster.replicas.ReplicaCheck` (``ok``, ``table``, ``show()``, a verdict line).
        Parameters sharded over ``mesh_dim`` are not replicas there and are listed as such. See
        ``sharddbg.cluster.replicas``."""
        __tracebackhide__ = hide_own_frames()
        from .replicas import check_replicas

        self._require_running()
        self._execution.check_group()
        return check_replicas(self._execution, self.mesh, model, mesh_dim=mesh_dim, timeout=timeout)

    def check(self, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
              rtol: float | None = None, atol: float | None = None, grads: bool = True,
              timeout: float | None = None, display: bool = True):
        """Run ``stmt`` on the ranks (sharded), then the same statement unsharded in a separate process, and
        compare every output, input gradient and parameter gradient per tensor and rank: a
        :class:`~sharddbg.cluster.verify.CheckResult` (``ok``, ``table``, ``rows``, ``show()``, a verdict line).

        ``inputs``: the names bound to their ``full_tensor()`` in the reference (default: the tensors the
        statement reads); ``outputs``: the names compared after it (default: those it binds); ``model``: the
        modules copied with rank 0's weights whose parameter gradients are compared (default: the modules it
        reads); ``loss``: an expression (default: the sum of the mean squares of the outputs); ``rtol`` /
        ``atol``: tolerances (default by dtype; atol relative to each tensor's scale); ``grads=False``: outputs
        only. See ``sharddbg.cluster.verify``."""
        __tracebackhide__ = hide_own_frames()
        from .verify import run_check

        self._require_running()
        self._last_check = run_check(self._execution, stmt, inputs=inputs, outputs=outputs, model=model, loss=loss,
                                     rtol=rtol, atol=atol, grads=grads, timeout=timeout, display=display)
        return self._last_check

    def doctor(self, *names: str, check=None, trace=None, timeout: float | None = None):
        """The pitfall doctor: one row per known ShardTensor pitfall (ok / warn / fail / skip, what was found,
        the fix), from what the ranks hold (``names``: the variables to examine; default every one), the last
        :meth:`check` (or ``check``, a CheckResult: whether gradients were reduced more than once) and the last
        trace (or ``trace``, a Trace: stale entries in DTensor's redistribution plan cache). A
        :class:`~sharddbg.cluster.doctor.DoctorReport` (``ok``, ``table``, ``show()``, a verdict line). See
        ``sharddbg.cluster.doctor``."""
        __tracebackhide__ = hide_own_frames()
        from .doctor import run_doctor

        self._require_running()
        return run_doctor(self._execution, list(names), check=self._last_check if check is None else check,
                          trace=self._tracer.last if trace is None else trace, timeout=timeout)

    def last_trace(self, required: bool = True):
        """The Trace of the last ``trace()`` / ``%%shard_trace`` on this cluster; with ``required=False``,
        None when nothing was traced yet (instead of an error)."""
        if self._tracer.last is None and required:
            raise ShardDbgError("nothing was traced on this cluster yet; run a cell with %%shard_trace or cl.trace(code)")
        return self._tracer.last


def _check_code(code) -> None:
    if not isinstance(code, str):
        raise ClusterError(f"code must be a string of Python source, got {type(code).__name__}")
