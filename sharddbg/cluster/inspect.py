"""The shard inspector's cluster side: gather every rank's snapshot of one tensor, build the widget.

``inspect_tensor(cluster, name)`` asks each rank for ``sharddbg.engine.api.tensor_snapshot(name)``
(local reads only, no collective), puts the snapshots together in a
:class:`sharddbg.analysis.layout.ShardLayout` (pure data: the checks and the block diagram) and returns
the inspector widget (``sharddbg.views.inspector.ShardInspector``; its data is ``widget.shard_layout``).
"""

from __future__ import annotations

from ..analysis.layout import ShardLayout
from ..errors import InspectError
from ..engine import api as engine_api

__all__ = ["inspect_tensor", "gather_snapshots", "InspectError"]


def gather_snapshots(cluster, name: str, timeout: float | None = None) -> list[dict]:
    """Every rank's snapshot of ``name``, in rank order (no communication between ranks)."""
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise InspectError(f"inspect() takes the name of a variable on the ranks (e.g. 'x' or 'model.weight'), "
                           f"got {name!r}")
    return cluster.apply(engine_api.tensor_snapshot, name, timeout=timeout)


def inspect_tensor(cluster, name: str, timeout: float | None = None):
    """The shard inspector widget for the tensor named ``name`` on every rank of ``cluster``."""
    layout = ShardLayout(gather_snapshots(cluster, name, timeout=timeout), world_mesh=cluster.mesh.as_dict())
    from ..views.inspector import ShardInspector  # widgets load only when a widget is asked for

    return ShardInspector(layout)
