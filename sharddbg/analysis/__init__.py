"""Pure analyses over Trace DataFrames (no torch, no cluster): what Trace.get_*() delegate to."""

from .ops import errors, fallbacks, ops_frame, promotions

__all__ = ["ops_frame", "fallbacks", "errors", "promotions"]
