"""Pure analyses over Trace DataFrames (no torch, no cluster): what Trace.get_*() delegate to."""

from .comm import collective_mismatches, collectives_frame, comm_by_op, imbalance
from .ops import errors, fallbacks, ops_frame, promotions

__all__ = ["ops_frame", "fallbacks", "errors", "promotions", "collectives_frame", "comm_by_op", "imbalance",
           "collective_mismatches"]
