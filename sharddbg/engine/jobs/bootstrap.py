"""Where each process of a recorded job decides what it is (see the package docstring): called by
``site/sitecustomize.py`` at interpreter start."""

from __future__ import annotations

import os

from .settings import ENV_CLAIMED, JobSettings


def start_from_environment() -> str:
    """Start what this process does in the recorded job; returns its role: "rank" (it records), "agent"
    (torchrun's agent: it notes how workers end), "none" (not part of a recorded job, or a process started by
    one that records)."""
    settings = JobSettings.from_env()
    if settings is None or os.environ.get(ENV_CLAIMED):
        return "none"
    # each process tells what it is itself: the command may be a script that starts torchrun somewhere inside
    if "RANK" not in os.environ and is_torchrun_agent():
        from . import agent

        agent.install(settings)
        return "agent"
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    os.environ[ENV_CLAIMED] = str(os.getpid())  # inherited: the processes this one starts do not record
    from . import worker

    try:
        worker.start(settings, rank, world_size, local_rank)
    except OSError as e:  # its stream cannot be made: the job runs unrecorded, and says so
        import sys

        print(f"sharddbg: recording stopped on rank {rank}: cannot write its stream in {settings.out} ({e}); the job "
              f"goes on unrecorded", file=sys.stderr, flush=True)
    return "rank"


def is_torchrun_agent(argv: list[str] | None = None) -> bool:
    """This process runs torchrun (its console script, or ``python -m torch.distributed.run`` / ``.launch``):
    read from the command line it was started with (``sys.orig_argv``: ``sys.argv`` is not set yet when
    sitecustomize runs)."""
    import sys

    argv = list(getattr(sys, "orig_argv", None) or sys.argv) if argv is None else argv
    if any(os.path.basename(word) == "torchrun" for word in argv[:2]):
        return True
    if "-m" in argv[:3]:
        module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
        return module in ("torch.distributed.run", "torch.distributed.launch")
    return False
