"""torch.distributed on the ranks of one cluster: the process group and the ("ddp", "domain") mesh.

``DistributedGroup`` holds what the group was built with (mesh, backend, collective timeout) and what each
rank said when it came up (``statuses``: ``engine.api.status`` rows). It brings the group up on fresh
engines and rebuilds it on the same engines (after a hang, or with another mesh of the same ranks). It works
through the ``RankExecution`` it is handed and reaches nothing else; ``status_table`` is what
``Cluster.status()`` shows.
"""

from __future__ import annotations

import time

import pandas as pd

from ..engine import api
from ..errors import ClusterError, ShardDbgError
from .execution import BrokenGroup, RankExecution
from ..analysis.hang import ranks_words
from .mesh import MeshSpec
from .processes import free_port


STATUS_COLUMNS = ["rank", "pid", "host", "device", "backend", "ddp", "domain", "patch_mode", "n_patches",
                  "torch", "physicsnemo", "python", "state", "process_group", "engine_id", "dist_initialized",
                  "patch_reason", "collective_timeout_s", "threads"]
# what status() shows by default: the table fits a notebook or terminal without wrapping
STATUS_BRIEF = ("rank", "pid", "device", "backend", "ddp", "domain", "patch_mode", "state", "process_group")


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

    def bring_up(self, execution: RankExecution, backend: str, timeout: float, mesh: MeshSpec | None = None) -> float:
        """Every rank joins torch.distributed on a fresh port with ``backend``, builds ``mesh`` (default: the
        group's) and fills physicsnemo's manager; the group's mesh is ``mesh`` once every rank is up. Returns the
        seconds it took."""
        t0 = time.perf_counter()
        mesh = self.mesh if mesh is None else mesh
        use_cuda = backend == "nccl"
        self.statuses = execution.call(
            api.init_rank, world_size=mesh.size, mesh_shape=mesh.shape, backend=backend, master_port=free_port(),
            collective_timeout_s=self.collective_timeout, use_cuda=use_cuda, timeout=timeout,
            what="torch.distributed start-up")
        self.mesh, self.backend, self.use_cuda = mesh, backend, use_cuda
        return time.perf_counter() - t0

    def rebuild(self, execution: RankExecution, mesh: MeshSpec, timeout: float) -> float:
        """Release ranks blocked in a collective, tear the process group down on every rank and bring it up
        again with ``mesh`` (the same ranks). Tensors built on the old group must be rebuilt. Returns the
        seconds the new group took to come up."""
        dead = execution.processes.dead_ranks()
        if dead:
            raise ClusterError(execution.dead_message(dead))
        execution.refuse_lost(range(execution.n))
        busy = execution.busy_ranks()
        if busy:
            execution.release_blocked(busy, timeout)
        execution.forget_stuck()
        execution.call(api.teardown, timeout=timeout, what="process-group teardown")
        try:
            took = self.bring_up(execution, self.backend, timeout, mesh)
        except ShardDbgError as exc:
            # the old group is gone and the new one is not up: nothing may run until a rebuild succeeds
            execution.broken = BrokenGroup(f"rebuilding the process group with mesh {mesh}: "
                                           f"{str(exc).splitlines()[0]}")
            raise
        execution.group_recovered()
        return took

    def status_table(self, execution: RankExecution, full: bool = False, with_host: bool = False) -> pd.DataFrame:
        """One row per rank (index ``rank``): what each idle rank says now (``api.status``), what a busy or dead
        one said when the group last came up, with its ``state`` (idle / busy / dead and how) and the process
        group's health; ``STATUS_BRIEF`` columns (and ``host`` after ``pid`` with ``with_host``: engines a
        launcher started may run on several hosts), or with ``full`` every one of ``STATUS_COLUMNS``."""
        execution.check_controller()
        dead = execution.processes.dead_ranks()
        lost = execution.lost_ranks()
        busy = execution.busy_ranks()
        idle = [r for r in range(execution.n) if r not in busy and r not in dead and r not in lost]
        fresh = dict(zip(idle, execution.call(api.status, ranks=idle, what="status()"))) if idle else {}
        broken = execution.broken
        # a rank that answered without torch.distributed (destroy_process_group in a cell) breaks the group too
        torn_down = sorted(r for r, row in fresh.items() if not row.get("dist_initialized", True))
        if broken is not None:
            group_state = f"broken at {broken.cause}"
        elif torn_down:
            group_state = (f"broken: torch.distributed is not initialized on {ranks_words(torn_down)} (its process "
                           f"group was destroyed there); cl.recover() brings it up again")
        else:
            group_state = "ok"
        rows = []
        for rank in range(execution.n):
            known = self.statuses[rank] if rank < len(self.statuses) else {"rank": rank}
            row = dict(fresh.get(rank) or known)
            row["engine_id"] = execution.engine_ids[rank]
            row["state"] = (f"dead: {dead[rank]}" if rank in dead else
                            f"lost: it stopped answering ipyparallel's heartbeat and was unregistered; its process "
                            f"is {lost[rank]}; cl.restart() replaces it" if rank in lost else
                            "busy" if rank in busy else "idle")
            row["process_group"] = group_state
            rows.append(row)
        frame = pd.DataFrame(rows)
        shown = STATUS_COLUMNS if full else STATUS_BRIEF[:2] + ("host",) * with_host + STATUS_BRIEF[2:]
        # every column, also one no row could fill (ranks busy, dead or lost since before the group came up)
        return frame.reindex(columns=list(shown)).set_index("rank")
