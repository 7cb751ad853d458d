"""The versioned records that cross from the ranks (engine/) to the client (trace.py, analysis/, views/).

This module is the ONLY contract between the two sides: everything an engine sends is a plain,
JSON-able dict described here, never a tensor or a live object. Bump ``SCHEMA_VERSION`` on any change
a reader must know about; readers refuse versions newer than theirs.

Records (``event["kind"]``)
---------------------------
``op``          one call of a ShardTensor op on one rank, forward (a ``__torch_function__`` /
                ``__torch_dispatch__`` call) or backward (the autograd node behind a recorded forward op's
                output). Fields: ``OP_FIELDS``.
``collective``  one collective call on one rank (functional collective, c10d collective, point-to-point
                send/recv, barrier), attributed to the recorded op that caused it (or to a DDP gradient
                bucket, ``DDP_BUCKET_OP``). Shares ``seq``
                numbering (assigned at issue), the ``t_*_ns`` clock and the ``phase``/``autograd_node``
                meaning with ``op``. Fields: ``COLLECTIVE_FIELDS`` (since schema version 2).
``error``       an exception that ended the cell on one rank, wherever it was raised (in a recorded op,
                or in the user's own code, which no op record shows). Fields: ``CELL_ERROR_FIELDS``
                (since schema version 3).
``meta``        a free-form marker, e.g. "cell started": ``kind``, ``seq``, ``name`` (str), ``t_ns`` (int,
                rank clock), ``data`` (JSON-able). Readers skip it; only ``kind`` and ``seq`` are checked.

All records carry ``kind`` and ``seq`` (per-rank, strictly increasing in start order, shared by all
kinds so that records of one rank interleave correctly). Times are ns on the rank's sharddbg clock
(``sharddbg.engine.clock``); the client subtracts the per-rank offset it measured. ``None`` means
"not measured" (e.g. ``device_ms`` on CPU) and becomes NaN in DataFrames.

Payload (what ``recorder.stop()`` / ``recorder.peek()`` return on one rank)::

    {"format": "sharddbg.payload", "schema_version": 5, "rank": 0, "world_size": 4,
     "complete": True,            # False for a snapshot of a recorder still running (e.g. a hung rank)
     "events": [...],             # records above, sorted by seq; a snapshot adds in-flight ops
     "dropped": 0,                # records not kept because the buffer (max_events) was full
     "clock": {"source": ..., "injected_offset_ns": ..., "t_start_ns": ..., "t_stop_ns": ...},
     "meta": {"torch": ..., "physicsnemo": ..., "patch_mode": "registered" | "fallback_only",
              "comm": True,       # collectives were recorded (recorder.start(comm=...)); since version 2
              "spec_check": True, "replicas": False, "preflight": False,   # what was verified; since version 5
              "memory": False,    # CUDA allocator deltas recorded (mem_delta_bytes); since version 5
              "plan_cache": {...} | None,  # DTensor's redistribution plan cache: PLAN_CACHE_FIELDS; since version 6
              ...}}

Optional fields (since version 5): a record carries ``spec_mismatches`` / ``replicas`` (op) or ``preflight``
(collective) only where there is something to say; absent means "nothing found" when the payload's meta says
that check ran (``spec_check``, ``replicas``, ``preflight``), else "not checked". Readers see None.
"""

from __future__ import annotations

from typing import Any

from .errors import SchemaError  # what the validators below raise (defined with the other errors)

