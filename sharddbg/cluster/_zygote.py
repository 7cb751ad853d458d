"""The fork server behind a sharddbg cluster: start the controller, import the heavy stack once, then fork
one engine per rank.

Run as ``python -m sharddbg.cluster._zygote --cluster-id=ID CONFIG_JSON`` by
:mod:`sharddbg.cluster.launcher`. It talks JSON lines: commands on stdin, replies on stdout. Why a fork
server: importing torch + physicsnemo and running physicsnemo's ``register_custom_ops()`` costs seconds
of CPU per process; four engines doing it at once on a 2-core laptop take four times as long as one
process doing it and forking.

Lifeline: its stdin is the owner's (the client process's) pipe. When it closes (the owner ended, even by
SIGKILL) the fork server kills its engines and the controller's whole process group, and exits. The
controller is its child, started before anything else (so no moment exists in which the controller runs
and nothing would end it); during the preload a thread watches the pipe, afterwards the command loop.
When the controller dies, the rest of its process group is killed at once and its exit is reported.
When the fork server dies with the owner, each engine ends the cluster itself (``end_cluster_when_owner_gone``).
Engines lead their own process groups, so that what a cell started (a subprocess) is killed with them.

Fork safety: the process is single-threaded whenever it forks (the preload's watcher thread has ended by
then; no torch compute, no zmq context) and CUDA is never initialised in it (``_keep_cuda_uninitialised``):
neither torch's runtime nor, through physicsnemo's ``warp.init()`` at import, the driver. That holds on GPU
hosts too, so the heavy stack is preloaded there as well (measured: no fork warning, CUDA usable in every
engine, 100 NCCL steps; 2 H200s ready in 20 s instead of 25-31 s). ``SHARDDBG_GPU_PRELOAD=light`` makes each
engine import torch and physicsnemo itself after the fork instead.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

# How long the controller gets to exit after SIGTERM before its process group is killed.
CONTROLLER_GRACE_S = 1.0
# How often each engine looks whether the cluster's owner still runs.
OWNER_POLL_S = 1.0


def _reply(out, **payload) -> None:
    try:
        out.write(json.dumps(payload) + "\n")
        out.flush()
    except (BrokenPipeError, ValueError):
        pass  # the owner is gone: the lifeline ends everything


def _nvidia_device_present() -> bool:
    """Device nodes, not a CUDA call: nothing here may start driver threads in a process that forks."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


GPU_COUNT_PROBE = "import torch; print(torch.cuda.device_count())"


