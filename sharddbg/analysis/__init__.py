"""Pure analyses over Trace DataFrames, inspector snapshots and what the ranks answered (no torch, no cluster,
no plotting).

``ops``, ``comm``, ``summary`` (the op summary), ``consistency`` (spec mismatches, replica divergence,
collective pre-flight) and ``plan_cache`` (DTensor's redistribution plan cache): what ``Trace.get_*()``
delegate to; ``findings``: what a trace says is wrong, as one ordered list of typed findings every front end
renders; ``timeline``: the timeline's spans and overview bins; ``layout``: ``ShardLayout``, the shard
inspector's data; ``check``, ``doctor``, ``smoke``, ``replica_check``: the results of the cluster's verifications
(they hold data; their views come through ``sharddbg.rendering``); ``formatting``: sizes, shapes and JSON values
as every view and file writes them.
"""

from .comm import (NO_OP, collective_mismatches, collectives_frame, comm_by_op, comm_by_op_kind, comm_by_peer,
                   comm_by_rank, imbalance)
from .consistency import preflight_frame, replica_divergence, replicas_frame, spec_mismatches
from .findings import Finding, TraceOverview, plan_cache_finding, trace_findings, trace_overview
from .ops import errors, fallbacks, is_fallback, is_metadata_op, ops_frame, promotions, took_fallback_path
from .plan_cache import plan_cache_frame, plan_cache_growth
from .summary import op_summary

__all__ = ["ops_frame", "fallbacks", "errors", "promotions", "is_fallback", "is_metadata_op", "took_fallback_path",
           "collectives_frame", "comm_by_op", "comm_by_op_kind", "comm_by_rank", "comm_by_peer", "imbalance",
           "collective_mismatches", "op_summary", "NO_OP", "spec_mismatches", "replicas_frame", "replica_divergence",
           "preflight_frame", "plan_cache_frame", "plan_cache_growth", "plan_cache_finding", "Finding",
           "TraceOverview", "trace_findings", "trace_overview"]