# Version history
#   1  op and meta records; "collective" reserved, not emitted.
#   2  collective records defined, emitted by the recorder and validated; op records gain the path
#      "python_method" (ShardTensor.full_tensor / redistribute / backward / from_local, which bypass
#      __torch_function__). Otherwise op records are unchanged: version-1 payloads read as before.
#   3  error records (the exception that ended a cell on a rank); a collective's ``in_flight`` means "not
#      completed" (no wait for it returned while recording), no longer "its issuing call had not returned".
#      Version-1 and -2 payloads read as before.
#   4  where in the notebook: op records gain ``user_cell`` / ``user_code`` (the IPython cell and the text of
#      the user's line) and ``local_ms`` (CPU: the same function timed on plain tensors of the call's local
#      shapes); collective records gain ``params`` and ``bucket`` (the parameters a gradient reduction
#      carries, a DDP bucket's index) and, outside every recorded op, the user's line; error records gain
#      ``cell``. A collective's ``op`` may be ``DDP_BUCKET_OP``; its ``phase`` is "backward" also for a
#      parameter's gradient reduced after the backward pass (a deferred Partial gradient, a DDP bucket).
#      Older payloads read as before (the new fields read as None).
#   5  verification: op records may carry ``spec_mismatches`` (a ShardTensor result whose spec disagrees with
#      its local tensor) and ``replicas`` (digests of the tensors that claim Replicate, with
#      ``recorder.start(replicas=True)``); collective records may carry ``preflight`` (the group compared
#      shapes, dtypes and splits before issuing it, ``recorder.start(preflight=True)``). All three are
#      OPTIONAL_FIELDS, present only where there is something to say; meta says which checks ran.
#      Older payloads read as before.
#   6  meta gains ``plan_cache`` (PLAN_CACHE_FIELDS): DTensor's redistribution plan cache while recording, its
#      size at start and stop and the calls that missed it, grouped, with the spec fields that changed after
#      the call (a stale key: the next equal call misses again). None where this torch has no such cache.
#      Older payloads read as before (no plan_cache: not watched).
#   7  the meta a reader uses is named and typed: the payload's (PAYLOAD_META_FIELDS: the recording options,
#      written by the recorder from ``RecordingOptions``, the versions, the plan cache) and the trace file's
#      (TRACE_META_FIELDS: the code, the cluster, the clock, why ranks are incomplete, the replica differences
#      gathered). Both are validated; keys not named there are kept and read by nothing. Older payloads and
#      files read as before.
#   8  errors a cell handled are told from those that ended it: an op's ``error`` gains ``handled`` (False: the
#      exception, or one it was chained into, ended the cell; True: the user's code caught it and the cell went
#      on; None: not known yet, the cell was still running at the snapshot). A collective record gains
#      ``error`` (what its issuing call or its wait raised), and its ``in_flight`` means "neither completed nor
#      failed": a collective that raised is no longer counted as a hang. Older payloads read through
#      ``current_events``: ``handled`` is False where an error record says the exception ended the cell, else
#      None (not recorded); a collective's ``error`` is None (a failed one stays ``in_flight``).
#   9  plain DTensor ops are recorded: op records may carry the paths "dtensor_propagation" (a torch function
#      called with plain DTensor arguments, dispatched by DTensor's sharding propagation; the collectives it
#      issued are the redistributions its inputs needed) and "dtensor_redistribute" (DTensor.redistribute /
#      full_tensor called by the user's code); payload meta gains ``dtensor`` (RecordingOptions.dtensor) and,
#      for a recorded job, ``step`` markers are meta records named "step". Error records gain ``user_frame`` /
#      ``user_code``: the innermost frame of the user's code the exception went through (a script has no cell
#      line to name). Older payloads read as before (None).
SCHEMA_VERSION = 9
PAYLOAD_FORMAT = "sharddbg.payload"

KIND_OP = "op"
KIND_COLLECTIVE = "collective"
KIND_ERROR = "error"
KIND_META = "meta"
KINDS = (KIND_OP, KIND_COLLECTIVE, KIND_ERROR, KIND_META)

PHASES = ("forward", "backward")

# Dispatch paths, in ShardTensor's own decision order (see shard_tensor.py, __torch_function__ then
# __torch_dispatch__). compile_tracing is listed for completeness: the recorder records nothing while
# torch.compile traces, so it never appears in a trace.
PATHS = (
    "conversion",  # ShardTensor<->DTensor conversion in progress: the op runs plain
    "autograd_passthrough",  # register_hook, retain_grad, torch.autograd.grad, ...: run on the real tensor
    "function_handler",  # ShardTensor._function_registry[func]
    "named_handler",  # ShardTensor._named_function_registry[str(func)]
    "compile_tracing",  # FakeTensor operands: routed to aten
    "dtensor_fallback_function",  # _torch_function_fallback_via_dtensor
    "dispatch_handler",  # ShardTensor._dispatch_registry(_by_name)
    "dtensor_fallback_dispatch",  # _dispatch_fallback_via_dtensor
    # since schema 2: a ShardTensor Python method that bypasses __torch_function__ and may communicate
    # (full_tensor, redistribute, backward, from_local; PYTHON_METHODS in engine/recorder/ops.py)
    "python_method",
    # since schema 9: plain DTensor (not ShardTensor) calls made by the user's code (RecordingOptions.dtensor)
    "dtensor_propagation",  # a torch function with plain DTensor arguments: DTensor's sharding propagation ran it
    "dtensor_redistribute",  # DTensor.redistribute / DTensor.full_tensor called by the user's code
)
DTENSOR_PATHS = ("dtensor_propagation", "dtensor_redistribute")
FALLBACK_PATHS = ("dtensor_fallback_function", "dtensor_fallback_dispatch")

# the ``op`` of a collective that DistributedDataParallel's reducer issued for one gradient bucket (its
# ``params``: the bucket's parameters, ``bucket``: its index)
DDP_BUCKET_OP = "DDP gradient bucket"

