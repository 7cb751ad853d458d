"""``Cluster``: N local ranks of the real PhysicsNeMo ShardTensor stack, driven from one Python process.

Start-up: a fork server imports torch + physicsnemo once (overlapping with the ipyparallel controller's
start) and forks one engine per rank; each engine then joins torch.distributed on a fresh loopback port
with a short collective timeout, builds the ("ddp", "domain") mesh and fills physicsnemo's
DistributedManager. Every wait on engines is bounded; a timeout names the stuck ranks and where they wait.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field

from ..errors import ClusterError, RankError, RankTimeoutError, ShardDbgWarning
from . import hang, registry
from .launcher import ForkServer
from .mesh import MeshSpec, resolve_mesh

# Versions sharddbg was tested with; anything else gets one clear warning and still runs.
TESTED_VERSIONS = {"torch": ("2.14.1", "2.11"), "physicsnemo": ("2.2.2",)}
_WARNED_VERSIONS: set = set()

# Lines engines print that say nothing about the user's program.
_NOISE = [
    re.compile(r"Warp CUDA warning: Could not find or load the NVIDIA CUDA driver"),
    re.compile(r"FutureWarning: .*all_gather_tensor"),
    re.compile(r"^\s*warnings\.warn\($"),
    re.compile(r"^\s*(return )?funcol\.all_gather_tensor"),
]

# Running clusters in start order (strong references: a cluster started by the magic has no other owner);
# the active one is the last that still runs. stop() removes a cluster.
_STARTED: "list[Cluster]" = []


def active_cluster(required: bool = True) -> "Cluster | None":
    """The cluster started last (by ``Cluster.start`` or ``%shard_cluster start``) and still running."""
    from ..errors import NoActiveClusterError

    for cluster in reversed(_STARTED):
        if cluster.running:
            return cluster
    if required:
        raise NoActiveClusterError(
            "no sharddbg cluster is running; start one with %shard_cluster start -n 4 "
            "or sharddbg.Cluster(n=4).start()"
        )
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def filter_noise(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not any(p.search(line) for p in _NOISE))


def _version_ok(package: str, version: str) -> bool:
    return any(version == v or version.startswith(v + ".") or version.startswith(v + "+") for v in TESTED_VERSIONS[package])


def _warn_untested(statuses: list[dict]) -> None:
    for package in TESTED_VERSIONS:
        for version in sorted({s.get(package, "") for s in statuses}):
            if version and not _version_ok(package, version) and (package, version) not in _WARNED_VERSIONS:
                _WARNED_VERSIONS.add((package, version))
                warnings.warn(
                    f"sharddbg was tested with {package} {' / '.join(TESTED_VERSIONS[package])}, "
                    f"the engines run {package} {version}: it will still run; if something looks wrong, "
                    f"that difference is the first suspect.",
                    ShardDbgWarning,
                    stacklevel=3,
                )


@dataclass
class RankOutput:
    """What one rank printed and returned for one call."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    result: object = None
    error: tuple | None = None  # (type name, message, traceback text)
    displays: list = field(default_factory=list)