class GpuCountProbe:
    """The GPU count, asked of a fresh Python process (CUDA initialised there, never here): started before
    the heavy imports and read after them, so that its own torch import and CUDA start overlap with ours
    (before, it ran first: a torch import and a CUDA start of its own, seconds on a GPU host). It is started
    before this process loads torch or any CUDA library, and it execs at once."""

    # printed by the probe after its answer: when it finished, on the machine's monotonic clock (the same in
    # every process), so that its own time is known even when it is read long after it ended
    DONE_MARK = "sharddbg-probe-done"

    def __init__(self, code: str = GPU_COUNT_PROBE, timeout: float = 120.0) -> None:
        self.t0 = time.monotonic()
        self.timeout = timeout
        self.seconds: float | None = None  # how long the probe took, start to answer
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-c", f"{code}\nimport time\nprint({self.DONE_MARK!r}, time.monotonic())"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def result(self) -> int:
        """The count it printed (0 when it failed or timed out); waits for it."""
        if self.proc is None:
            return 0
        try:
            out, _ = self.proc.communicate(timeout=max(0.0, self.timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return 0
        lines = out.strip().splitlines()
        done = [line.split()[-1] for line in lines if line.startswith(self.DONE_MARK)]
        try:
            self.seconds = (float(done[-1]) if done else time.monotonic()) - self.t0
            return int([line for line in lines if not line.startswith(self.DONE_MARK)][-1])
        except (ValueError, IndexError):
            return 0


@contextlib.contextmanager
def _keep_cuda_uninitialised(gpu_host: bool):
    """While the heavy stack is imported: the one place that decides how CUDA stays uninitialised here.

    ``torch.cuda.is_available()`` (physicsnemo calls it at import) asks the CUDA runtime for the device
    count, and from then on every child forked from this process is a "bad fork": a CUDA call in an engine
    raises "Cannot re-initialize CUDA in forked subprocess" instead of the real answer (on a host without a
    driver, torch's own "Found no NVIDIA driver"). So the runtime is not asked while the stack imports: the
    count is 0 for that time, and the real function is back before any fork. On a GPU host physicsnemo also
    calls ``warp.init()`` at import, which initialises the CUDA driver (an engine forked after it cannot
    initialise CUDA at all): ``warp.init`` does nothing for that time either, and warp initialises itself
    in each engine at its first use. physicsnemo, seeing no GPU, then leaves its patches to the preload
    (``register_custom_ops()``), as on a CPU host.
    """
    import torch

    device_count = torch._C._cuda_getDeviceCount
    torch._C._cuda_getDeviceCount = lambda: 0
    warp_inits = []
    if gpu_host:
        import warp
        import warp._src.context as warp_context

        for owner in (warp, warp_context):
            warp_inits.append((owner, owner.init))
            owner.init = lambda: None
    try:
        yield
    finally:
        torch._C._cuda_getDeviceCount = device_count
        for owner, init in warp_inits:
            owner.init = init


def _thread_count() -> int:
    """Native threads of this process (a fork copies only the calling one: others' locks stay held)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return -1


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


# Modules an ipyparallel engine imports only once it starts (its kernel's debugger, the shell's history and
# extensions): the preload imports them so that each forked engine finds them loaded.
ENGINE_LAZY_IMPORTS = ("ipykernel.debugger", "IPython.extensions.storemagic", "sqlite3", "pydoc", "tornado.queues",
                       "tornado.locks", "xmlrpc.server")


def _preload(config: dict) -> dict:
    """Import what every engine needs. Returns facts for the client (GPU count, patch mode, timings)."""
    facts: dict = {"pid": os.getpid(), "python": sys.version.split()[0]}
    t0 = time.perf_counter()
    if config.get("preload") is False:
        # engines started by another launcher (mpiexec, ssh, Slurm) import the stack themselves: this process
        # only keeps the controller under its lifeline
        facts.update(preload="none", t_preload_s=time.perf_counter() - t0, cuda_initialized=False)
        return facts
    gpu_host = _nvidia_device_present()
    probe = GpuCountProbe() if gpu_host else None
    if gpu_host and os.environ.get("SHARDDBG_GPU_PRELOAD") == "light":
        # SHARDDBG_GPU_PRELOAD=light: each engine imports the heavy stack itself after the fork (the way
        # before the preload below was measured safe on GPU hosts: bench/RESULTS.md).
        facts["preload"] = "light"
    else:
        import torch

        with _keep_cuda_uninitialised(gpu_host=gpu_host):
            torch.set_num_threads(int(config.get("threads_per_rank") or 1))
            facts["torch"] = str(torch.__version__)
            facts.setdefault("cuda_count", 0)
            facts["t_torch_s"] = time.perf_counter() - t0
            facts["preload"] = "full"
            from sharddbg.engine import bootstrap

            t1 = time.perf_counter()
            facts.update(bootstrap.import_physicsnemo(register_on_cpu=True))
            facts["t_physicsnemo_s"] = time.perf_counter() - t1
            facts["threads_after_preload"] = _thread_count()
    # The engine machinery itself (ipykernel, zmq bindings, ipyparallel) is pure import cost too.
    t2 = time.perf_counter()
    import ipykernel.ipkernel  # noqa: F401
    import ipyparallel.engine.app  # noqa: F401

    # what an engine imports while it registers (ipykernel's debugger pulls in debugpy: ~0.4 s): once here,
    # not in every engine at every start and restart. debugpy's import warns about frozen modules on stderr.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    for name in ENGINE_LAZY_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    facts["t_ipyparallel_s"] = time.perf_counter() - t2
    if probe is not None:
        t3 = time.perf_counter()
        facts["cuda_count"] = probe.result()
        facts["t_gpu_count_s"] = probe.seconds  # the probe's own time, overlapped with the imports above
        facts["t_gpu_count_wait_s"] = time.perf_counter() - t3  # what the preload still waited for it
    # What the preload made lives as long as every engine forked from here: kept out of the cyclic collector's
    # walks (the permanent generation, which forked engines inherit). Else each collection of an engine's oldest
    # generation walks these ~950,000 objects: 0.5 s, in the middle of a traced cell or of formatting its records.
    # (No collection first: it would cost as much, once, for the little garbage the imports left.)
    gc.freeze()
    facts["t_preload_s"] = time.perf_counter() - t0
    facts["cuda_initialized"] = _cuda_initialized()
    return facts


class _Controller:
    """The ipyparallel controller this process started: leader of its own session and process group,
    which its children (the heart monitor) share."""

    __slots__ = ("group", "proc", "returncode")

    def __init__(self, argv: list[str], log_path: str, env: dict):
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(log, 0o600)
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                start_new_session=True,  # its own group: one signal reaches its children; Ctrl-C does not
                umask=0o077,  # its connection files, logs and profile folders: this user's only
            )
        finally:
            os.close(log)
        self.group = self.proc.pid
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Whether it has ended, without reaping it: while it is unreaped its group id cannot be reused."""
        if self.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill_group(self, sig) -> None:
        if self.returncode is None:  # once reaped, the group id may belong to someone else
            try:
                os.killpg(self.group, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self) -> int:
        """After it exited: kill what is left of its group, then collect its exit (a Popen return code)."""
        if self.returncode is None:
            self.kill_group(signal.SIGKILL)
            self.returncode = self.proc.wait()
        return self.returncode

    def end(self, grace_s: float = CONTROLLER_GRACE_S) -> int:
        """SIGTERM to its group, SIGKILL to what is left after ``grace_s``; returns its exit."""
        self.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.reap()


class _OwnerWatch:
    """During the preload only: a thread that ends the controller, and this process, the moment the
    owner's end of stdin closes. Stopped before the first fork, so that the process forks single-threaded."""

    def __init__(self, stdin_fd: int, on_owner_gone):
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, args=(stdin_fd, on_owner_gone),
                                        name="sharddbg-owner-watch", daemon=True)
        self._thread.start()

    def _watch(self, stdin_fd: int, on_owner_gone) -> None:
        poller = select.poll()
        poller.register(stdin_fd, 0)  # hang-up only: commands stay in the pipe for the command loop
        poller.register(self._stop_r, select.POLLIN)
        while True:
            for fd, events in poller.poll():
                if fd == self._stop_r:
                    return
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    on_owner_gone()

    def stop(self) -> None:
        os.write(self._stop_w, b".")
        self._thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)