# name -> (JSON types allowed, meaning). Order is the column order of Trace.get_ops() (after "rank").
OP_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), '"op"'),
    "seq": ((int,), "per-rank sequence number, in start order"),
    "parent_seq": ((int, type(None)), "seq of the enclosing recorded op on the same thread, or None"),
    "depth": ((int,), "nesting depth (0 = called by user code or the autograd engine)"),
    "op": ((str,), "the function, e.g. 'torch.conv2d', 'Tensor.add', 'aten.add.Tensor'"),
    "path": ((str,), "dispatch path, one of PATHS (backward events repeat their forward op's path)"),
    "handler": ((str, type(None)), "qualified name of the function that handled it (handler or fallback)"),
    "phase": ((str,), "'forward' or 'backward'"),
    "autograd_node": ((str, type(None)), "backward: name of the autograd node that ran"),
    "module": ((str, type(None)), "nn.Module path (relative to the outermost module) the op ran in"),
    "user_frame": ((str, type(None)), "'file:line in function' of the first frame outside torch/physicsnemo/sharddbg; "
                                      "'cell [n], line l in function' in a notebook cell"),
    "user_cell": ((int, type(None)), "the notebook cell (its execution count in the notebook, In[n]) that "
                                     "user_frame lies in; None for a frame in a file or code sent from a "
                                     "script (since version 4)"),
    "user_code": ((str, type(None)), "the text of user_frame's line (since version 4)"),
    "in_local_shapes": ((list,), "per tensor argument: the shape this rank holds"),
    "in_global_shapes": ((list,), "per tensor argument: the global shape (plain tensors: their shape)"),
    "out_local_shape": ((list, type(None)), "first tensor result: local shape"),
    "out_global_shape": ((list, type(None)), "first tensor result: global shape"),
    "placements": ((str, type(None)), "first distributed result's placements, e.g. '(Shard(dim=2),)'"),
    "dtype": ((str, type(None)), "first tensor result's dtype (else the first argument's)"),
    "sharding_shapes": ((dict, type(None)), "first result's _spec._sharding_shapes: {mesh_dim: [shape per rank]}"),
    "in_bytes": ((int,), "bytes of the local data of all tensor arguments on this rank"),
    "out_bytes": ((int,), "bytes of the local data of all tensor results on this rank"),
    "t_start_ns": ((int,), "start, rank clock"),
    "t_end_ns": ((int, type(None)), "end, rank clock (None: still running at snapshot time)"),
    "host_ms": ((float, int, type(None)), "wall time on the host, (t_end_ns - t_start_ns) / 1e6"),
    "device_ms": ((float, int, type(None)), "CUDA event time; None on CPU or not finished"),
    "mem_delta_bytes": ((int, type(None)), "CUDA allocator delta over the call (recorded with memory=True); None on CPU or without it"),
    "local_ms": ((float, int, type(None)), "CPU, forward calls of a top-level op: host time of the same function "
                                           "on plain tensors of this call's local shapes (other arguments left at "
                                           "their defaults), the least of a few runs after recording; None where "
                                           "not measured (since version 4)"),
    "error": ((dict, type(None)), "ERROR_FIELDS if the call raised, else None"),
    # beyond the columns get_ops() starts with
    "fwd_seq": ((int, type(None)), "backward: seq of the forward op this node belongs to"),
    "in_placements": ((list,), "per tensor argument: placements string, None for a plain tensor"),
    "fallback": ((bool,), "the DTensor fallback ran for this call (directly or from inside its handler)"),
    "promotions": ((list,), "PROMOTION_FIELDS for each plain tensor promoted to Replicate during the call"),
    "not_implemented": ((bool,), "the call returned NotImplemented (recorded, passed through)"),
    "in_flight": ((bool,), "the call had not returned when the snapshot was taken"),
    "thread": ((int,), "0 = the thread that started the recorder, 1.. = other threads (autograd, ...)"),
}

ERROR_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "exc_type": ((str,), "qualified exception class name"),
    "message": ((str,), "str(exception)"),
    "traceback": ((str,), "formatted traceback of the original exception"),
    "origin_seq": ((int,), "seq of the innermost op where this exception object was first seen"),
    "unmasked": ((bool,), "the recorder re-raised it as UnmaskedOpError (PyTorch would have hidden it)"),
    "handled": ((bool, type(None)), "False: this exception, or one it was chained into (raise ... from it, or "
                                    "raised while handling it), ended the cell; True: the user's code caught it "
                                    "and the cell went on (pytest.raises, try/except); None: not known, the cell "
                                    "was still running when the snapshot was taken (since version 8; older "
                                    "payloads: False where an error record says it ended the cell, else None)"),
}

PROMOTION_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "param": ((str, type(None)), "parameter/buffer name from the modules seen, else None"),
    "shape": ((list,), "shape of the plain tensor"),
    "dtype": ((str,), "its dtype"),
}

_INT_OR_NONE = (int, type(None))
_STR_OR_NONE = (str, type(None))
_LIST_OR_NONE = (list, type(None))

# Collective kinds (``coll``) the recorder emits; an unknown c10d op keeps its own name.
COLLECTIVE_KINDS = ("all_gather_into_tensor", "all_gather", "all_to_all_single", "all_to_all", "all_reduce",
                    "reduce_scatter_tensor", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
                    "send", "recv", "barrier", "all_gather_coalesced", "all_gather_into_tensor_coalesced",
                    "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")

