"""The fork server behind a sharddbg cluster: import the heavy stack once, then fork one engine per rank.

Run as ``python -m sharddbg.cluster._zygote CONFIG_JSON`` by :mod:`sharddbg.cluster.launcher`. It talks
JSON lines: commands on stdin, replies on stdout. Why a fork server: importing torch + physicsnemo and
running physicsnemo's ``register_custom_ops()`` costs seconds of CPU per process; four engines doing it at
once on a 2-core laptop take four times as long as one process doing it and forking.

Fork safety: the process stays single-threaded (no torch compute, no zmq context, no CUDA init) until it
forks. On a CUDA host the CUDA libraries start native threads at import, so there only ipyparallel is
preloaded and each engine imports torch and physicsnemo after the fork.

When its stdin closes (the client process ended, even by SIGKILL) it kills its engines and the processes
it was told to adopt (the controller), so a killed notebook kernel leaves nothing behind.
"""

from __future__ import annotations

import glob
import json
import os
import select
import subprocess
import signal
import sys
import time
import traceback


def _reply(out, **payload) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


def _nvidia_device_present() -> bool:
    """Device nodes, not a CUDA call: nothing here may start driver threads in a process that forks."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _count_gpus_in_subprocess() -> int:
    probe = "import torch; print(torch.cuda.device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except Exception:
        return 0


def _preload(config: dict) -> dict:
    """Import what every engine needs. Returns facts for the client (GPU count, patch mode, timings)."""
    facts: dict = {"pid": os.getpid(), "python": sys.version.split()[0]}
    t0 = time.perf_counter()
    if _nvidia_device_present():
        # A CUDA host: torch, warp and the CUDA libraries start native threads at import, and forking a
        # multi-threaded process can deadlock the child. Count GPUs in a throw-away process and let
        # each engine import the heavy stack itself after the fork (GPU hosts have the cores for it).
        facts["cuda_count"] = _count_gpus_in_subprocess()
        facts["preload"] = "light"
    else:
        import torch

        torch.set_num_threads(int(config.get("threads_per_rank") or 1))
        facts["torch"] = torch.__version__
        facts["cuda_count"] = 0
        facts["t_torch_s"] = time.perf_counter() - t0
        facts["preload"] = "full"
        from sharddbg.engine import bootstrap

        t1 = time.perf_counter()
        facts.update(bootstrap.import_physicsnemo(register_on_cpu=True))
        facts["t_physicsnemo_s"] = time.perf_counter() - t1
    # The engine machinery itself (ipykernel, zmq bindings, ipyparallel) is pure import cost too.
    t2 = time.perf_counter()
    import ipyparallel.engine.app  # noqa: F401
    import ipykernel.ipkernel  # noqa: F401

    facts["t_ipyparallel_s"] = time.perf_counter() - t2
    facts["t_preload_s"] = time.perf_counter() - t0
    return facts


def _run_engine(rank: int, engine_argv: list[str], env: dict, log_path: str) -> None:
    """In the forked child: become rank ``rank``'s ipyparallel engine. Never returns."""
    code = 0
    try:
        os.setpgid(0, 0)  # own process group: a signal to the zygote's group does not hit engines
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


def main() -> None:
    config = json.loads(sys.argv[1])
    out = sys.stdout
    # Our own prints (warp's CUDA warning, physicsnemo's) must not corrupt the JSON channel.
    sys.stdout = sys.stderr
    try:
        facts = _preload(config)
    except BaseException as exc:
        _reply(out, event="error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return
    _reply(out, event="ready", **facts)

    engines: dict[int, int] = {}  # pid -> rank
    adopted: set[int] = set()
    stdin_fd = sys.stdin.fileno()
    buffer = b""
    try:
        while True:
            readable, _, _ = select.select([stdin_fd], [], [], 0.5)
            # Reap exited engines so they do not linger as zombies.
            while engines:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                rank = engines.pop(pid, None)
                if rank is not None:
                    _reply(out, event="exited", rank=rank, pid=pid, status=status)
            if not readable:
                continue
            chunk = os.read(stdin_fd, 65536)
            if not chunk:
                break  # the client is gone
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                cmd = json.loads(line)
                kind = cmd.get("cmd")
                if kind == "fork":
                    pids = {}
                    for rank in cmd["ranks"]:
                        argv = list(cmd["engine_argv"]) + [f"--IPEngine.id={rank}"]
                        log_path = os.path.join(cmd["log_dir"], f"engine-rank{rank}.log")
                        pid = os.fork()
                        if pid == 0:
                            _run_engine(rank, argv, cmd.get("env", {}), log_path)
                        engines[pid] = rank
                        pids[rank] = pid
                    _reply(out, event="forked", pids=pids)
                elif kind == "adopt":
                    adopted.update(int(p) for p in cmd["pids"])
                    _reply(out, event="adopted", pids=sorted(adopted))
                elif kind == "kill_engines":
                    victims = list(engines)
                    _kill(victims, signal.SIGKILL)
                    for pid in victims:
                        try:
                            os.waitpid(pid, 0)
                        except ChildProcessError:
                            pass
                        engines.pop(pid, None)
                    _reply(out, event="killed", pids=victims)
                elif kind == "exit":
                    return
                else:
                    _reply(out, event="error", message=f"unknown command {kind!r}")
    finally:
        _kill(list(engines), signal.SIGKILL)
        _kill(list(adopted), signal.SIGTERM)
        out.flush()
        # No interpreter teardown: with torch and physicsnemo loaded it takes seconds and frees nothing.
        os._exit(0)


if __name__ == "__main__":
    main()
