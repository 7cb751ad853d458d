"""The shard inspector's cluster side: every rank's snapshot of one tensor, put together.

``gather_layout(execution, mesh, name)`` asks each rank for ``sharddbg.engine.api.tensor_snapshot(name)``
(local reads only, no collective) and puts the snapshots together in a
:class:`sharddbg.analysis.layout.ShardLayout` (pure data: the checks and the block diagram). ``Cluster.inspect``
hands that to its view.
"""

from __future__ import annotations

from ..analysis.layout import ShardLayout
from ..engine import api as engine_api
from ..errors import InspectError
from . import arguments
from .execution import RankExecution
from .mesh import MeshSpec

__all__ = ["gather_layout", "gather_snapshots", "InspectError"]


def gather_snapshots(execution: RankExecution, name: str, timeout: float | None = None) -> list[dict]:
    """Every rank's snapshot of ``name``, in rank order (no communication between ranks)."""
    if not isinstance(name, str) or not all(part.isidentifier()
                                            for part in arguments.variable_name(name).split(".")):
        raise InspectError(f"inspect() takes the name of a variable on the ranks (e.g. 'x' or 'model.weight'), "
                           f"got {name!r}")
    # as Python binds names (and attributes): µ is stored as μ
    return execution.apply(engine_api.tensor_snapshot, (arguments.variable_name(name),), {}, execution.ranks(None),
                           timeout)


def gather_layout(execution: RankExecution, mesh: MeshSpec, name: str, timeout: float | None = None) -> ShardLayout:
    """The ShardLayout of the tensor named ``name`` on every rank, on the cluster's ``mesh``."""
    return ShardLayout(gather_snapshots(execution, name, timeout=timeout), world_mesh=mesh.as_dict())