COLLECTIVE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), '"collective"'),
    "seq": ((int,), "per-rank sequence number shared with op records, taken when the collective is issued"),
    "group_seq": ((int,), "k-th collective of this process group on this rank (0-based): lines up across ranks"),
    "coll": ((str,), "collective kind, one of COLLECTIVE_KINDS (shown as the 'kind' column of get_collectives)"),
    "aten_op": ((str,), "the dispatcher op seen, e.g. '_c10d_functional.all_to_all_single', 'c10d.send'"),
    "api": ((str,), "'functional' (funcol, completed by wait_tensor) or 'c10d' (torch.distributed, completed by Work.wait)"),
    "group_name": ((str,), "process group name (c10d group_name)"),
    "group_ranks": ((list, type(None)), "global ranks of the group, in group-rank order"),
    "group_size": (_INT_OR_NONE, "number of ranks in the group"),
    "mesh_dim": (_STR_OR_NONE, "name of the global mesh dim whose group this is ('ddp', 'domain'), else None"),
    "peer": (_INT_OR_NONE, "send/recv: global rank of the other side"),
    "root": (_INT_OR_NONE, "broadcast/reduce/gather/scatter: global rank of the root"),
    "bytes_sent": ((int,), "size of this rank's send buffer(s) in bytes, from the arguments (the part that stays "
                           "local included; all_to_all: sum of input splits; root-only sides count on the root)"),
    "bytes_recv": ((int,), "size of this rank's receive buffer(s) in bytes (all_gather: group_size x the, possibly "
                           "padded, input; all_to_all: sum of output splits)"),
    "splits_sent": (_LIST_OR_NONE, "all_to_all: bytes sent to each group rank, in group-rank order"),
    "splits_recv": (_LIST_OR_NONE, "all_to_all: bytes received from each group rank"),
    "dtype": (_STR_OR_NONE, "dtype of the first tensor argument"),
    "shape": (_LIST_OR_NONE, "shape of the first tensor argument (the input)"),
    "async": ((bool,), "completed by a later wait (funcol always; c10d when the caller passed async_op or p2p)"),
    "t_issue_ns": ((int,), "just before the collective op was issued, rank clock"),
    "t_return_ns": (_INT_OR_NONE, "when the issuing op returned (async work may still be running)"),
    "t_done_ns": (_INT_OR_NONE, "when its wait returned (wait_tensor / Work.wait, whichever op waited); None: "
                                "not waited while recording"),
    "wait_op_seq": (_INT_OR_NONE, "seq of the innermost recorded op running when the wait returned"),
    "waited": ((bool,), "a wait for it was seen while recording"),
    "op": (_STR_OR_NONE, "innermost recorded op on the stack at issue; in backward the forward op whose autograd node ran"),
    "op_seq": (_INT_OR_NONE, "seq of that op (in backward: of the forward op)"),
    "outer_op": (_STR_OR_NONE, "outermost (user-level) recorded op on the stack; in backward, of the forward op"),
    "outer_op_seq": (_INT_OR_NONE, "its seq"),
    "phase": ((str,), "'forward' or 'backward': an autograd node was running, or (since version 4) it reduces a "
                      "parameter's gradient after the backward pass (a deferred Partial gradient, a DDP bucket)"),
    "autograd_node": (_STR_OR_NONE, "backward: name of the autograd node that issued it"),
    "param": (_STR_OR_NONE, "weight-gradient reduction: name of the parameter the node accumulates into"),
    "params": (_LIST_OR_NONE, "gradient reduction: names of every parameter whose gradient it carries (a DDP "
                              "bucket: the bucket's parameters) (since version 4)"),
    "bucket": (_INT_OR_NONE, "DDP gradient bucket: the bucket's index in DDP's reducer (since version 4)"),
    "user_frame": (_STR_OR_NONE, "outside every recorded op: 'file:line in function' of the user's frame that "
                                 "issued it (since version 4)"),
    "user_cell": (_INT_OR_NONE, "the notebook cell (execution count in the notebook) of user_frame (since version 4)"),
    "user_code": (_STR_OR_NONE, "the text of user_frame's line (since version 4)"),
    "device_ms": ((float, int, type(None)), "CUDA event time from issue to wait; None on CPU or not finished"),
    "error": (_STR_OR_NONE, "'exc_type: message' of what its issuing call or its wait raised (a size gloo "
                            "refused at once, gloo's own timeout, a peer gone); None: nothing raised (since "
                            "version 8)"),
    "in_flight": ((bool,), "neither completed nor failed: no wait for it returned while recording and nothing "
                           "raised (still blocked when the snapshot was taken, or never waited); schema 3-7: not "
                           "completed, failed ones included; schema 1-2: the issuing call had not returned"),
    "thread": ((int,), "recorder thread id (0 = the thread that started the recorder)"),
}

CELL_ERROR_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "kind": ((str,), '"error"'),
    "seq": ((int,), "per-rank sequence number shared with the other records"),
    "t_ns": ((int,), "when the cell's exception was reported, rank clock"),
    "exc_type": ((str,), "qualified exception class name"),
    "message": ((str,), "str(exception), whole"),
    "traceback": ((str,), "formatted traceback, every frame"),
    "origin_seq": (_INT_OR_NONE, "seq of the recorded op where this exception was first seen; None: raised outside "
                                 "every recorded op (the op record carries the details when it is not None)"),
    "cell_line": (_INT_OR_NONE, "line of the cell (1-based) whose statement the exception went through"),
    "cell_code": (_STR_OR_NONE, "that line's source text"),
    "cell": (_INT_OR_NONE, "the notebook cell (execution count in the notebook) of that line (since version 4)"),
    "thread": ((int,), "recorder thread id"),
    "user_frame": (_STR_OR_NONE, "the innermost frame of the user's code the exception went through, 'file:line in "
                                 "function' (a script's, where there is no cell) or 'cell [n], line l in function' "
                                 "(since version 9)"),
    "user_code": (_STR_OR_NONE, "that frame's source line (since version 9)"),
}

