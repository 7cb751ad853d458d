"""Pure analyses over Trace DataFrames and inspector snapshots (no torch, no cluster, no plotting).

``ops`` and ``comm``: what ``Trace.get_*()`` delegate to; ``timeline``: the timeline's spans and
overview bins; ``layout``: ``ShardLayout``, the shard inspector's data; ``formatting``: sizes, shapes
and JSON values as every view and file writes them.
"""

from .comm import NO_OP, collective_mismatches, collectives_frame, comm_by_op, comm_by_op_kind, imbalance
from .ops import errors, fallbacks, is_fallback, ops_frame, promotions

__all__ = ["ops_frame", "fallbacks", "errors", "promotions", "is_fallback", "collectives_frame", "comm_by_op",
           "comm_by_op_kind", "imbalance", "collective_mismatches", "NO_OP"]
