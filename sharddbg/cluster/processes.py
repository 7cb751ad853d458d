"""The processes behind one cluster: fork server, ipyparallel controller, one engine per rank.

``ClusterProcesses`` starts them: the fork server starts the controller first thing (the controller is
its child, under its lifeline from its first moment) and imports torch and physicsnemo while the
controller starts; then it forks the engines, and an ipyparallel client connects to them. Every process
is named in the cluster's registry record as it starts (the controller with its process group, later its
children), so that a cluster whose owner died is found and reaped. It stops them all and checks that none
is left; it tells which ranks died and how (as the fork server, their parent, saw them), with the end of
their logs, and whether the controller died and how. It runs nothing on a rank: that is ``execution``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import psutil

from ..errors import ClusterError
from . import registry
from .launcher import ControllerProcess, ForkServer
from .reference_process import WarmReference

# What a dead rank's (or controller's) description quotes from the end of its log.
LOG_TAIL_CHARS = 1500
LOG_TAIL_LINES = 12

# How often the start-up waits look at the controller and the engines while waiting for them.
POLL_S = 0.05

# The controller's heartbeat: it pings every engine each period and unregisters one that misses more than
# HEARTBEAT_MISSES pings in a row (its process stopped or starved), for good: nothing reaches it after that.
# A new engine counts as registered at the first beat after its heart answers, so a short period shortens every
# start and restart; the engines' hearts answer from a zmq thread without the GIL, and 50 misses keep ~5 s.
HEARTBEAT_PERIOD_MS = 100
HEARTBEAT_MISSES = 50
HEARTBEAT_LIMIT_S = HEARTBEAT_PERIOD_MS * (HEARTBEAT_MISSES + 1) / 1000


def free_port() -> int:
    """A TCP port free on the loopback interface now (every torch.distributed start takes a fresh one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_backend(requested: str | None, cuda_count: int, n: int) -> str:
    """``requested``, or NCCL where the host has GPUs and gloo where it has none; refuses NCCL without a GPU
    per rank."""
    backend = requested or ("nccl" if cuda_count > 0 else "gloo")
    if backend == "nccl":
        if cuda_count == 0:
            raise ClusterError("backend='nccl' needs GPUs and this host has none; use backend='gloo' (CPU)")
        if n > cuda_count:
            raise ClusterError(
                f"{n} ranks but only {cuda_count} GPU(s): NCCL needs one GPU per rank. Use n<={cuda_count}, "
                f"or backend='gloo' to run the ranks on the CPU")
    return backend


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs (a zombie does not; None, no process yet, does not)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ClusterProcesses:
    """The processes of one cluster, from the fork server's start to the check that nothing is left.

    ``timings`` is the cluster's dict of durations; the start-up steps add theirs to it.
    """

    def __init__(self, *, threads_per_rank: int, requested_backend: str | None, extra_env: dict, timings: dict):
        registry.make_home_private()
        self.cluster_id = registry.new_cluster_id()
        self.log_dir = str(registry.cluster_log_dir(self.cluster_id))
        self.record = registry.ClusterRecord(
            cluster_id=self.cluster_id, owner=registry.ProcessRef.of(os.getpid(), "owner"), log_dir=self.log_dir)
        self.record.save()  # before pruning: the new cluster's log folder is protected from the start
        registry.prune_logs()
        self.threads_per_rank = threads_per_rank
        self.requested_backend = requested_backend
        self.extra_env = dict(extra_env)
        self.timings = timings
        self.facts: dict = {}  # what the fork server found: GPU count, versions, patch mode, import times
        self.reference: WarmReference | None = None  # forks the checks' reference processes (started by the first)
        self.pids: dict[int, int] = {}  # rank -> engine pid
        self.fork_server: ForkServer | None = None
        self.controller: ControllerProcess | None = None  # None before the start, after a stop
        self._controller_ref: registry.ProcessRef | None = None  # its record entry (pid and start time)
        self._controller_started_at = 0.0  # time.time() when it was asked for

    # ------------------------------------------------------------------ start
    def start(self, start_timeout: float) -> dict:
        """Fork server and controller (started by the fork server before it imports anything); returns
        the fork server's facts once its imports are done."""
        self._remove_connection_files()
        self._controller_started_at = time.time()
        self.fork_server = ForkServer(self.fork_server_config(), self.log_dir, env=self.engine_env())
        self.record.track(self.fork_server.pid, "zygote")
        self._controller_running(self.fork_server.wait_controller(start_timeout))
        self.facts = self.fork_server.wait_ready(start_timeout)
        self.timings["preload_s"] = self.facts.get("t_preload_s", float("nan"))
        return self.facts

    def fork_server_config(self) -> dict:
        """What the fork server is told at its start: the controller to start, the owner, what to preload."""
        return {"threads_per_rank": self.threads_per_rank, "backend": self.requested_backend,
                "cluster_id": self.cluster_id, "controller": self.controller_spec(),
                "owner": {"pid": self.record.owner.pid, "create_time": self.record.owner.create_time}}

    def engine_env(self) -> dict:
        """The environment every engine runs with (on top of this process's)."""
        threads = str(self.threads_per_rank)
        env = {
            "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
            "SHARDDBG_LOG_DIR": self.log_dir, "SHARDDBG_CLUSTER_ID": self.cluster_id,
            # resolved here: a relative value would count from the fork server's working folder
            "SHARDDBG_HOME": str(registry.sharddbg_home()),
            # Flight Recorder: what each rank's collectives were, for hang reports.
            "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"),
            "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
            # NCCL's watchdog on a collective timeout: abort the communicators, keep the process (its default
            # kills it, and a debugger's engines must survive a hang; sharddbg names the hang itself)
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
            "PYTHONUNBUFFERED": "1",
            # Loopback only: gloo's and NCCL's own sockets, like the controller and the rendezvous store.
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        }
        env.update(self.extra_env)
        return env

    def controller_spec(self) -> dict:
        """What the fork server runs as the controller: command line, log file, environment."""
        argv = [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={registry.profile_dir()}",
                registry.cluster_id_arg(self.cluster_id), f"--ip={self.controller_ip}",
                # Schedulers as threads, not processes: faster start, fewer processes to reap. A short
                # heartbeat period: engines count as registered only after their first heartbeat.
                "--usethreads", f"--HeartMonitor.period={HEARTBEAT_PERIOD_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]
        return {"argv": argv, "log": self.controller_log, "env": {}}

    # the controller listens on loopback only (engines started elsewhere than this host need another address)
    controller_ip = "127.0.0.1"

    @property
    def controller_log(self) -> str:
        return os.path.join(self.log_dir, "controller.log")

    def connection_files(self) -> dict[str, str]:
        """The controller's connection files (its ports and key), for the client and for the engines."""
        security = registry.profile_dir() / "security"
        return {kind: str(security / f"ipcontroller-{self.cluster_id}-{kind}.json") for kind in ("client", "engine")}

    def _remove_connection_files(self) -> None:
        """A new controller writes new ones: a stale file would send engines to a dead controller's ports."""
        for path in self.connection_files().values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _controller_running(self, controller: ControllerProcess) -> None:
        self.controller = controller
        self._controller_ref = self.record.track(controller.pid, "controller", process_group=controller.group)

    def start_controller(self) -> None:
        """A new controller, started by the fork server (after ``stop_controller``)."""
        self._remove_connection_files()
        self._controller_started_at = time.time()
        self._controller_running(self.fork_server.start_controller())

    def stop_controller(self) -> None:
        """The controller's whole process group down (also when the controller had died already)."""
        self.fork_server.stop_controller()
        self.controller = self._controller_ref = None
        self._remove_connection_files()

    def _wait_connection_files(self, deadline: float) -> str:
        """The client connection file, once the controller has written both; raises if it died first."""
        files = self.connection_files()
        while True:
            failure = self.controller_failure()
            if failure:
                raise ClusterError(f"{failure} while starting.{self._controller_log_tail()}")
            if all(_readable_json(path) for path in files.values()):
                written = os.stat(files["client"]).st_mtime
                self.timings["controller_s"] = max(0.0, written - self._controller_started_at)
                return files["client"]
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the controller (pid {self.controller.pid}) did not write its connection files in time "
                    f"({files['client']}).{self._controller_log_tail()}")
            time.sleep(POLL_S)

    def launch_engines(self, n: int, start_timeout: float):
        """Fork ``n`` engines (ranks 0..n-1) and wait until all registered; returns a connected ipyparallel
        Client. Its engine ids are not rank order: ``execution`` maps them. A controller or engine that
        dies meanwhile ends the wait at once, named."""
        import ipyparallel as ipp

        deadline = time.monotonic() + start_timeout
        client_file = self._wait_connection_files(deadline)
        engine_argv = [f"--profile-dir={registry.profile_dir()}", registry.cluster_id_arg(self.cluster_id),
                       os.environ.get("SHARDDBG_ENGINE_LOG", "--log-level=WARN"),
                       # The nanny is a helper process per engine for remote signals; we signal by pid.
                       "--IPEngine.enable_nanny=False"]
        self.pids = self.fork_server.fork(range(n), engine_argv, env={})
        self.facts["cuda_initialized_at_fork"] = self.fork_server.cuda_initialized_at_fork
        for rank in range(n):
            self.record.track(self.pids[rank], "engine")
        try:
            with open(client_file) as f:
                connection = json.load(f)
            client = ipp.Client(connection, profile_dir=str(registry.profile_dir()),
                                timeout=max(1.0, deadline - time.monotonic()))
        except Exception as exc:
            failure = self.controller_failure()
            raise ClusterError(f"{failure}: the client could not connect to it" if failure else
                               f"the client could not connect to the controller: {type(exc).__name__}: {exc}") from exc
        try:
            self._wait_for_engines(client, n, deadline, start_timeout)
        except BaseException:
            client.close()
            raise
        self._track_controller_children()
        return client

    def _wait_for_engines(self, client, n: int, deadline: float, start_timeout: float) -> None:
        while len(client.ids) < n:
            failure = self.controller_failure()
            if failure:
                raise ClusterError(f"{failure} while {n} engines were registering.{self._controller_log_tail()}")
            dead = self.dead_ranks()
            if dead:
                raise ClusterError(self.describe_dead(dead, "the start-up"))
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(client.ids)} of {n} engines registered within {start_timeout:.0f} s; "
                    f"engine logs: {self.log_dir}")
            time.sleep(POLL_S)

    def _track_controller_children(self) -> None:
        """Name the controller's children (its heart monitor) in the record: found even once it is dead."""
        if self._controller_ref is None or not self._controller_ref.alive():
            return
        try:
            children = psutil.Process(self.controller.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            self.record.track(child.pid, "controller-child")

    def replace_engines(self) -> None:
        """Kill every engine and restart the controller (the fork server stays): ready for ``launch_engines``.
        Works when the controller has died."""
        self.fork_server.kill_engines()
        self.pids = {}
        self.stop_controller()
        self.start_controller()

    def warm_reference(self) -> WarmReference | None:
        """The warm Python that forks the checks' reference processes (``reference_process``): started now, and
        named in the record (reaped with the cluster), unless one serves already; None where it cannot start."""
        if self.reference is not None and self.reference.serves_now():
            return self.reference
        if self.reference is not None:
            self.reference.close()
            self.reference = None
        try:
            self.reference = WarmReference()
        except OSError:
            return None  # each reference then runs as a new Python
        self.record.track(self.reference.pid, "reference")
        return self.reference

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop everything, kill what is left of the cluster's processes, forget the record; raises if a
        process survived that."""
        survivors = self.shut_down()
        if survivors:
            raise ClusterError(f"processes of cluster {self.cluster_id} survived SIGKILL: " + ", ".join(
                f"pid {p.pid} ({_cmdline(p)})" for p in survivors))

    def shut_down(self) -> list[psutil.Process]:
        """Engines, fork server and controller (its whole process group) down, what is left of the
        cluster's processes killed, the record and connection files removed; quietly, also after a failed
        start. Returns the processes that still run after all that (normally none)."""
        # Quiet: after a failed start, the start's own error is the one to see.
        if self.reference is not None:
            self.reference.close()
            self.reference = None
        if self.fork_server is not None:
            try:
                self.fork_server.close()  # it kills the engines and the controller's group, then exits
            except (ClusterError, OSError, subprocess.TimeoutExpired):
                pass
            self.fork_server = None
        self.controller = self._controller_ref = None
        try:
            registry.reap(self.record)
        except (OSError, psutil.Error):
            pass
        return self.record.live_processes()

    # ------------------------------------------------------------------ state
    @property
    def fork_server_pid(self) -> int | None:
        return self.fork_server.pid if self.fork_server is not None else None

    @property
    def controller_pid(self) -> int | None:
        """The controller's process id (None when none was started or it was stopped)."""
        return self.controller.pid if self.controller is not None else None

    def fork_server_alive(self) -> bool:
        return self.fork_server is not None and self.fork_server.alive()

    def controller_failure(self) -> str | None:
        """None while the controller runs (or none is meant to run); else how it died, e.g. "the
        controller (pid 1234) died: killed by signal 9 (SIGKILL)". Cheap: a look at /proc, no message to
        anyone, while it runs."""
        if self.controller is None:
            return None
        if self._controller_ref is not None and self._controller_ref.alive():
            return None
        pid = self.controller.pid
        if self.fork_server is None or not self.fork_server.alive():
            return f"the controller (pid {pid}) died; how is unknown: the fork server, its parent, is gone"
        ended = self.fork_server.exit_of(pid, wait_s=1.0)  # reported a moment after the process is gone
        if ended is None:
            return f"the controller (pid {pid}) died; the fork server has not reported how"
        return f"the controller (pid {pid}) died: {ended.description}"

    def live(self) -> list[psutil.Process]:
        """Every process of this cluster that still runs (the controller's and fork server's children too)."""
        return self.record.live_processes()

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has exited, with how (as seen by the fork server, which reaps them)."""
        gone = [rank for rank, pid in self.pids.items() if not pid_alive(pid)]
        how = {}
        deadline = time.monotonic() + 1.0  # the fork server reports an exit a moment after the process is gone
        for rank in gone:
            ended = None
            if self.fork_server is not None:
                ended = self.fork_server.exit_of(self.pids[rank], wait_s=max(0.0, deadline - time.monotonic()))
            how[rank] = ended.description if ended else "is gone (its process no longer exists)"
        return how

    def log_tail(self, rank: int) -> str:
        """The last lines of rank ``rank``'s engine log ("" when there is none)."""
        return tail_of(os.path.join(self.log_dir, f"engine-rank{rank}.log"))

    def _controller_log_tail(self) -> str:
        tail = tail_of(self.controller_log)
        return (f"\nlast lines of its log ({self.controller_log}):\n    " + "\n    ".join(tail.splitlines())
                if tail else f" Its log: {self.controller_log}")

    def describe_dead(self, dead: dict[int, str], what: str) -> str:
        """The message for ranks that died while running ``what``: how each died, the end of its log."""
        lines = []
        for rank, how in sorted(dead.items()):
            lines.append(f"rank {rank} (pid {self.pids.get(rank)}) died while running {what}: {how}")
            tail = "\n".join(line for line in self.log_tail(rank).splitlines() if not _LOG_NOISE.search(line))
            if tail:
                lines.append("  last lines of its log:\n    " + "\n    ".join(tail.splitlines()))
        return "\n".join(lines)


# engine log lines that say nothing about why a rank died
_LOG_NOISE = re.compile(r"Not using CurveZMQ security|debugpy_stream undefined|TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated"
                        r"|Could not find or load the NVIDIA CUDA driver")


def tail_of(path: str) -> str:
    """The last lines of the text file ``path`` ("" when there is none)."""
    try:
        with open(path, errors="replace") as f:
            tail = f.read()[-LOG_TAIL_CHARS:].strip()
    except FileNotFoundError:
        return ""
    return "\n".join(tail.splitlines()[-LOG_TAIL_LINES:])


def _readable_json(path: str) -> bool:
    """Whether ``path`` holds a whole JSON document (the controller may be half-way through writing it)."""
    try:
        with open(path) as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
