"""The processes behind one cluster: fork server, ipyparallel controller, one engine per rank.

``ClusterProcesses`` starts them (the fork server imports torch and physicsnemo while the controller
starts), forks the engines and connects an ipyparallel client to them; it names every process in the
cluster's registry record as it starts, so that a cluster whose owner died is found and reaped; it stops
them all and checks that none is left; and it tells which ranks died and how (as the fork server, their
parent, saw them), with the end of their logs. It runs nothing on a rank: that is ``execution``.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

import psutil

from ..errors import ClusterError
from . import registry
from .launcher import ForkServer

# What a dead rank's description quotes from the end of its log.
LOG_TAIL_CHARS = 1500
LOG_TAIL_LINES = 12


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


def exit_description(status: int) -> str:
    """How a process ended, from its ``waitpid`` status: "killed by signal 9 (SIGKILL)", "exited with status 1"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with status {os.WEXITSTATUS(status)}"


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ClusterProcesses:
    """The processes of one cluster, from the fork server's start to the check that nothing is left.

    ``timings`` is the cluster's dict of durations; the start-up steps add theirs to it.
    """

    def __init__(self, *, threads_per_rank: int, requested_backend: str | None, extra_env: dict, timings: dict):
        self.cluster_id = f"sdbg-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.log_dir = str(registry.sharddbg_home() / "logs" / self.cluster_id)
        os.makedirs(self.log_dir, exist_ok=True)
        self.record = registry.ClusterRecord(
            cluster_id=self.cluster_id, owner=registry.ProcessRef.of(os.getpid(), "owner"), log_dir=self.log_dir)
        self.threads_per_rank = threads_per_rank
        self.requested_backend = requested_backend
        self.extra_env = dict(extra_env)
        self.timings = timings
        self.facts: dict = {}  # what the fork server found: GPU count, versions, patch mode, import times
        self.pids: dict[int, int] = {}  # rank -> engine pid
        self.fork_server: ForkServer | None = None
        self._controller = None  # the ipyparallel.Cluster that runs the controller (no engines of its own)

    # ------------------------------------------------------------------ start
    def start(self, start_timeout: float) -> dict:
        """Fork server and controller, started together; returns the fork server's facts once it is ready."""
        self.fork_server = ForkServer(
            {"threads_per_rank": self.threads_per_rank, "backend": self.requested_backend},
            self.log_dir, env=self.engine_env())
        self._track(self.fork_server.pid, "zygote")
        self.start_controller()
        self.facts = self.fork_server.wait_ready(start_timeout)
        self.timings["preload_s"] = self.facts.get("t_preload_s", float("nan"))
        return self.facts

    def engine_env(self) -> dict:
        """The environment every engine runs with (on top of this process's)."""
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
        self.record.processes.append(registry.ProcessRef.of(pid, role))
        self.record.save()

    def start_controller(self) -> None:
        import ipyparallel as ipp

        t0 = time.perf_counter()
        self._controller = ipp.Cluster(
            n=0, profile_dir=str(registry.profile_dir()), cluster_id=self.cluster_id,
            controller_ip="127.0.0.1", log_level=30, shutdown_atexit=True,
            # Schedulers as threads, not processes: faster start, fewer processes to reap. A short
            # heartbeat period: engines count as registered only after their first heartbeat.
            controller_args=["--usethreads", "--HeartMonitor.period=500"],
        )
        self._controller.start_controller_sync()
        controller_pid = self._controller.controller.process.pid
        self._track(controller_pid, "controller")
        self.fork_server.adopt([controller_pid])
        self.timings["controller_s"] = time.perf_counter() - t0

    def launch_engines(self, n: int, start_timeout: float):
        """Fork ``n`` engines (ranks 0..n-1) and wait until all registered; returns a connected ipyparallel
        Client. Its engine ids are not rank order: ``execution`` maps them."""
        engine_argv = [f"--profile-dir={registry.profile_dir()}", f"--cluster-id={self.cluster_id}",
                       os.environ.get("SHARDDBG_ENGINE_LOG", "--log-level=WARN"),
                       # The nanny is a helper process per engine for remote signals; we signal by pid.
                       "--IPEngine.enable_nanny=False"]
        self.pids = self.fork_server.fork(range(n), engine_argv, env={})
        for rank in range(n):
            self._track(self.pids[rank], "engine")
        client = self._controller.connect_client_sync()
        try:
            client.wait_for_engines(n, timeout=start_timeout, block=True)
        except TimeoutError as exc:
            raise ClusterError(
                f"only {len(client.ids)} of {n} engines registered within {start_timeout:.0f} s; "
                f"engine logs: {self.log_dir}") from exc
        return client

    def replace_engines(self) -> None:
        """Kill every engine and restart the controller (the fork server stays): ready for ``launch_engines``."""
        self.fork_server.kill_engines()
        self._controller.stop_controller_sync()
        self.start_controller()

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop everything, kill what is left of the processes the record names, and forget the record."""
        self.shut_down()
        leftover = self.record.live_processes()
        if leftover:
            registry.kill_processes(leftover)
        registry.reap(self.record)

    def shut_down(self) -> None:
        """Engines, fork server and controller down, quietly (also after a failed start)."""
        if self.fork_server is not None:
            try:
                self.fork_server.kill_engines()
            except Exception:
                pass
            self.fork_server.close()
            self.fork_server = None
        if self._controller is not None:
            try:
                if self._controller.controller is not None:
                    self._controller.stop_controller_sync()
            except Exception:
                pass
            try:
                self._controller.remove_cluster_file()
            except Exception:
                pass
            self._controller = None

    # ------------------------------------------------------------------ state
    @property
    def fork_server_pid(self) -> int | None:
        return self.fork_server.pid if self.fork_server is not None else None

    def fork_server_alive(self) -> bool:
        return self.fork_server is not None and self.fork_server.proc.poll() is None

    def live(self) -> list[psutil.Process]:
        """Every process of this cluster that still runs (the controller's and fork server's children too)."""
        return self.record.live_processes()

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine process has exited, with how (as seen by the fork server, which reaps them)."""
        gone = [rank for rank, pid in self.pids.items() if not pid_alive(pid)]
        if not gone:
            return {}
        how = {}
        deadline = time.monotonic() + 1.0  # the fork server reports an exit a moment after the process is gone
        while True:
            for event in list(self.fork_server.exited) if self.fork_server else []:
                if self.pids.get(event["rank"]) == event["pid"]:
                    how[event["rank"]] = exit_description(event["status"])
            if all(r in how for r in gone) or not self.fork_server_alive() or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return {r: how.get(r, "is gone (its process no longer exists)") for r in gone}

    def log_tail(self, rank: int) -> str:
        """The last lines of rank ``rank``'s engine log ("" when there is none)."""
        log = os.path.join(self.log_dir, f"engine-rank{rank}.log")
        if not os.path.exists(log):
            return ""
        with open(log, errors="replace") as f:
            tail = f.read()[-LOG_TAIL_CHARS:].strip()
        return "\n".join(tail.splitlines()[-LOG_TAIL_LINES:])

    def describe_dead(self, dead: dict[int, str], what: str) -> str:
        """The message for ranks that died while running ``what``: how each died, the end of its log."""
        lines = [f"rank(s) {sorted(dead)} died while running {what}:"]
        for rank, how in sorted(dead.items()):
            lines.append(f"  rank {rank} (pid {self.pids.get(rank)}) {how}")
            tail = self.log_tail(rank)
            if tail:
                lines.append("  last lines of its log:\n    " + "\n    ".join(tail.splitlines()))
        lines.append("The other ranks may be waiting for it in a collective. restart() (%shard_cluster restart) "
                     "starts new engines.")
        return "\n".join(lines)
