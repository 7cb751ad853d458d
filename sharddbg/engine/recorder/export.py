"""Events -> schema records (schema.OP_FIELDS, schema.COLLECTIVE_FIELDS) and the rank's payload.

Runs at stop or peek time, never on the hot path: every field the hot path left raw (shapes, dtypes,
placements, parents, backward attribution, the byte counts of funcol's common ops) is worked out here.
A peek from another thread while the main thread records copies what it reads.
"""

from __future__ import annotations

import bisect
import copy
import platform
import sys
from typing import Any, Sequence
from math import prod
from operator import itemgetter

import torch

from ... import schema
from ...columnar import cyclic_gc_paused
from .. import clock
from ..rank_state import STATE
from .cells import cell_and_code, frame_label, line_text
from .comm_bytes import TensorMeta
from .events import CellErrorEvent, CollectiveEvent, OpEvent
from .params import ddp_bucket_of
from .spec_check import SpecMismatch, spec_mismatches
from .state import RecordingState
from .tensors import placements_str, shape_list, sharding_shapes_plain


class FrameFacts(dict):
    """Recorder frame tuple (file, line, function) -> (``user_frame`` label, cell, line text): where a call was
    made, worked out once per frame in one formatting pass (a loop's thousands of calls share a few frames; each
    lookup asks IPython and linecache)."""

    def __missing__(self, frame: Any) -> tuple[str | None, int | None, str | None]:
        facts = self[frame] = (frame_label(frame), *cell_and_code(frame))
        return facts


def _frame_facts(frame: Any, frames: FrameFacts | None) -> tuple[str | None, int | None, str | None]:
    if frames is not None:
        try:
            return frames[frame]
        except TypeError:  # a frame that is no plain tuple (unhashable): worked out on its own
            pass
    return (frame_label(frame), *cell_and_code(frame))


class TensorFacts:
    """The plain forms of the tensors' metadata met in one formatting pass, worked out once per distinct value (a
    loop's thousands of calls see a few shapes, placements, dtypes and specs).

    Keys hold shapes and dtypes by value, and placements, sharding shapes and meshes by identity (hashing a
    placement runs Python code); each entry keeps the objects its key names by identity alive, so their ids are
    not reused while the pass runs. The cached forms are tuples; each record gets lists of its own."""

    __slots__ = ("infos", "ops", "spec")

    def __init__(self) -> None:
        # the key of an op's result, then of each input (``op``) -> OpTensorFacts
        self.ops: dict[tuple, OpTensorFacts] = {}
        # (local shape, global shape, id(placements), dtype) -> InfoFacts (which holds the placements)
        self.infos: dict[tuple, InfoFacts] = {}
        # (local shape, global shape, id(placements), id(sharding shapes), id(mesh)) -> (mismatches, placements,
        # sharding shapes, mesh)
        self.spec: dict[tuple, tuple] = {}

    def info(self, i: Any) -> InfoFacts:
        """The InfoFacts of a TensorInfo."""
        try:
            key = (i.local_shape, i.global_shape, id(i.placements), i.dtype)
            return self.infos[key]
        except KeyError:
            pass
        except TypeError:  # a symbolic size (unhashable): worked out on its own
            return InfoFacts(i)
        facts = self.infos[key] = InfoFacts(i)
        return facts

    def op(self, ins: list, out: Any) -> OpTensorFacts:
        """The OpTensorFacts of an op's input and result TensorInfos."""
        # flat: the result's 8 entries (what its spec check reads too) or one None, then 4 per input; the length
        # tells the two apart
        if out is not None and len(ins) == 1:  # most ops: the key made in one go
            i = ins[0]
            key = (out.local_shape, out.global_shape, id(out.placements), out.dtype, id(out.sharding_shapes),
                   id(out.mesh), out.shard_tensor, out.fake, i.local_shape, i.global_shape, id(i.placements), i.dtype)
        else:
            key = [out.local_shape, out.global_shape, id(out.placements), out.dtype, id(out.sharding_shapes),
                   id(out.mesh), out.shard_tensor, out.fake] if out is not None else [None]
            for i in ins:
                key += (i.local_shape, i.global_shape, id(i.placements), i.dtype)
            key = tuple(key)
        try:
            return self.ops[key]
        except KeyError:
            pass
        except TypeError:  # a symbolic size (unhashable): worked out on its own
            return OpTensorFacts([InfoFacts(i) for i in ins], out, InfoFacts(out) if out is not None else None)
        facts = self.ops[key] = OpTensorFacts([self.info(i) for i in ins], out,
                                              self.info(out) if out is not None else None)
        return facts

    def mismatches(self, info: Any, coordinate: Any, mesh_shape: tuple) -> Any:
        """``spec_mismatches`` of a ShardTensor result's TensorInfo on a mesh met at ``coordinate``."""
        pl, ss, mesh = info.placements, info.sharding_shapes, info.mesh
        try:
            key = (info.local_shape, info.global_shape, id(pl), id(ss), id(mesh))
            return self.spec[key][0]
        except KeyError:
            pass
        except TypeError:  # a symbolic size (unhashable): checked on its own
            return spec_mismatches(info.local_shape, info.global_shape, pl, ss, coordinate, mesh_shape)
        found = tuple(spec_mismatches(info.local_shape, info.global_shape, pl, ss, coordinate, mesh_shape))
        self.spec[key] = (found, pl, ss, mesh)
        return found