# A ShardTensor result whose spec disagrees with its local tensor (op field ``spec_mismatches``, one per finding)
SPEC_MISMATCH_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "output": ((int,), "which tensor result of the op (0 = the first)"),
    "check": ((str,), "what disagrees, one of SPEC_CHECKS"),
    "mesh_dim": (_INT_OR_NONE, "the mesh dim of the sharding shapes concerned, else None"),
    "spec_shape": (_LIST_OR_NONE, "what the spec says this rank holds (its sharding shapes entry, or the shape "
                                  "the global shape implies), where it says one"),
    "local_shape": ((list,), "the shape of the local tensor this rank holds"),
    "global_shape": (_LIST_OR_NONE, "the spec's global shape"),
    "placements": (_STR_OR_NONE, "the spec's placements"),
    "detail": ((str,), "one line: 'spec says (313, 3), the local tensor is (313, 17, 3)'"),
}
SPEC_CHECKS = (
    "sharding_shapes",  # the spec's sharding shapes give this rank another shape than its local tensor
    "mesh_size",  # the sharding shapes of a mesh dim list another number of ranks than the mesh dim has
    "ndim",  # the global shape has another number of dims than the local tensor
    "global_shape",  # a dim's global size disagrees with the local tensor (whole dim) or the sharding shapes (sum)
)

# A tensor that claims Replicate, digested on one rank after an op (op field ``replicas``, one per tensor)
REPLICA_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "key": ((str,), "'<op>#<k>/<what>': names the same tensor on every rank (the k-th call of that op here)"),
    "what": ((str,), "'output 0', 'parameter conv1.weight' (promoted to Replicate, or a distributed parameter "
                     "claiming Replicate that a call read), 'argument 1' (promoted, not a known parameter)"),
    "digest": ((str,), "hash of the local tensor's bytes, shape and dtype"),
    "shape": ((list,), "the local tensor's shape"),
    "dtype": ((str,), "its dtype"),
    "group_ranks": ((list,), "the global ranks that must hold the same tensor (its Replicate mesh dims)"),
    "kept": ((bool,), "a copy is kept on the rank, so that the client can gather the values (max difference)"),
}

# What the ranks of a group found when they compared a collective before issuing it (collective field
# ``preflight``)
PREFLIGHT_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "status": ((str,), "one of PREFLIGHT_STATUSES"),
    "ms": ((float, int), "time the check took on this rank (waiting for the others included)"),
    "detail": (_STR_OR_NONE, "mismatch: what disagrees ('rank 2 sends (1, 4, 16, 64), the others (1, 4, 17, 64)'); "
                             "late / unchecked: why"),
    "late_ranks": ((list,), "ranks whose description had not arrived within the time limit"),
}
PREFLIGHT_STATUSES = (
    "ok",  # every rank of the group described the same collective, with matching sizes
    "mismatch",  # they disagree: the op raised CollectiveMismatchError and the collective was never issued
    # (its record stays, never completed; Trace.get_collectives() leaves it out)
    "late",  # some rank had not described it within the time limit: the collective was issued unchecked
    "unchecked",  # nothing to compare (point-to-point, a group whose ranks are unknown)
)

# Fields written only where there is something to say (since version 5): absent reads as None.
OPTIONAL_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {
    KIND_OP: {
        "spec_mismatches": ((list,), "SPEC_MISMATCH_FIELDS for each result whose spec disagrees with its local "
                                     "tensor (checked when meta spec_check is True)"),
        "replicas": ((list,), "REPLICA_FIELDS for each tensor that claims Replicate, digested after the op "
                              "(forward calls, when meta replicas is True)"),
    },
    KIND_COLLECTIVE: {
        "preflight": ((dict,), "PREFLIGHT_FIELDS: the group compared it before it was issued (calls inside a "
                               "recorded op, when meta preflight is True)"),
    },
    KIND_ERROR: {},
}

# Fields a record of an older payload may lack (it was written before they existed): name -> the first
# schema version that writes them. Readers see them as None.
FIELDS_SINCE: dict[str, dict[str, int]] = {
    KIND_OP: {"user_cell": 4, "user_code": 4, "local_ms": 4},
    KIND_COLLECTIVE: {"params": 4, "bucket": 4, "user_frame": 4, "user_cell": 4, "user_code": 4, "error": 8},
    KIND_ERROR: {"cell": 4, "user_frame": 9, "user_code": 9},
}
ERROR_FIELDS_SINCE: dict[str, int] = {"handled": 8}  # an op record's ``error``

# meta["plan_cache"] (since version 6)
PLAN_CACHE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "entries_start": ((int, type(None)), "entries in the cache when recording started"),
    "entries_end": ((int, type(None)), "entries when it stopped"),
    "misses": ((int,), "calls that missed the cache while recording (each added an entry)"),
    "stale_misses": ((int,), "misses whose spec changed after the call: that entry can never be hit again"),
    "clears": ((int,), "times the cache was seen emptied (cache_clear) while recording"),
    "groups": ((list,), "PLAN_CACHE_GROUP_FIELDS: the misses grouped, first seen first"),
}
PLAN_CACHE_GROUP_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "op": ((str, type(None)), "the innermost recorded op the calls were made in (None: outside every op)"),
    "outer_op": ((str, type(None)), "the outermost one (the user's call)"),
    "source": ((str,), "the source spec's placements"),
    "target": ((str,), "the target spec's placements"),
    "shape": ((list, type(None)), "the global shape the target spec held at the call"),
    "spec_type": ((str,), "the target spec's class (ShardTensorSpec, DTensorSpec)"),
    "changed": ((list,), "the compared spec fields that changed after the call ('target._sharding_shapes'); "
                         "empty: a first call, not stale"),
    "first_op_seq": ((int, type(None)), "seq of the op of the first such call"),
    "count": ((int,), "calls in this group"),
    "kept": ((int,), "of them, the calls whose entry was still in the cache when recording stopped"),
}

