"""torch.distributed on the ranks of one cluster: the process group and the ("ddp", "domain") mesh.

``DistributedGroup`` holds what the group was built with (mesh, backend, collective timeout) and what each
rank said when it came up (``statuses``: ``engine.api.status`` rows). It brings the group up on fresh
engines and rebuilds it on the same engines (after a hang, or with another mesh of the same ranks). It works
through the ``RankExecution`` it is handed and reaches nothing else.
"""

from __future__ import annotations

import time

from ..engine import api
from ..errors import ClusterError
from .execution import RankExecution
from .mesh import MeshSpec
from .processes import free_port


class DistributedGroup:
    """The process group of one cluster: its mesh, backend and collective timeout, and each rank's status when
    it came up."""

    def __init__(self, mesh: MeshSpec, collective_timeout: float):
        self.mesh = mesh
        self.collective_timeout = collective_timeout
        self.backend: str | None = None  # chosen at start: gloo, or nccl where GPUs are
        self.use_cuda = False
        self.statuses: list[dict] = []  # each rank's status() row when torch.distributed last came up

    @property
    def patch_mode(self) -> str | None:
        """How ShardTensor's patches were set up at the last start (rank 0's answer)."""
        return self.statuses[0].get("patch_mode") if self.statuses else None

    def bring_up(self, execution: RankExecution, backend: str, timeout: float) -> float:
        """Every rank joins torch.distributed on a fresh port with ``backend``, builds the mesh and fills
        physicsnemo's manager. Returns the seconds it took."""
        t0 = time.perf_counter()
        self.backend = backend
        self.use_cuda = backend == "nccl"
        self.statuses = execution.call(
            api.init_rank, world_size=self.mesh.size, mesh_shape=self.mesh.shape, backend=backend,
            master_port=free_port(), collective_timeout_s=self.collective_timeout, use_cuda=self.use_cuda,
            timeout=timeout, what="torch.distributed start-up")
        return time.perf_counter() - t0

    def rebuild(self, execution: RankExecution, mesh: MeshSpec, timeout: float) -> float:
        """Release ranks blocked in a collective, tear the process group down on every rank and bring it up
        again with ``mesh`` (the same ranks). Tensors built on the old group must be rebuilt. Returns the
        seconds the new group took to come up."""
        dead = execution.processes.dead_ranks()
        if dead:
            raise ClusterError(execution.dead_message(dead))
        busy = execution.busy_ranks()
        if busy:
            execution.release_blocked(busy, timeout)
        execution.forget_stuck()
        execution.call(api.teardown, timeout=timeout, what="process-group teardown")
        self.mesh = mesh
        took = self.bring_up(execution, self.backend, timeout)
        execution.group_recovered()
        return took