class InfoFacts:
    """A TensorInfo's plain forms: its shapes as tuples of ints (None where the info has none), its placements'
    text (``placements_str``) and its dtype's (``float32``); ``placements``: the placements themselves."""

    __slots__ = ("local_shape", "global_shape", "placements_text", "dtype", "placements")

    def __init__(self, i: Any) -> None:
        local, glob = i.local_shape, i.global_shape
        self.local_shape = tuple(int(d) for d in local) if local is not None else None
        self.global_shape = tuple(int(d) for d in glob) if glob is not None else None
        self.placements_text = placements_str(i.placements)
        self.dtype = str(i.dtype).removeprefix("torch.")
        self.placements = i.placements


class OpTensorFacts:
    """The plain forms of an op's inputs and result, as ``op_record`` writes them (tuples here; ``*_all``: no
    entry is None, so ``map(list, ...)`` makes the record's lists); ``sharding_shapes``: the result's as
    ``_sharding_tuples`` makes them (None: none, or not plain ints); ``out_mismatches``: its spec check's
    (``_mismatches_of``), None until asked; ``keep``: what the cache's key names by identity."""

    __slots__ = ("in_local_shapes", "in_local_all", "in_global_shapes", "in_global_all", "out_local_shape",
                 "out_global_shape", "placements", "dtype", "in_placements", "sharding_shapes", "out_mismatches",
                 "keep")

    def __init__(self, ins: list[InfoFacts], out_info: Any, out: InfoFacts | None) -> None:
        self.in_local_shapes = tuple(f.local_shape for f in ins)
        self.in_local_all = None not in self.in_local_shapes
        self.in_global_shapes = tuple(f.global_shape for f in ins)
        self.in_global_all = None not in self.in_global_shapes
        self.out_local_shape = out.local_shape if out is not None else None
        self.out_global_shape = out.global_shape if out is not None else None
        first = out if out is not None else (ins[0] if ins else None)
        # the result's placements, else the first distributed input's
        dist = out if out is not None and out.placements is not None else next(
            (f for f in ins if f.placements is not None), None)
        self.placements = dist.placements_text if dist is not None else None
        self.dtype = first.dtype if first is not None else None
        self.in_placements = tuple(f.placements_text for f in ins)
        ss = out_info.sharding_shapes if out_info is not None else None
        self.sharding_shapes = _sharding_tuples(ss) if ss else None
        self.out_mismatches = None
        self.keep = (ins, out, ss, out_info.mesh if out_info is not None else None)


def _sharding_tuples(ss: Any) -> tuple | None:
    """``sharding_shapes_plain``'s form as ((key, (shape tuple, ...)), ...); None where it makes its readable
    (str) form instead."""
    try:
        return tuple((str(int(k)), tuple(tuple(int(d) for d in s) for s in v)) for k, v in ss.items())
    except Exception:  # noqa: BLE001 - the same entries sharding_shapes_plain falls back on
        return None


def _list(t: tuple | None) -> list | None:
    return list(t) if t is not None else None


def spec_findings(ev: OpEvent, meshes: dict, tensors: TensorFacts | None = None) -> list[dict]:
    """schema.SPEC_MISMATCH_FIELDS for each ShardTensor result of ``ev`` whose spec disagrees with its local
    tensor (``spec_check.spec_mismatches``). ``meshes``: id(mesh) -> (this rank's coordinate, mesh shape),
    filled as meshes are met (one export's cache: the events hold the meshes alive); ``tensors``: one formatting
    pass's ``TensorFacts`` (a result's check is made once per distinct spec)."""
    infos = ev.outputs if ev.outputs is not None else ([ev.output] if ev.output is not None else [])
    return [_finding(index, m, info.placements) for index, info in enumerate(infos)
            for m in _mismatches_of(info, meshes, tensors)]