def _run_engine(rank: int, engine_argv: list[str], env: dict, log_path: str, close_fds: list[int],
                owner: dict | None = None, cluster_id: str | None = None) -> None:
    """In the forked child: become rank ``rank``'s ipyparallel engine (ending the cluster when ``owner`` is
    gone). Never returns."""
    code = 0
    try:
        os.setpgid(0, 0)  # own process group: a signal to the zygote's group does not hit engines
        signal.set_wakeup_fd(-1)
        for fd in close_fds:
            os.close(fd)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(env)
        from sharddbg.engine import bootstrap

        bootstrap.on_fork(rank)
        if owner and cluster_id:
            end_cluster_when_owner_gone(owner, cluster_id)
        from ipyparallel.engine.app import IPEngine

        IPEngine.launch_instance(argv=engine_argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Skip interpreter teardown (atexit of torch/physicsnemo): it takes seconds and helps no one.
            os._exit(code)


def _kill(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_engines(pids, sig) -> None:
    """``sig`` to each engine's process group (it leads one, with the processes its cells started), or to the
    engine alone in the moment after its fork, before it made its group. Only engines not yet reaped are
    given: while a leader is unreaped its group id cannot belong to anyone else."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            _kill([pid], sig)


def end_cluster_when_owner_gone(owner: dict, cluster_id: str) -> None:
    """In an engine: a thread that ends the whole cluster once its owner is gone, for when the fork server (whose
    lifeline would do it) was killed with it. The cluster's record names the processes (``registry``); it is
    left for the next start's reaping, as the fork server leaves it."""

    def owner_alive() -> bool:
        import psutil

        try:
            proc = psutil.Process(owner["pid"])
            return abs(proc.create_time() - owner["create_time"]) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True  # not ours to judge

    def watch() -> None:
        while owner_alive():
            time.sleep(OWNER_POLL_S)
        try:
            from sharddbg.cluster import registry

            record = registry.ClusterRecord.load(registry.clusters_dir() / f"{cluster_id}.json")
            registry.kill_processes(record.live_processes())  # every process of it but this one
        except BaseException:  # noqa: BLE001 - no record (stopped meanwhile): nothing else to end
            traceback.print_exc()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="sharddbg-owner-gone", daemon=True).start()


class _ForkServer:
    """The command loop's state: the controller, the engines (pid -> rank), the reply channel."""

    def __init__(self, config: dict, out):
        self.config = config
        self.out = out
        self.controller: _Controller | None = None
        self.engines: dict[int, int] = {}
        self._wake_r, self._wake_w = os.pipe()

    # ------------------------------------------------------------------ controller
    def start_controller(self) -> None:
        spec = self.config["controller"]
        if self.controller is not None and not self.controller.exited():
            _reply(self.out, event="error", message=f"the controller (pid {self.controller.pid}) still runs")
            return
        try:
            self.controller = _Controller(spec["argv"], spec["log"], spec.get("env", {}))
        except OSError as exc:
            _reply(self.out, event="error", message=f"the controller could not start: {type(exc).__name__}: {exc}")
            return
        _reply(self.out, event="controller_started", pid=self.controller.pid, group=self.controller.group)

    def stop_controller(self) -> None:
        ctl, self.controller = self.controller, None
        if ctl is None:
            _reply(self.out, event="controller_stopped", pid=None, returncode=None, already_exited=True)
            return
        already_exited = ctl.returncode is not None or ctl.exited()
        returncode = ctl.end()
        _reply(self.out, event="controller_stopped", pid=ctl.pid, returncode=returncode, already_exited=already_exited)

    def end_everything(self) -> None:
        _kill_engines(list(self.engines), signal.SIGKILL)
        if self.controller is not None:
            self.controller.end()

    # ------------------------------------------------------------------ exits
    def report_exits(self) -> None:
        """Reap what ended (engines; the controller after its group is killed) and tell the owner how."""
        ctl = self.controller
        if ctl is not None and ctl.returncode is None and ctl.exited():
            _reply(self.out, event="exited", role="controller", pid=ctl.pid, rank=None, returncode=ctl.reap())
        for pid in list(self.engines):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                rank = self.engines.pop(pid)
                _reply(self.out, event="exited", role="engine", pid=pid, rank=rank,
                       returncode=os.waitstatus_to_exitcode(status))

    # ------------------------------------------------------------------ engines
    def fork(self, cmd: dict) -> None:
        if _cuda_initialized():
            _reply(self.out, event="error", message="CUDA is initialised in the fork server: engines forked from "
                   "it could not use CUDA ('Cannot re-initialize CUDA in forked subprocess'); nothing forked")
            return
        pids = {}
        for rank in cmd["ranks"]:
            argv = list(cmd["engine_argv"]) + [f"--IPEngine.id={rank}"]
            log_path = os.path.join(cmd["log_dir"], f"engine-rank{rank}.log")
            pid = os.fork()
            if pid == 0:
                _run_engine(rank, argv, cmd.get("env", {}), log_path, [self._wake_r, self._wake_w],
                            self.config.get("owner"), self.config.get("cluster_id"))
            self.engines[pid] = rank
            pids[rank] = pid
        _reply(self.out, event="forked", pids=pids, cuda_initialized=_cuda_initialized())

    def kill_engines(self) -> None:
        victims = list(self.engines)
        _kill_engines(victims, signal.SIGKILL)
        for pid in victims:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            self.engines.pop(pid, None)
        _reply(self.out, event="killed", pids=victims)

    # ------------------------------------------------------------------ loop
    def serve(self, stdin_fd: int, buffer: bytes) -> None:
        """Answer commands until the owner says exit or goes away. A child's exit wakes the loop at once."""
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears SIGCHLD
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self.report_exits()  # what ended during the preload
        while True:
            readable, _, _ = select.select([stdin_fd, self._wake_r], [], [], 1.0)
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            self.report_exits()
            if stdin_fd not in readable:
                continue
            chunk = os.read(stdin_fd, 65536)
            if not chunk:
                return  # the owner is gone
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip() and not self.handle(json.loads(line)):
                    return

    def handle(self, cmd: dict) -> bool:
        """One command; False for exit."""
        kind = cmd.get("cmd")
        if kind == "fork":
            self.fork(cmd)
        elif kind == "kill_engines":
            self.kill_engines()
        elif kind == "start_controller":
            self.start_controller()
        elif kind == "stop_controller":
            self.stop_controller()
        elif kind == "exit":
            return False
        else:
            _reply(self.out, event="error", message=f"unknown command {kind!r}")
        return True


def main() -> None:
    config = json.loads(sys.argv[-1])
    out = sys.stdout
    # Our own prints (warp's CUDA warning, physicsnemo's) must not corrupt the JSON channel.
    sys.stdout = sys.stderr
    server = _ForkServer(config, out)
    try:
        if config.get("controller"):
            server.start_controller()

        def owner_gone():
            server.end_everything()
            os._exit(0)

        watch = _OwnerWatch(sys.stdin.fileno(), owner_gone)
        try:
            facts = _preload(config)
        except BaseException as exc:
            _reply(out, event="error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            return
        finally:
            watch.stop()
        _reply(out, event="ready", **facts)
        server.serve(sys.stdin.fileno(), b"")
    finally:
        server.end_everything()
        try:
            out.flush()
        except (BrokenPipeError, ValueError):
            pass
        # No interpreter teardown: with torch and physicsnemo loaded it takes seconds and frees nothing.
        os._exit(0)


if __name__ == "__main__":
    main()