class Cluster:
    """A local cluster of ``n`` ranks, one ipyparallel engine each, mesh ``ddp x domain``.

    >>> with Cluster(n=4, mesh={"ddp": 1, "domain": 4}) as cl:   # doctest: +SKIP
    ...     cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)")
    """

    def __init__(self, n: int | None = None, mesh=None, *, backend: str | None = None, timeout: float = 60.0,
                 start_timeout: float = 180.0, collective_timeout: float = 60.0, threads_per_rank: int = 1,
                 env: dict | None = None):
        self.mesh: MeshSpec = resolve_mesh(n, mesh)
        self.n = self.mesh.size
        if backend not in (None, "gloo", "nccl"):
            raise ClusterError(f"backend must be 'gloo', 'nccl' or None (auto), got {backend!r}")
        for name, value in (("timeout", timeout), ("start_timeout", start_timeout),
                            ("collective_timeout", collective_timeout)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ClusterError(f"{name} must be a positive number of seconds, got {value!r}")
        self.requested_backend = backend
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.collective_timeout = float(collective_timeout)
        self.threads_per_rank = int(threads_per_rank)
        self.extra_env = dict(env or {})
        self.backend: str | None = None
        self.use_cuda = False
        self.cluster_id: str | None = None
        self.log_dir: str | None = None
        self.client = None
        self.view = None  # ipyparallel DirectView over all ranks, in rank order
        self.engine_ids: list[int] = []  # engine id of rank r at index r
        self.pids: dict[int, int] = {}
        self.timings: dict[str, float] = {}
        self.facts: dict = {}
        self._statuses: list[dict] = []
        self._forkserver: ForkServer | None = None
        self._ipp = None
        self._record: registry.ClusterRecord | None = None
        self._stuck: dict = {}  # msg_id -> rank, from calls that timed out and still run
        self._last_trace = None
        self.running = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.running:
            self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<sharddbg.Cluster {state} n={self.n} mesh({self.mesh}) backend={self.backend}>"

    def start(self) -> "Cluster":
        """Start controller and engines, initialise torch.distributed and the mesh. Makes this the active cluster."""
        if self.running:
            raise ClusterError(f"this cluster is already running ({self.n} ranks); stop() it first, or restart()")
        registry.reap_orphans()
        t0 = time.perf_counter()
        self.cluster_id = f"sdbg-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.log_dir = str(registry.sharddbg_home() / "logs" / self.cluster_id)
        os.makedirs(self.log_dir, exist_ok=True)
        self._record = registry.ClusterRecord(
            cluster_id=self.cluster_id, owner=registry.ProcessRef.of(os.getpid(), "owner"), log_dir=self.log_dir)
        try:
            self._forkserver = ForkServer(
                {"threads_per_rank": self.threads_per_rank, "backend": self.requested_backend},
                self.log_dir, env=self._engine_env())
            self._track(self._forkserver.pid, "zygote")
            self._start_controller()
            self.facts = self._forkserver.wait_ready(self.start_timeout)
            self.timings["preload_s"] = self.facts.get("t_preload_s", float("nan"))
            self._choose_backend()
            self._launch_engines()
            self.running = True
            _STARTED[:] = [c for c in _STARTED if c is not self and c.running] + [self]
        except BaseException:
            self._teardown_quietly()
            raise
        self.timings["start_s"] = time.perf_counter() - t0
        _warn_untested(self._statuses)
        return self

    def _engine_env(self) -> dict:
        threads = str(self.threads_per_rank)
        env = {
            "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
            "SHARDDBG_LOG_DIR": self.log_dir, "SHARDDBG_CLUSTER_ID": self.cluster_id,
            # Flight Recorder: what each rank's collectives were, for hang reports.
            "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"),
            "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
            "PYTHONUNBUFFERED": "1",
            # Loopback only: gloo's and NCCL's own sockets, like the controller and the rendezvous store.
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        }
        env.update(self.extra_env)
        return env

    def _track(self, pid: int, role: str) -> None:
        self._record.processes.append(registry.ProcessRef.of(pid, role))
        self._record.save()

    def _start_controller(self) -> None:
        import ipyparallel as ipp

        t0 = time.perf_counter()
        self._ipp = ipp.Cluster(
            n=0, profile_dir=str(registry.profile_dir()), cluster_id=self.cluster_id,
            controller_ip="127.0.0.1", log_level=30, shutdown_atexit=True,
            # Schedulers as threads, not processes: faster start, fewer processes to reap. A short
            # heartbeat period: engines count as registered only after their first heartbeat.
            controller_args=["--usethreads", "--HeartMonitor.period=500"],
        )
        self._ipp.start_controller_sync()
        controller_pid = self._ipp.controller.process.pid
        self._track(controller_pid, "controller")
        self._forkserver.adopt([controller_pid])
        self.timings["controller_s"] = time.perf_counter() - t0

    def _choose_backend(self) -> None:
        cuda_count = int(self.facts.get("cuda_count", 0))
        backend = self.requested_backend or ("nccl" if cuda_count > 0 else "gloo")
        if backend == "nccl":
            if cuda_count == 0:
                raise ClusterError("backend='nccl' needs GPUs and this host has none; use backend='gloo' (CPU)")
            if self.n > cuda_count:
                raise ClusterError(
                    f"{self.n} ranks but only {cuda_count} GPU(s): NCCL needs one GPU per rank. Use n<={cuda_count}, "
                    f"or backend='gloo' to run the ranks on the CPU")
        self.backend = backend
        self.use_cuda = backend == "nccl"

    def _launch_engines(self) -> None:
        t0 = time.perf_counter()
        engine_argv = [f"--profile-dir={registry.profile_dir()}", f"--cluster-id={self.cluster_id}",
                       os.environ.get("SHARDDBG_ENGINE_LOG", "--log-level=WARN"),
                       # The nanny is a helper process per engine for remote signals; we signal by pid.
                       "--IPEngine.enable_nanny=False"]
        self.pids = self._forkserver.fork(range(self.n), engine_argv, env={})
        for rank in range(self.n):
            self._track(self.pids[rank], "engine")
        self.client = self._ipp.connect_client_sync()
        try:
            self.client.wait_for_engines(self.n, timeout=self.start_timeout, block=True)
        except TimeoutError as exc:
            raise ClusterError(
                f"only {len(self.client.ids)} of {self.n} engines registered within {self.start_timeout:.0f} s; "
                f"engine logs: {self.log_dir}") from exc
        self.timings["engines_s"] = time.perf_counter() - t0
        # Map ranks explicitly: registration order is not rank order.
        ranks = self.client[:].apply_async(lambda: int(__import__("os").environ["SHARDDBG_RANK"])).get(
            timeout=self.timeout)
        by_rank = dict(zip(ranks, self.client.ids))
        self.engine_ids = [by_rank[r] for r in range(self.n)]
        self.view = self.client.direct_view(self.engine_ids)
        self.view.block = False
        self._init_distributed()

    def _init_distributed(self) -> None:
        t0 = time.perf_counter()
        from ..engine import bootstrap

        port = _free_port()
        args = (self.n, self.mesh.shape, self.backend, port, self.collective_timeout, self.use_cuda)
        ar = self.view.apply_async(_init_this_rank, bootstrap.init_rank, *args)
        self._statuses = self._wait(ar, self.start_timeout, what="torch.distributed start-up")
        self.timings["dist_init_s"] = time.perf_counter() - t0

    def stop(self) -> None:
        """Stop engines and controller; check that none of their processes is left."""
        if not self.running and self._forkserver is None:
            raise ClusterError("this cluster is not running (it was never started, or was stopped already)")
        t0 = time.perf_counter()
        self._teardown_quietly()
        leftover = self._record.live_processes() if self._record else []
        if leftover:
            registry.kill_processes(leftover)
        if self._record:
            registry.reap(self._record)
        self.running = False
        _STARTED[:] = [c for c in _STARTED if c is not self]
        self.timings["stop_s"] = time.perf_counter() - t0

    def _teardown_quietly(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
            self.view = None
        if self._forkserver is not None:
            try:
                self._forkserver.kill_engines()
            except Exception:
                pass
            self._forkserver.close()
            self._forkserver = None
        if self._ipp is not None:
            try:
                if self._ipp.controller is not None:
                    self._ipp.stop_controller_sync()
            except Exception:
                pass
            try:
                self._ipp.remove_cluster_file()
            except Exception:
                pass
            self._ipp = None
        self._stuck.clear()
        self.running = False

    def restart(self) -> "Cluster":
        """Replace every engine with a fresh one (new processes, new process group). Same mesh and settings.

        The fork server (torch and physicsnemo already imported) is kept, so this is quicker than a start.
        """
        if not self.running or self._forkserver is None or self._forkserver.proc.poll() is not None:
            if self.running or self._forkserver is not None:
                self.stop()
            return self.start()
        t0 = time.perf_counter()
        try:
            self.client.close()
            self.client = self.view = None
            self._forkserver.kill_engines()
            self._ipp.stop_controller_sync()
            self._stuck.clear()
            self._start_controller()
            self._launch_engines()
        except BaseException:
            self.stop()
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        return self

    def recover(self, timeout: float | None = None) -> None:
        """After a timeout: release ranks blocked in a collective and re-create the process group.

        The engines (and their pids) are kept. Idle ranks destroy their process group, which makes the
        blocked ranks' collective fail ("Connection closed by peer"); then every rank joins a new process
        group on a fresh port. Tensors built on the old mesh must be rebuilt.
        """
        self._require_running()
        timeout = self.timeout if timeout is None else timeout
        busy = self.busy_ranks()
        idle = [r for r in range(self.n) if r not in busy]
        if busy and not idle:
            raise ClusterError(
                f"every rank ({busy}) is busy, so none can release the others; they free themselves after the "
                f"collective timeout ({self.collective_timeout:g} s), or call restart() for new engines now")
        from ..engine import bootstrap

        if busy:
            blocked_pids = [self.pids[r] for r in busy]
            self._wait(self._view_of(idle).apply_async(bootstrap.teardown, blocked_pids), timeout,
                       what="process-group teardown")
            deadline = time.monotonic() + timeout
            while self.busy_ranks() and time.monotonic() < deadline:
                time.sleep(0.05)
            still = self.busy_ranks()
            if still:
                raise ClusterError(
                    f"ranks {still} are still busy after their peers released them: they are not waiting in a "
                    f"collective. restart() replaces the engines")
        self._stuck.clear()
        self._wait(self.view.apply_async(bootstrap.teardown), timeout, what="process-group teardown")
        self._init_distributed()

    # ------------------------------------------------------------------ running code
    def _require_running(self) -> None:
        if not self.running:
            raise ClusterError("this cluster is not running; start() it first")

    def _ranks(self, targets) -> list[int]:
        if targets is None:
            return list(range(self.n))
        ranks = [targets] if isinstance(targets, int) else list(targets)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.n]
        if bad:
            raise ClusterError(f"ranks {bad} do not exist; this cluster has ranks 0..{self.n - 1}")
        return ranks

    def _view_of(self, ranks):
        view = self.client.direct_view([self.engine_ids[r] for r in ranks])
        view.block = False
        return view

    def busy_ranks(self) -> list[int]:
        """Ranks whose engine is still running (or queued) work."""
        status = self.client.queue_status(targets=self.engine_ids, verbose=False)
        return [r for r, eid in enumerate(self.engine_ids)
                if status.get(eid, {}).get("queue", 0) or status.get(eid, {}).get("tasks", 0)]

    def _check_not_stuck(self, ranks) -> None:
        outstanding = self.client.outstanding if self.client else set()
        for msg_id in list(self._stuck):
            if msg_id not in outstanding:
                del self._stuck[msg_id]
        blocked = sorted({r for r in self._stuck.values() if r in ranks})
        if blocked:
            raise ClusterError(
                f"ranks {blocked} are still running an earlier call that timed out; new work would queue behind "
                f"it. Call recover() (%shard_cluster recover) or restart() first")

    def run(self, code: str, *, timeout: float | None = None, targets=None, display: bool = True) -> list[RankOutput]:
        """Execute ``code`` on every rank (or ``targets``), wait at most ``timeout`` seconds.

        Prints each rank's output in rank order when ``display``. Raises :class:`RankError` if a rank
        raised, :class:`RankTimeoutError` (with a hang report) if a rank did not finish in time.
        """
        self._require_running()
        if not isinstance(code, str):
            raise ClusterError(f"code must be a string of Python source, got {type(code).__name__}")
        ranks = self._ranks(targets)
        self._check_not_stuck(ranks)
        ar = self._view_of(ranks).execute(code, silent=False, block=False)
        outputs = self._collect(ar, ranks, timeout, display=display, what="the cell")
        return outputs

    def apply(self, fn, *args, timeout: float | None = None, targets=None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank (or ``targets``); results in rank order."""
        self._require_running()
        ranks = self._ranks(targets)
        self._check_not_stuck(ranks)
        ar = self._view_of(ranks).apply_async(fn, *args, **kwargs)
        return [o.result for o in self._collect(ar, ranks, timeout, display=True,
                                                what=f"{getattr(fn, '__name__', 'the call')}()")]

    def pull(self, name: str, *, timeout: float | None = None, targets=None) -> list:
        """The value of variable ``name`` on every rank (or ``targets``), in rank order."""
        from ..engine import bootstrap

        if not isinstance(name, str) or not name.isidentifier():
            raise ClusterError(f"pull() takes a variable name, got {name!r}")
        return self.apply(bootstrap.user_value, name, timeout=timeout, targets=targets)

    def eval(self, expression: str, *, timeout: float | None = None, targets=None) -> list:
        """Evaluate a Python expression in every rank's namespace; values in rank order."""
        from ..engine import bootstrap

        if not isinstance(expression, str):
            raise ClusterError(f"eval() takes an expression as a string, got {type(expression).__name__}")
        return self.apply(bootstrap.user_eval, expression, timeout=timeout, targets=targets)

    def _wait(self, ar, timeout, what):
        ranks = [self.engine_ids.index(eid) for eid in ar._targets] if hasattr(ar, "_targets") else None
        return [o.result for o in self._collect(ar, ranks, timeout, display=False, what=what)]

    def _collect(self, ar, ranks, timeout, display, what) -> list[RankOutput]:
        timeout = self.timeout if timeout is None else float(timeout)
        if ranks is None:
            ranks = list(range(len(ar.msg_ids)))
        # Wait in slices, so that a rank whose process died ends the wait at once instead of at the timeout.
        deadline = time.monotonic() + timeout
        while True:
            finished_in_time = ar.wait(max(0.0, min(0.25, deadline - time.monotonic())))
            if finished_in_time:
                break
            dead = self.dead_ranks()
            if dead:
                raise ClusterError(self._describe_dead(dead, what))
            if time.monotonic() >= deadline:
                break
        if finished_in_time:
            # Results can arrive before the ranks' last printed lines (iopub is a separate stream).
            ar.wait_for_output(5.0)
        outputs = self._outputs(ar, ranks)
        if display:
            self._display(outputs)
        if not finished_in_time:
            unfinished = [r for r, child in zip(ranks, ar._children) if not child.done()]
            finished = [r for r in ranks if r not in unfinished]
            for r, child in zip(ranks, ar._children):
                if not child.done():
                    self._stuck[child.msg_id] = r
            report = self.hang_report(timeout, finished, unfinished, what=what)
            raise RankTimeoutError(report.format(), report)
        errors = {o.rank: o.error for o in outputs if o.error}
        if errors:
            lines = [f"{len(errors)} of {len(ranks)} ranks raised in {what}:"]
            for rank, (ename, evalue, tb) in sorted(errors.items()):
                lines.append(f"[rank {rank}] {ename}: {evalue}")
            first_rank = min(errors)
            lines.append(f"\nTraceback on rank {first_rank}:\n{errors[first_rank][2]}")
            raise RankError("\n".join(lines), errors)
        return outputs

    def _outputs(self, ar, ranks) -> list[RankOutput]:
        outputs = []
        for rank, child in zip(ranks, ar._children):
            md = child.output.metadata if getattr(child, "output", None) is not None else {}
            out = RankOutput(rank, stdout=md.get("stdout", ""), stderr=filter_noise(md.get("stderr", "")),
                             displays=list(md.get("outputs", [])))
            if child.done():
                value = child.result()
                if isinstance(value, Exception):
                    tb = getattr(value, "traceback", None) or ""
                    out.error = (getattr(value, "ename", type(value).__name__),
                                 getattr(value, "evalue", str(value)), _user_traceback(_strip_ansi(tb)))
                else:
                    out.result = value
                er = md.get("execute_result")
                if er:
                    out.result = er.get("data", {}).get("text/plain", out.result)
            outputs.append(out)
        return outputs

    def _display(self, outputs: list[RankOutput]) -> None:
        for out in outputs:
            if out.stdout:
                sys.stdout.write(_prefix(f"[rank {out.rank}] ", out.stdout))
            if out.stderr:
                sys.stderr.write(_prefix(f"[rank {out.rank} stderr] ", out.stderr))
            if out.displays:
                try:
                    from IPython.display import publish_display_data

                    for item in out.displays:
                        publish_display_data(item.get("data", {}), item.get("metadata", {}))
                except ImportError:
                    pass
        sys.stdout.flush()

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has exited, with how (as seen by the fork server, which reaps them)."""
        gone = [rank for rank, pid in self.pids.items() if not _pid_alive(pid)]
        if not gone:
            return {}
        how = {}
        deadline = time.monotonic() + 1.0  # the fork server reports an exit a moment after the process is gone
        while True:
            for event in list(self._forkserver.exited) if self._forkserver else []:
                if self.pids.get(event["rank"]) == event["pid"]:
                    how[event["rank"]] = _exit_description(event["status"])
            alive = self._forkserver is not None and self._forkserver.proc.poll() is None
            if all(r in how for r in gone) or not alive or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return {r: how.get(r, "is gone (its process no longer exists)") for r in gone}

    def _describe_dead(self, dead: dict[int, str], what: str) -> str:
        lines = [f"rank(s) {sorted(dead)} died while running {what}:"]
        for rank, how in sorted(dead.items()):
            lines.append(f"  rank {rank} (pid {self.pids.get(rank)}) {how}")
            log = os.path.join(self.log_dir or "", f"engine-rank{rank}.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    tail = f.read()[-1500:].strip()
                if tail:
                    lines.append("  last lines of its log:\n    " + "\n    ".join(tail.splitlines()[-12:]))
        lines.append("The other ranks may be waiting for it in a collective. restart() (%shard_cluster restart) "
                     "starts new engines.")
        return "\n".join(lines)

    # ------------------------------------------------------------------ inspection
    def diagnose(self, ranks=None, timeout: float = 5.0) -> dict[int, dict | None]:
        """Each rank's stack and Flight Recorder, answered by its control thread even while it is blocked."""
        self._require_running()
        from ..engine.api import DIAGNOSE_REQUEST

        ranks = self._ranks(ranks)
        futures = {}
        for rank in ranks:
            ident = self.client._build_targets([self.engine_ids[rank]])[0][0]
            futures[rank] = self.client._send(self.client._control_stream, DIAGNOSE_REQUEST, content={}, ident=ident)
        deadline = time.monotonic() + timeout
        replies: dict[int, dict | None] = {}
        for rank, future in futures.items():
            try:
                msg = future.result(timeout=max(0.01, deadline - time.monotonic()))
                content = msg["content"]
                replies[rank] = content.get("report") if content.get("status") == "ok" else None
            except Exception:
                replies[rank] = None
        return replies

    def hang_report(self, timeout, finished, unfinished, what="the cell") -> hang.HangReport:
        diagnoses = self.diagnose(range(self.n))
        report = hang.build_report(timeout, finished, unfinished, diagnoses, self.pids, what=what)
        report.diagnoses = diagnoses
        return report

    def clock_offsets(self, samples: int = 15, timeout: float = 5.0) -> dict[int, dict]:
        """How far each rank's recorder clock is ahead of this process's ``time.monotonic_ns()``.

        NTP-style: for each rank, ``samples`` round trips on the control channel; the one with the
        shortest round trip wins, offset = engine time - midpoint, uncertainty = half its round trip.
        """
        from ..engine.api import CLOCK_REQUEST

        self._require_running()
        offsets = {}
        for rank, eid in enumerate(self.engine_ids):
            ident = self.client._build_targets([eid])[0][0]
            best = None
            for _ in range(samples):
                t0 = time.monotonic_ns()
                future = self.client._send(self.client._control_stream, CLOCK_REQUEST, content={}, ident=ident)
                try:
                    msg = future.result(timeout=timeout)
                except Exception as exc:
                    raise ClusterError(f"rank {rank} did not answer a clock request within {timeout} s") from exc
                t1 = time.monotonic_ns()
                engine_ns = int(msg["content"]["now_ns"])
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, engine_ns - (t0 + t1) // 2)
            offsets[rank] = {"offset_ns": best[1], "uncertainty_ns": best[0] // 2}
        return offsets

    # ------------------------------------------------------------------ recording
    def trace(self, code: str, *, timeout: float | None = None, max_events: int = 200_000, unmask: bool = True,
              display: bool = True):
        """Run ``code`` on every rank under the recorder and gather one :class:`sharddbg.trace.Trace`.

        The trace is kept even when the cell fails or times out (ranks that timed out contribute their
        events up to then, marked incomplete): ``last_trace()`` returns it, and the error is re-raised.
        """
        from ..engine import recorder
        from ..trace import Trace

        self._require_running()
        if not isinstance(max_events, int) or max_events < 1:
            raise ClusterError(f"max_events must be a positive integer, got {max_events!r}")
        self._check_not_stuck(range(self.n))
        self._wait(self.view.apply_async(recorder.start, max_events, unmask), self.timeout, what="recorder start")
        t0 = time.perf_counter()
        failure = None
        payloads: dict[int, dict | None] = {}
        incomplete: list[int] = []
        try:
            self.run(code, timeout=timeout, display=display)
        except RankTimeoutError as exc:
            failure = exc
            diagnoses = getattr(exc.report, "diagnoses", {})
            for rank in exc.report.unfinished:
                payloads[rank] = (diagnoses.get(rank) or {}).get("recording")
                incomplete.append(rank)
        except RankError as exc:
            failure = exc
        wall_s = time.perf_counter() - t0
        done = [r for r in range(self.n) if r not in payloads]
        if done:
            stopped = self._wait(self._view_of(done).apply_async(recorder.stop), self.timeout, what="recorder stop")
            payloads.update(zip(done, stopped))
        offsets = self.clock_offsets()
        trace = Trace.from_payloads(
            payloads, {r: o["offset_ns"] for r, o in offsets.items()},
            meta={"code": code, "wall_s": wall_s, "cluster_id": self.cluster_id, "mesh": self.mesh.as_dict(),
                  "backend": self.backend, "clock_uncertainty_ns": {r: o["uncertainty_ns"] for r, o in offsets.items()},
                  "failed": None if failure is None else f"{type(failure).__name__}: {str(failure).splitlines()[0]}"},
            incomplete_ranks=incomplete)
        self._last_trace = trace
        if failure is not None:
            raise failure
        return trace

    def inspect(self, name: str, *, timeout: float | None = None):
        """The shard inspector for the ShardTensor named ``name`` on the ranks (see sharddbg.cluster.inspect)."""
        from .inspect import inspect_tensor

        return inspect_tensor(self, name, timeout=timeout)

    def last_trace(self):
        """The Trace of the last ``trace()`` / ``%%shard_trace`` on this cluster."""
        if self._last_trace is None:
            from ..errors import ShardDbgError

            raise ShardDbgError("nothing was traced on this cluster yet; run a cell with %%shard_trace or cl.trace(code)")
        return self._last_trace

    def status(self):
        """One row per rank: pid, host, device, backend, mesh coordinate, versions, patch mode."""
        import pandas as pd

        from ..engine import bootstrap

        self._require_running()
        busy = self.busy_ranks()
        rows = []
        idle = [r for r in range(self.n) if r not in busy]
        fresh = dict(zip(idle, self._wait(self._view_of(idle).apply_async(bootstrap.status), self.timeout,
                                          what="status()"))) if idle else {}
        for rank in range(self.n):
            row = dict(fresh.get(rank) or (self._statuses[rank] if rank < len(self._statuses) else {"rank": rank}))
            row["engine_id"] = self.engine_ids[rank]
            row["state"] = "busy" if rank in busy else "idle"
            rows.append(row)
        columns = ["rank", "pid", "host", "device", "backend", "ddp", "domain", "patch_mode", "n_patches",
                   "torch", "physicsnemo", "python", "state", "engine_id", "dist_initialized", "patch_reason",
                   "collective_timeout_s", "threads"]
        frame = pd.DataFrame(rows)
        return frame[[c for c in columns if c in frame.columns]].set_index("rank")


def _init_this_rank(init_rank, world_size, mesh_shape, backend, port, collective_timeout, use_cuda):
    """Runs on an engine: its rank comes from the fork server, not from the engine id."""
    import os

    return init_rank(int(os.environ["SHARDDBG_RANK"]), world_size, mesh_shape, backend, port,
                     collective_timeout, use_cuda)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _strip_ansi(text) -> str:
    if isinstance(text, list):
        text = "\n".join(text)
    return _ANSI.sub("", text or "")


def _exit_description(status: int) -> str:
    import signal as _signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({_signal.Signals(sig).name})"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _user_traceback(text: str) -> str:
    """Drop ipyparallel's own frame (the exec of an apply request) from an engine traceback."""
    blocks = re.split(r"\n(?=File |Cell In)", text)
    kept = [b for b in blocks if "ipyparallel/engine/kernel.py" not in b.split("\n", 1)[0]
            and "Could not get source, probably due dynamically evaluated source code" not in b]
    return "\n".join(kept)


def _prefix(prefix: str, text: str) -> str:
    lines = text.splitlines()
    return "".join(f"{prefix}{line}\n" for line in lines)