def _mismatches_of(info: Any, meshes: dict, tensors: TensorFacts | None) -> Sequence[SpecMismatch]:
    """The spec check of one result's TensorInfo: empty for any but a real ShardTensor on a mesh holding this
    rank."""
    if not info.shard_tensor or info.fake:
        return ()
    mesh = info.mesh
    where = meshes.get(id(mesh))
    if where is None:
        where = meshes[id(mesh)] = (mesh.get_coordinate(), tuple(mesh.mesh.shape))
    coordinate, mesh_shape = where
    if coordinate is None:
        return ()
    if tensors is not None:
        return tensors.mismatches(info, coordinate, mesh_shape)
    return spec_mismatches(info.local_shape, info.global_shape, info.placements, info.sharding_shapes,
                           coordinate, mesh_shape)


def _finding(index: int, m: SpecMismatch, placements: Any) -> dict:
    return {"output": index, "check": m.check, "mesh_dim": m.mesh_dim,
            "spec_shape": list(m.spec_shape) if m.spec_shape is not None else None,
            "local_shape": list(m.local_shape),
            "global_shape": list(m.global_shape) if m.global_shape is not None else None,
            "placements": placements_str(placements), "detail": m.detail}


def replica_records(ev: OpEvent, op: str) -> list[dict]:
    """schema.REPLICA_FIELDS of the tensors ``ev`` digested (those of a call that completed)."""
    return [{"key": d.key(op), "what": d.what, "digest": d.digest, "shape": [int(x) for x in d.shape],
             "dtype": str(d.dtype).removeprefix("torch."), "group_ranks": list(d.group_ranks), "kept": d.kept}
            for d in list(ev.replicas) if d.call is not None]


def error_handled(rec: RecordingState, ev: OpEvent) -> bool | None:
    """schema.ERROR_FIELDS ``handled`` of an op event that raised: False when its exception (or one it was
    chained into) ended a cell, True when it did not and the recording has stopped (every cell it ran in has
    ended), None while it still runs (the exception may yet end the cell)."""
    err = ev.error
    if err is None:
        return None
    if err["origin_seq"] in rec.escaped_origins:
        return False
    return None if rec.running else True