# The payload meta's keys a reader uses (named here since version 7). The recorder writes every one; a key
# absent (an older payload, one made by hand) reads as its default: nothing was checked, collectives were
# recorded. Other keys (host, handler counts, internal errors, ...) are written for people reading a
# payload and read by nothing.
PAYLOAD_META_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "torch": ((str,), "torch.__version__ on the rank"),
    "physicsnemo": ((str, type(None)), "physicsnemo's version on the rank (None: not importable)"),
    "max_events": ((int,), "RecordingOptions.max_events: events kept at most"),
    "unmask": ((bool,), "RecordingOptions.unmask"),
    "comm": ((bool,), "RecordingOptions.comm: collectives were recorded (written since version 2)"),
    "spec_check": ((bool,), "RecordingOptions.spec_check: results' specs were compared with their local tensors "
                            "(since version 5)"),
    "replicas": ((bool,), "RecordingOptions.replicas: what claims Replicate was digested (since version 5)"),
    "preflight": ((bool,), "RecordingOptions.preflight: collectives were compared across their group first "
                           "(since version 5)"),
    "memory": ((bool,), "RecordingOptions.memory: CUDA allocator deltas were recorded (since version 5)"),
    "dtensor": ((bool,), "RecordingOptions.dtensor: plain DTensor calls were recorded as ops (since version 9)"),
    "plan_cache": ((dict, type(None)), "PLAN_CACHE_FIELDS, or None where this torch has no such cache (since "
                                       "version 6)"),
}

# The trace file's meta (``Trace.meta``; since version 7 named here). Every key is optional (a trace built by
# hand has none); a key not named here is kept and read by nothing.
TRACE_META_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "code": ((str, type(None)), "the code the ranks ran under the recorder"),
    "wall_s": ((float, int, type(None)), "seconds from sending the code to the last rank finishing it"),
    "cluster_id": ((str, type(None)), "the cluster that recorded it"),
    "mesh": ((dict, type(None)), "its mesh: {'ddp': int, 'domain': int}"),
    "backend": ((str, type(None)), "its torch.distributed backend: 'gloo' or 'nccl'"),
    "clock_uncertainty_ns": ((dict, type(None)), "rank (as a string) -> half the round trip of its clock offset's "
                                                 "best sample, ns; 0 where the rank reads the client's own clock"),
    "failed": ((str, type(None)), "the first line of the error that ended the cell ('RankError: ...'), None when "
                                  "it did not fail"),
    "incomplete_reasons": ((dict, type(None)), "rank (as a string) -> why its recording is incomplete"),
    "replica_differences": ((list, type(None)), "REPLICA_DIFFERENCE_FIELDS for each tensor of the first op call "
                                                "whose replicas differ, gathered on the ranks (recorded with "
                                                "replicas=True)"),
    "smoke_config": ((str, type(None)), "the smoke matrix configuration whose step this is"),
    "interrupted": ((str, type(None)), "what Ctrl-C interrupted while the cell was traced ('the wait for the cell "
                                       "was interrupted (Ctrl-C) after 2.1 s; ranks [1] still ran it'), None "
                                       "when nothing was"),
}
REPLICA_DIFFERENCE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "key": ((str,), "the digest key (REPLICA_FIELDS key) of the tensor"),
    "group_ranks": ((list,), "the replica group's global ranks"),
    "reference_rank": ((int,), "the rank of the majority the others were compared with"),
    "by_rank": ((dict,), "rank (as a string) -> its largest absolute difference to the reference rank (None: "
                         "not comparable)"),
    "note": ((str, type(None)), "why values were not gathered, or what was odd about them"),
}

PAYLOAD_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "schema_version": (int,),
    "rank": (int,),
    "world_size": (int,),
    "complete": (bool,),
    "events": (list,),
    "dropped": (int,),
    "clock": (dict,),
    "meta": (dict,),
}


def _check_fields(rec: Any, fields: dict, what: str, optional: dict[str, int] | None = None,
                  version: int = SCHEMA_VERSION) -> None:
    """``optional``: fields first written by a later schema version than ``version`` may be absent."""
    if not isinstance(rec, dict):
        raise SchemaError(f"{what}: expected a dict, got {type(rec).__name__}")
    later = {k for k, since in (optional or {}).items() if since > version}
    missing = [k for k in fields if k not in rec and k not in later]
    if missing:
        raise SchemaError(f"{what}: missing field(s) {missing}")
    for k, (types, _doc) in fields.items():
        if k not in rec:
            continue
        v = rec[k]
        # bool is an int in Python; an int field holding True is still a bug worth catching.
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise SchemaError(f"{what}: field {k!r} = {v!r} has type {type(v).__name__}, expected {[t.__name__ for t in types]}")


def _check_present(rec: dict, fields: dict, what: str) -> None:
    """The keys of ``rec`` that ``fields`` names hold their types (absent ones are not looked for)."""
    _check_fields(rec, {k: fields[k] for k in fields if k in rec}, what)


