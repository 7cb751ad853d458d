"""What this process is as a rank: its number, the world, the mesh, the backend, how its patches were set up.

One record per process. The set-up (``bootstrap``) and the fork server fill it; everything else on the
rank (recorder, scatter, diagnosis, tensor snapshots) reads it here, so no module asks torch.distributed,
an environment variable or another module's globals for the same fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PatchFacts:
    """How ShardTensor's patches were set up on this process (filled once, by ``import_physicsnemo``)."""

    physicsnemo: str | None = None  # its version; None: not imported yet
    patch_mode: str | None = None  # registered-by-physicsnemo | registered-by-sharddbg | none
    patch_reason: str = ""
    n_patches: int = 0


@dataclass
class RankState:
    """This rank's set-up. ``rank`` is known from the fork (before torch.distributed exists)."""

    rank: int | None = None
    world_size: int | None = None
    mesh_shape: tuple[int, int] | None = None  # (ddp, domain)
    backend: str | None = None
    device: str | None = None
    mesh: Any = None  # the ("ddp", "domain") DeviceMesh
    collective_timeout_s: float | None = None
    dist_inits: int = 0  # how many times torch.distributed was set up in this process
    # when the current process group was made (time.time_ns(), the Flight Recorder's clock): the recorder's
    # buffer outlives a destroyed group, whose entries (made before) carry the same group names
    group_created_ns: int = 0
    store_listener: Any = None  # the rendezvous store's socket on rank 0 (kept open with the store)
    patches: PatchFacts | None = None  # None until physicsnemo was imported by the set-up


STATE = RankState()


def rank_and_world() -> tuple[int, int]:
    """This process's global rank and world size.

    torch.distributed's answer while a process group is up; else what the fork server told this
    process; else (0, 1), a single process.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:
        pass
    if STATE.rank is not None:
        return STATE.rank, STATE.world_size or 1
    return 0, 1


def current_rank() -> int:
    """This process's global rank (see :func:`rank_and_world`)."""
    return rank_and_world()[0]