def op_record(ev: OpEvent, in_flight: bool, local_ms: float | None = None, meshes: dict | None = None,
              handled: bool | None = None, frames: FrameFacts | None = None, tensors: TensorFacts | None = None
              ) -> dict:
    """The schema record of an op event (``in_flight``: it had not returned when the record was made;
    ``local_ms``: what local_timing measured for it; ``meshes``: check its results' specs, with this cache
    of mesh coordinates (``spec_findings``); None: not checked; ``handled``: its error's, ``error_handled``;
    ``frames``, ``tensors``: one formatting pass's ``FrameFacts`` and ``TensorFacts``)."""
    ins = ev.inputs or []
    out = ev.output
    if tensors is None:
        tensors = TensorFacts()
    shapes = tensors.op(ins, out)
    in_bytes = 0
    for i in ins:
        in_bytes += i.local_bytes
    t0, t1 = ev.t_start_ns, ev.t_end_ns
    span = ev.cuda
    if span is not None and span.closed:
        dev_ms, mem = span.device_ms(), None if span.mem_delta is None else int(span.mem_delta)
    else:
        dev_ms = mem = None
    parent = ev.parent
    fwd = ev.forward  # a backward event: what it runs the backward of
    src = fwd if fwd is not None else ev
    err = ev.error
    try:  # _frame_facts, inlined: it runs for every record
        label, cell, code = frames[ev.frame]
    except TypeError:  # no pass's FrameFacts, or a frame that is no plain tuple
        label, cell, code = _frame_facts(ev.frame, frames)
    record = {
        "kind": "op",
        "seq": ev.seq,
        "parent_seq": parent.seq if parent is not None else None,
        "depth": ev.depth,
        "op": src.op,
        "path": src.path,
        "handler": src.handler,
        "phase": ev.phase,
        "autograd_node": ev.autograd_node,
        "module": src.module,
        "user_frame": label,
        "user_cell": cell,
        "user_code": code,
        "in_local_shapes": list(map(list, shapes.in_local_shapes)) if shapes.in_local_all else list(
            map(_list, shapes.in_local_shapes)),
        "in_global_shapes": list(map(list, shapes.in_global_shapes)) if shapes.in_global_all else list(
            map(_list, shapes.in_global_shapes)),
        "out_local_shape": list(out_shape) if (out_shape := shapes.out_local_shape) is not None else None,
        "out_global_shape": list(out_shape) if (out_shape := shapes.out_global_shape) is not None else None,
        "placements": shapes.placements,
        "dtype": shapes.dtype,
        # one mesh dim, most ShardTensors: no comprehension (a function call of its own)
        "sharding_shapes": ({sharding[0][0]: list(map(list, sharding[0][1]))} if len(sharding) == 1
                            else {k: list(map(list, v)) for k, v in sharding})
        if (sharding := shapes.sharding_shapes) is not None
        else sharding_shapes_plain(out.sharding_shapes) if out is not None else None,
        "in_bytes": int(in_bytes),
        "out_bytes": int(ev.out_bytes),
        "t_start_ns": int(t0),
        "t_end_ns": int(t1) if t1 is not None else None,
        "host_ms": (t1 - t0) / 1e6 if t1 is not None else None,
        "device_ms": dev_ms,
        "mem_delta_bytes": mem,
        "local_ms": local_ms,
        "error": dict(err, handled=handled) if err is not None else None,
        "fwd_seq": fwd.seq if fwd is not None else None,
        "in_placements": list(shapes.in_placements),
        "fallback": bool(src.fallback),
        "promotions": [
            {"param": p.param, "shape": shape_list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for p in list(ev.promotions)
        ] if ev.promotions else [],
        "not_implemented": bool(ev.not_implemented),
        "in_flight": in_flight,
        "thread": ev.thread,
    }
    if meshes is not None:
        if ev.outputs is None:  # its one result: checked once per distinct spec (``OpTensorFacts``)
            mismatches = shapes.out_mismatches
            if mismatches is None:
                mismatches = shapes.out_mismatches = tuple(_mismatches_of(out, meshes, tensors)) if out is not None \
                    else ()
            if mismatches:
                record["spec_mismatches"] = [_finding(0, m, out.placements) for m in mismatches]
        else:
            found = spec_findings(ev, meshes, tensors)
            if found:
                record["spec_mismatches"] = found
    if ev.replicas:
        digests = replica_records(ev, src.op)
        if digests:
            record["replicas"] = digests
    return record


def forward_op_of(rec: RecordingState, node_seq_nr: int, limit: int | None = None) -> OpEvent | None:
    """The innermost forward op of thread 0 whose autograd sequence-number range [start, end) contains
    ``node_seq_nr``: the op during which that autograd node was created.

    ``limit`` is how many forward ops had ended when the node was looked for. Top-level ops do not
    overlap, so the scan stops at the first one that starts after the node (a node made between two ops
    belongs to neither)."""
    ops, ends = rec.forward_ops, rec.forward_op_ends
    stop = len(ops) if limit is None else min(limit, len(ops))
    i = bisect.bisect_right(ends, node_seq_nr, 0, stop)
    for j in range(i, stop):
        ev = ops[j]
        if ev.autograd_seq_start <= node_seq_nr:
            return ev
        if ev.depth == 0:
            return None
    return None


def forward_op_using(rec: RecordingState, param: str | None, limit: int) -> OpEvent | None:
    """The last forward op of thread 0 (among the first ``limit`` to end) that ran in the module holding
    ``param``: the op whose backward made that parameter's gradient (the parameter's module runs it)."""
    module = rec.param_modules.get(param) if param is not None else None
    if module is None:
        return None
    ops = rec.forward_ops
    for j in range(min(limit, len(ops)) - 1, -1, -1):
        if ops[j].module == module and ops[j].depth == 0:
            return ops[j]
    return None


def collective_record(ev: CollectiveEvent, in_flight: bool, rec: RecordingState, frames: FrameFacts | None = None
                      ) -> dict:
    """The schema record of a collective event (``in_flight`` also when its issuing call had not returned;
    ``frames``: one formatting pass's ``FrameFacts``)."""
    s = ev.spec
    g = ev.group
    ranks = g.ranks
    op, outer = ev.op, ev.outer
    op_name = None  # what the collective is attributed to when it is not a recorded op (a DDP bucket)
    phase = ev.phase
    params = [ev.param] if ev.param is not None else None
    bucket = None
    if ev.node_seq_nr is not None:  # backward: the forward op that made the node
        op = forward_op_of(rec, ev.node_seq_nr, ev.forward_ops_ended)
        box = ev.node_box
        if op is None and box is not None and box.recording is rec:
            op = box.forward
        outer = (op.root or op) if op is not None else None
        if op is None and ev.trigger is not None:  # an AccumulateGrad hook issued it: DDP's reducer?
            numel = prod(ev.shape) if ev.shape is not None else None
            is_ddp, b = ddp_bucket_of(rec, g.name, ev.trigger, numel)
            if is_ddp:
                op_name = schema.DDP_BUCKET_OP
                params = list(b.params) if b is not None else params
                bucket = b.index if b is not None else None
    elif ev.deferred_gradient:  # a parameter's distributed gradient, reduced at its first use
        phase = "backward"
        op = forward_op_using(rec, ev.param, ev.forward_ops_ended)
        outer = (op.root or op) if op is not None else None
    group_size = len(ranks) if ranks else ev.group_size
    sent, recv, splits_sent, splits_recv, peer, root = (ev.bytes_sent, ev.bytes_recv, ev.splits_sent,
                                                        ev.splits_recv, ev.peer, ev.root)
    if ev.deferred_args is not None:  # funcol's common ops: sizes and plain arguments kept at issue
        args = dict(zip(s.arg_names, (TensorMeta(ev.shape, ev.dtype, ev.input_element_size),) + tuple(ev.deferred_args)))
        counted = s.count_bytes(args, ranks, rec.rank)
        sent, recv, splits_sent, splits_recv = counted.sent, counted.recv, counted.splits_sent, counted.splits_recv
        peer, root = counted.peer, counted.root
        if not ranks:
            group_size = int(args.get("group_size") or 0) or None
    label, cell, code = _frame_facts(ev.frame, frames)
    failed = ev.error is not None and ev.t_done_ns is None
    dtype = ev.dtype
    if dtype is not None and not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    record = {
        "kind": "collective",
        "seq": ev.seq,
        "group_seq": ev.group_seq,
        "coll": s.kind,
        "aten_op": s.aten_op,
        "api": s.api,
        "group_name": g.name,
        "group_ranks": ranks,
        "group_size": group_size,
        "mesh_dim": g.mesh_dim,
        "peer": peer,
        "root": root,
        "bytes_sent": int(sent),
        "bytes_recv": int(recv),
        "splits_sent": splits_sent,
        "splits_recv": splits_recv,
        "dtype": dtype,
        "shape": [int(d) for d in ev.shape] if ev.shape is not None else None,
        "async": ev.is_async,
        "t_issue_ns": ev.t_issue_ns,
        "t_return_ns": ev.t_return_ns,
        "t_done_ns": ev.t_done_ns,
        "wait_op_seq": ev.wait_op_seq,
        "waited": ev.waited,
        "op": op.op if op is not None else op_name,
        "op_seq": op.seq if op is not None else None,
        "outer_op": outer.op if outer is not None else op_name,
        "outer_op_seq": outer.seq if outer is not None else None,
        "phase": phase,
        "autograd_node": ev.autograd_node,
        "param": ev.param,
        "params": params,
        "bucket": bucket,
        "user_frame": label,
        "user_cell": cell,
        "user_code": code,
        "thread": ev.thread,
        "device_ms": ev.cuda.device_ms() if ev.cuda is not None else None,
        "error": ev.error,
        # neither completed nor failed: never waited for, or (CUDA) its kernel has not finished, whatever the
        # host saw; one that raised is not counted as in flight (it is not a hang)
        "in_flight": bool(not failed and (in_flight or ev.t_done_ns is None
                                          or (ev.cuda is not None and not ev.cuda.device_done()))),
    }
    pf = ev.preflight
    if pf is not None:
        record["preflight"] = {"status": pf.status, "ms": float(pf.ms), "detail": pf.detail,
                               "late_ranks": list(pf.late_ranks)}
    return record


def error_record(ev: CellErrorEvent) -> dict:
    """The schema record of an exception that ended the cell (schema.CELL_ERROR_FIELDS)."""
    import traceback

    exc = ev.exception
    return {
        "kind": "error",
        "seq": ev.seq,
        "t_ns": ev.t_ns,
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "origin_seq": ev.origin_seq,
        "cell_line": ev.cell_line,
        "cell_code": ev.cell_code,
        "cell": ev.cell,
        "thread": ev.thread,
        "user_frame": frame_label(ev.user_frame),
        "user_code": line_text(ev.user_frame[0], ev.user_frame[1]) if ev.user_frame else None,
    }


def _record(ev, rec: RecordingState, meshes: dict | None, frames: FrameFacts | None = None,
            tensors: TensorFacts | None = None) -> dict:
    kind = type(ev)
    if kind is OpEvent:
        return op_record(ev, False, rec.local_ms.get(ev.seq), meshes,
                         error_handled(rec, ev) if ev.error is not None else None, frames, tensors)
    if kind is CollectiveEvent:
        return collective_record(ev, False, rec, frames)
    return error_record(ev)


def _installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def record_of(ev, rec: RecordingState, meshes: dict | None) -> dict:
    """The schema record of one kept event as the recording stands now (a collective not completed yet is
    marked in flight; an op error's ``handled`` is None while the recording runs)."""
    return _record(ev, rec, meshes)


def in_flight_ops(rec: RecordingState, meshes: dict | None) -> list[dict]:
    """Schema records of the ops still running on every thread (``in_flight`` True)."""
    out = []
    for st in list(rec.threads.values()):
        for ev in list(st.op_stack):
            out.append(op_record(copy.copy(ev), True, None, meshes))
    return out


def records(rec: RecordingState, include_in_flight: bool) -> list[dict]:
    """Schema records of the kept events (and, with ``include_in_flight``, of the ops still running on
    every thread), sorted by seq."""
    kept = list(rec.buffer)  # list() of a list is atomic under the GIL: safe from another thread
    meshes = {} if rec.spec_check else None
    # the records are new containers that outlive the loop: enough of them start a collection of the oldest
    # generation, which walks every object of the rank's process (torch's included: a million or more), 0.8 s
    # of the 0.9 s that formatting 10,000 records took on a 2-rank cluster; they hold no reference cycles
    frames, tensors = FrameFacts(), TensorFacts()
    with cyclic_gc_paused():
        out = [_record(ev, rec, meshes, frames, tensors) for ev in kept]
    if include_in_flight:
        out += in_flight_ops(rec, meshes)
    out.sort(key=itemgetter("seq"))
    return out


def payload(rec: RecordingState, events: list[dict], complete: bool) -> dict:
    """The rank's payload (schema.PAYLOAD_FIELDS)."""
    return {
        "format": schema.PAYLOAD_FORMAT,
        "schema_version": schema.SCHEMA_VERSION,
        "rank": rec.rank,
        "world_size": rec.world_size,
        "complete": complete,
        "events": events,
        "dropped": rec.dropped,
        "clock": dict(clock.describe(), t_start_ns=rec.t_start_ns, t_stop_ns=rec.t_stop_ns,
                      t_payload_ns=clock.now_ns()),
        "meta": _meta(rec),
    }


def _meta(rec: RecordingState) -> dict:
    # read, never imported here: a recorded job that does not use physicsnemo must not load it
    physicsnemo = sys.modules.get("physicsnemo")
    pn = getattr(physicsnemo, "__version__", "?") if physicsnemo is not None else _installed_version("nvidia-physicsnemo")
    stm = sys.modules.get("physicsnemo.domain_parallel.shard_tensor")
    ShardTensor = getattr(stm, "ShardTensor", None)  # noqa: N806
    # how the cluster set this rank up, when it did (registered-by-physicsnemo / -by-sharddbg / none)
    boot_mode = STATE.patches.patch_mode if STATE.patches is not None else None
    return {
        "torch": str(torch.__version__),  # a plain str: a TorchVersion would import torch where it is unpickled
        "physicsnemo": pn,
        "python": platform.python_version(),
        "host": platform.node(),
        "patch_mode": "registered" if ShardTensor is not None and ShardTensor._function_registry else "fallback_only",
        "patch_mode_bootstrap": boot_mode,
        "n_function_handlers": len(ShardTensor._function_registry) if ShardTensor is not None else 0,
        "n_named_handlers": len(ShardTensor._named_function_registry) if ShardTensor is not None else 0,
        "n_dispatch_handlers": len(ShardTensor._dispatch_registry) if ShardTensor is not None else 0,
        "cuda": bool(torch.cuda.is_available()),
        **rec.options.as_dict(),  # what was kept and checked (schema.PAYLOAD_META_FIELDS names them)
        "recording": rec.running,
        "reentries": rec.reentries,
        "n_collectives": rec.collectives.count,
        "plan_cache": rec.plan_cache.record() if rec.plan_cache is not None else None,
        "internal_errors": list(rec.internal_errors[-5:]),
        "installed_at": list(rec.installed_at),
    }