def _plain_checks(kind: str, version: int) -> tuple[tuple[str, frozenset, bool], ...]:
    """(field, its exact types, may be absent) for each field of a record of ``kind`` as ``version`` writes it."""
    key = (kind, version)
    if key not in _PLAIN_CHECKS:
        fields = {KIND_OP: OP_FIELDS, KIND_COLLECTIVE: COLLECTIVE_FIELDS, KIND_ERROR: CELL_ERROR_FIELDS}[kind]
        later = {k for k, since in FIELDS_SINCE[kind].items() if since > version}
        _PLAIN_CHECKS[key] = tuple((name, frozenset(types), name in later) for name, (types, _doc) in fields.items())
    return _PLAIN_CHECKS[key]


_PLAIN_CHECKS: dict[tuple[str, int], tuple[tuple[str, frozenset, bool], ...]] = {}
_ABSENT = object()


def _plainly_valid(ev: Any, version: int) -> bool:
    """The common case of ``validate_event`` in one quick pass: a dict record whose fields all hold values of
    exactly their types, nothing nested to look into (no error, promotion or optional field). False means only
    "look closer": ``validate_event`` then runs every check and names what is wrong, if anything."""
    if type(ev) is not dict:
        return False
    kind = ev.get("kind")
    if kind not in _PLAIN_KINDS or type(ev.get("seq")) is not int:
        return kind == KIND_META and type(ev.get("seq")) is int
    for name, types, may_be_absent in _plain_checks(kind, version):
        value = ev.get(name, _ABSENT)
        if type(value) not in types and not (value is _ABSENT and may_be_absent):
            return False
    if kind == KIND_OP:
        return (ev["phase"] in PHASES and ev["error"] is None and not ev["promotions"] and ev["path"] in PATHS
                and "spec_mismatches" not in ev and "replicas" not in ev)
    if kind == KIND_COLLECTIVE:
        return (ev["phase"] in PHASES and ev["bytes_sent"] >= 0 and ev["bytes_recv"] >= 0
                and "preflight" not in ev)
    return True


_PLAIN_KINDS = (KIND_OP, KIND_COLLECTIVE, KIND_ERROR)


def validate_event(ev: Any, where: str = "event", version: int = SCHEMA_VERSION) -> None:
    """Raise SchemaError unless ``ev`` is a well-formed record of a known kind, as schema ``version`` writes it
    (fields added later may be absent)."""
    if _plainly_valid(ev, version):
        return
    if not isinstance(ev, dict):
        raise SchemaError(f"{where}: expected a dict, got {type(ev).__name__}")
    kind = ev.get("kind")
    if kind not in KINDS:
        raise SchemaError(f"{where}: unknown kind {kind!r} (known: {KINDS})")
    if not isinstance(ev.get("seq"), int):
        raise SchemaError(f"{where}: 'seq' must be an int")
    if kind == KIND_COLLECTIVE:
        _check_fields(ev, COLLECTIVE_FIELDS, f"{where} (collective seq {ev['seq']})", FIELDS_SINCE[KIND_COLLECTIVE],
                      version)
        if ev["phase"] not in PHASES:
            raise SchemaError(f"{where}: unknown phase {ev['phase']!r}")
        if ev["bytes_sent"] < 0 or ev["bytes_recv"] < 0:
            raise SchemaError(f"{where}: negative byte count")
        _check_optional(ev, KIND_COLLECTIVE, f"{where} (collective seq {ev['seq']})")
        return
    if kind == KIND_ERROR:
        _check_fields(ev, CELL_ERROR_FIELDS, f"{where} (error seq {ev['seq']})", FIELDS_SINCE[KIND_ERROR], version)
        return
    if kind != KIND_OP:
        return
    _check_fields(ev, OP_FIELDS, f"{where} (op seq {ev['seq']})", FIELDS_SINCE[KIND_OP], version)
    _check_optional(ev, KIND_OP, f"{where} (op seq {ev['seq']})")
    if ev["path"] not in PATHS:
        raise SchemaError(f"{where}: unknown path {ev['path']!r}")
    if ev["phase"] not in PHASES:
        raise SchemaError(f"{where}: unknown phase {ev['phase']!r}")
    if ev["error"] is not None:
        _check_fields(ev["error"], ERROR_FIELDS, f"{where} error", ERROR_FIELDS_SINCE, version)
    for p in ev["promotions"]:
        _check_fields(p, PROMOTION_FIELDS, f"{where} promotion")


def _check_optional(ev: dict, kind: str, what: str) -> None:
    """The OPTIONAL_FIELDS of a record that has them: their types, and those of their sub-records."""
    for name, (types, _doc) in OPTIONAL_FIELDS[kind].items():
        if name not in ev:
            continue
        _check_fields({name: ev[name]}, {name: (types, _doc)}, what)
        items = ev[name] if isinstance(ev[name], list) else [ev[name]]
        fields = _OPTIONAL_ITEM_FIELDS[name]
        for item in items:
            _check_fields(item, fields, f"{what} {name}")
    if kind == KIND_OP:
        for m in ev.get("spec_mismatches") or ():
            if m["check"] not in SPEC_CHECKS:
                raise SchemaError(f"{what}: unknown spec check {m['check']!r} (known: {SPEC_CHECKS})")
    elif kind == KIND_COLLECTIVE and ev.get("preflight") is not None:
        if ev["preflight"]["status"] not in PREFLIGHT_STATUSES:
            raise SchemaError(f"{what}: unknown preflight status {ev['preflight']['status']!r} "
                              f"(known: {PREFLIGHT_STATUSES})")


_OPTIONAL_ITEM_FIELDS = {"spec_mismatches": SPEC_MISMATCH_FIELDS, "replicas": REPLICA_FIELDS,
                         "preflight": PREFLIGHT_FIELDS}


def validate_nested(kind: str, name: str, value: Any) -> None:
    """Raise SchemaError unless the records nested in field ``name`` of a ``kind`` record hold their fields, as
    ``validate_event`` checks them: an op's ``error`` (ERROR_FIELDS) and ``promotions`` (PROMOTION_FIELDS), the
    items of an OPTIONAL_FIELDS field. Other fields hold no records: nothing to check."""
    if kind == KIND_OP and name == "error" and value is not None:
        _check_fields(value, ERROR_FIELDS, "error", ERROR_FIELDS_SINCE)
    elif kind == KIND_OP and name == "promotions":
        for item in value:
            _check_fields(item, PROMOTION_FIELDS, "promotion")
    elif name in OPTIONAL_FIELDS.get(kind, {}):
        _check_optional({name: value}, kind, "record")


def validate_payload(p: Any) -> None:
    """Raise SchemaError unless ``p`` is a payload of this schema version with valid records."""
    if not isinstance(p, dict) or p.get("format") != PAYLOAD_FORMAT:
        raise SchemaError("not a sharddbg payload (missing format 'sharddbg.payload')")
    v = p.get("schema_version")
    if not isinstance(v, int) or v > SCHEMA_VERSION or v < 1:
        raise SchemaError(f"payload schema_version {v!r} is not supported (this sharddbg reads 1..{SCHEMA_VERSION})")
    _check_fields(p, {k: (t, "") for k, t in PAYLOAD_FIELDS.items()}, f"payload of rank {p.get('rank')}")
    _check_present(p["meta"], PAYLOAD_META_FIELDS, f"payload of rank {p['rank']} meta")
    pc = p["meta"].get("plan_cache")
    if pc is not None:
        where = f"rank {p['rank']} meta plan_cache"
        _check_fields(pc, PLAN_CACHE_FIELDS, where)
        for i, g in enumerate(pc["groups"]):
            _check_fields(g, PLAN_CACHE_GROUP_FIELDS, f"{where} group #{i}")
    for i, ev in enumerate(p["events"]):
        validate_event(ev, f"rank {p['rank']} event #{i}", v)


def current_events(p: dict) -> list[dict]:
    """The records of a valid payload as this schema version reads them.

    A record written by an older version gains the fields added since, at what they mean for it: None
    (``FIELDS_SINCE``, ``ERROR_FIELDS_SINCE``), except an op error's ``handled``, which is False where an error
    record of the payload names its origin (that exception ended the cell) and None (not recorded) elsewhere.
    The payload itself is left as written: an upgraded record is a copy, the others are its own.
    """
    version = p["schema_version"]
    events = p["events"]
    if version >= SCHEMA_VERSION:
        return events
    ended = {ev.get("origin_seq") for ev in events if ev.get("kind") == KIND_ERROR} - {None}
    out = []
    for ev in events:
        kind = ev.get("kind")
        missing = [k for k, since in FIELDS_SINCE.get(kind, {}).items() if since > version and k not in ev]
        err = ev.get("error") if kind == KIND_OP else None
        old_error = isinstance(err, dict) and "handled" not in err
        if missing or old_error:
            ev = dict(ev, **dict.fromkeys(missing))
            if old_error:
                ev["error"] = dict(err, handled=False if err.get("origin_seq") in ended else None)
        out.append(ev)
    return out


def validate_trace_meta(meta: Any) -> None:
    """Raise SchemaError unless the keys of ``meta`` that TRACE_META_FIELDS names hold what it says (other keys
    are free)."""
    if not isinstance(meta, dict):
        raise SchemaError(f"trace meta: expected a dict, got {type(meta).__name__}")
    named = {k: meta[k] for k in TRACE_META_FIELDS if k in meta}
    _check_present(named, TRACE_META_FIELDS, "trace meta")
    for key in ("clock_uncertainty_ns", "incomplete_reasons"):
        value = named.get(key) or {}
        want = int if key == "clock_uncertainty_ns" else str
        for rank, v in value.items():
            if not (isinstance(rank, str) and rank.isdigit()) or type(v) is not want:
                raise SchemaError(f"trace meta {key}: {rank!r}: {v!r} is not a rank (as a string) -> "
                                  f"{want.__name__}")
    mesh = named.get("mesh")
    if mesh is not None and (set(mesh) != {"ddp", "domain"} or not all(type(v) is int and v >= 1
                                                                       for v in mesh.values())):
        raise SchemaError(f"trace meta mesh: {mesh!r} is not {{'ddp': int, 'domain': int}}")
    for i, entry in enumerate(named.get("replica_differences") or ()):
        _check_fields(entry, REPLICA_DIFFERENCE_FIELDS, f"trace meta replica_differences #{i}")
