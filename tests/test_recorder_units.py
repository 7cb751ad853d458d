"""The recorder's parts that need no cluster, in one process: the dispatch-path decision (against
ShardTensor's real registries and against small ones built here), the byte count of every collective kind
(against sizes computed here from real tensors, with the arguments each op's own schema names), tensor
metadata, names, the TypeError trap, the undo log, the forward-op lookup and the export of events.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops
import torch.nn.functional as F

from sharddbg import schema
from sharddbg.options import RecordingOptions
from sharddbg.engine.recorder import collectives, comm_bytes, export, paths
from sharddbg.engine.recorder.events import CollectiveEvent, OpEvent, Promotion
from sharddbg.engine.recorder.state import GroupInfo, RecordingState
from sharddbg.engine.recorder.tensors import (
    PY_SWALLOWING_DUNDERS,
    collect_tensors,
    node_name,
    op_name,
    qualname,
    tensor_info,
    would_swallow_type_error,
)
from sharddbg.engine.recorder.undo import UndoLog


def nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- dispatch paths ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shard_tensor():
    """physicsnemo's ShardTensor with its patches registered (as sharddbg does on a CPU rank)."""
    import physicsnemo.domain_parallel as dp
    from physicsnemo.domain_parallel import ShardTensor

    dp.register_custom_ops()
    assert ShardTensor._function_registry and ShardTensor._dispatch_registry
    return ShardTensor


class Named:
    """A callable stand-in whose str() is a registered name (custom ops are matched by name)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def _fn_path(cls, func, converting=False, patches_enabled=True):
    import physicsnemo.domain_parallel.shard_tensor as stm

    return paths.function_path(func, converting=converting, passthrough=cls._autograd_passthrough_functions,
                               function_registry=cls._function_registry,
                               named_registry=cls._named_function_registry, patches_enabled=patches_enabled,
                               fallback=stm._torch_function_fallback_via_dtensor)


def _td_path(cls, func):
    import physicsnemo.domain_parallel.shard_tensor as stm

    return paths.dispatch_path(func, cls._dispatch_registry, cls._dispatch_registry_by_name,
                               stm._dispatch_fallback_via_dtensor)


def test_function_paths_on_shard_tensor_registries(shard_tensor):
    import physicsnemo.domain_parallel.shard_tensor as stm

    ST = shard_tensor
    fallback = paths.PathChoice("dtensor_fallback_function", stm._torch_function_fallback_via_dtensor)
    # every registered function goes to its own handler while patches are enabled
    for func, handler in ST._function_registry.items():
        assert _fn_path(ST, func) == paths.PathChoice("function_handler", handler), func
    assert _fn_path(ST, F.conv2d).handler is ST._function_registry[F.conv2d]
    assert "conv_patches" in qualname(_fn_path(ST, F.conv2d).handler)
    for name, handler in ST._named_function_registry.items():
        assert _fn_path(ST, Named(name)) == paths.PathChoice("named_handler", handler), name
    # no patch: the DTensor fallback
    assert torch.Tensor.abs not in ST._function_registry
    assert _fn_path(ST, torch.Tensor.abs) == fallback
    # patches not enabled yet (no ShardTensor made): registered functions fall back too, named ones as well
    assert _fn_path(ST, F.conv2d, patches_enabled=False) == fallback
    name = next(iter(ST._named_function_registry))
    assert _fn_path(ST, Named(name), patches_enabled=False) == fallback
    # autograd-identity functions run on the real tensor, before any registry is read
    for func in ST._autograd_passthrough_functions:
        assert _fn_path(ST, func) == paths.PathChoice("autograd_passthrough", None)
    # a conversion in progress comes first of all
    assert _fn_path(ST, F.conv2d, converting=True) == paths.PathChoice("conversion", None)
    assert _fn_path(ST, torch.autograd.grad, converting=True) == paths.PathChoice("conversion", None)


def test_dispatch_paths_on_shard_tensor_registries(shard_tensor):
    import physicsnemo.domain_parallel.shard_tensor as stm

    ST = shard_tensor
    for op, handler in ST._dispatch_registry.items():
        assert _td_path(ST, op) == paths.PathChoice("dispatch_handler", handler), op
        # the same op reached through another object with its name: found by name
        assert _td_path(ST, Named(str(op))) == paths.PathChoice("dispatch_handler", ST._dispatch_registry_by_name[str(op)])
    assert torch.ops.aten.abs.default not in ST._dispatch_registry
    assert _td_path(ST, torch.ops.aten.abs.default) == paths.PathChoice("dtensor_fallback_dispatch",
                                                                         stm._dispatch_fallback_via_dtensor)


def _h_fn(func, types, args, kwargs):
    return "function"


def _h_named(func, types, args, kwargs):
    return "named"


def _h_disp(*args, **kwargs):
    return "dispatch"


def _h_disp_name(*args, **kwargs):
    return "dispatch by name"


def _fallback(func, args, kwargs):
    return "fallback"


def test_every_path_with_small_registries():
    f_registered, f_named, f_both, f_plain, f_pass = (Named("ns.registered"), Named("ns.named"), Named("ns.both"),
                                                      Named("ns.plain"), Named("ns.pass"))
    fn_reg = {f_registered: _h_fn, f_both: _h_fn, f_pass: _h_fn}
    named_reg = {"ns.named": _h_named, "ns.both": _h_named}

    def choose(func, converting=False, patches_enabled=True):
        return paths.function_path(func, converting=converting, passthrough=frozenset({f_pass}),
                                   function_registry=fn_reg, named_registry=named_reg,
                                   patches_enabled=patches_enabled, fallback=_fallback)

    assert choose(f_registered) == paths.PathChoice("function_handler", _h_fn)
    assert choose(f_named) == paths.PathChoice("named_handler", _h_named)
    assert choose(f_both) == paths.PathChoice("function_handler", _h_fn)  # by function before by name
    assert choose(f_plain) == paths.PathChoice("dtensor_fallback_function", _fallback)
    assert choose(f_pass) == paths.PathChoice("autograd_passthrough", None)  # before the registry
    for f in (f_registered, f_named, f_both, f_plain, f_pass):
        assert choose(f, converting=True) == paths.PathChoice("conversion", None)
    for f in (f_registered, f_named, f_both, f_plain):
        assert choose(f, patches_enabled=False) == paths.PathChoice("dtensor_fallback_function", _fallback)
    assert choose(f_pass, patches_enabled=False) == paths.PathChoice("autograd_passthrough", None)

    op_a, op_b, op_c = object(), Named("aten.b.default"), Named("aten.c.default")
    by_op = {op_a: _h_disp}
    by_name = {"aten.b.default": _h_disp_name, str(op_a): _h_disp_name}
    assert paths.dispatch_path(op_a, by_op, by_name, _fallback) == paths.PathChoice("dispatch_handler", _h_disp)
    assert paths.dispatch_path(op_b, by_op, by_name, _fallback) == paths.PathChoice("dispatch_handler", _h_disp_name)
    assert paths.dispatch_path(op_c, by_op, by_name, _fallback) == paths.PathChoice("dtensor_fallback_dispatch",
                                                                                     _fallback)
    # every path decided here is one the schema knows
    decided = {paths.CONVERSION, paths.AUTOGRAD_PASSTHROUGH, paths.FUNCTION_HANDLER, paths.NAMED_HANDLER,
               paths.DTENSOR_FALLBACK_FUNCTION, paths.DISPATCH_HANDLER, paths.DTENSOR_FALLBACK_DISPATCH}
    assert decided <= set(schema.PATHS)
    assert {paths.DTENSOR_FALLBACK_FUNCTION, paths.DTENSOR_FALLBACK_DISPATCH} == set(schema.FALLBACK_PATHS)


# ---- byte counts ---------------------------------------------------------------------------------------

A = torch.zeros(6, 4)  # 96 B, 16 B per row
B = torch.zeros(3, 2, dtype=torch.float64)  # 48 B
O1 = torch.zeros(5, 4)  # 80 B
O2 = torch.zeros(2, dtype=torch.int16)  # 4 B
RANKS = [10, 11, 12, 13]  # the group's global ranks, in group-rank order
GROUP_SIZE = 4
IN_SPLITS, OUT_SPLITS = [2, 2, 1, 1], [1, 2, 0, 3]  # rows of A


def _value(name: str, type_str: str, root: int):
    """A value for one schema argument: tensors chosen by name and type, plain arguments otherwise."""
    outputs = name.startswith("output")
    if type_str == "List[List[Tensor]]":
        return [[O1, O2]] if outputs else [[A, B]]
    if type_str == "List[Tensor]":
        return [O1, O2] if outputs else [A, B]
    if type_str == "Tensor":
        return O1 if outputs else A
    plain = {"group_size": GROUP_SIZE, "group_name": "g", "reduce_op": "sum", "src": 3, "dst": 2, "tag": 0,
             "root_rank": root, "root_tensor": 0, "async_op": True, "timeout": -1, "input_split_sizes": IN_SPLITS,
             "output_split_sizes": OUT_SPLITS, "gather_dim": 0, "shard_dim": 1, "device_ids": [], "wait_all_ranks": False}
    return plain.get(name)  # process_group, sparse_indices, ...: not read by the byte counts


def _expected(kind: str, me_root: bool):
    """(sent, recv, splits_sent, splits_recv, peer, root, first tensor) for the arguments _value() makes,
    worked out here from the tensors' sizes."""
    s2 = nb(A) + nb(B)
    o2 = nb(O1) + nb(O2)
    root = 11  # root_rank 1 of RANKS
    row = nb(A) // A.shape[0]
    exp = {
        "funcol_all_gather": (nb(A), nb(A) * GROUP_SIZE, None, None, None, None, A),
        "funcol_same_size": (nb(A), nb(A), None, None, None, None, A),
        "funcol_reduce_scatter": (nb(A), nb(A) // GROUP_SIZE, None, None, None, None, A),
        "funcol_all_to_all": (nb(A), nb(A), [r * row for r in IN_SPLITS], [r * row for r in OUT_SPLITS], None, None, A),
        "funcol_coalesced_all_gather": (s2, s2 * GROUP_SIZE, None, None, None, None, A),
        "funcol_coalesced_reduce_scatter": (s2, s2 // GROUP_SIZE, None, None, None, None, A),
        "funcol_coalesced_same_size": (s2, s2, None, None, None, None, A),
        "funcol_send": (nb(A), 0, None, None, RANKS[2], None, A),
        "funcol_recv": (0, nb(A), None, None, RANKS[3], None, A),
        "dtensor_shard_dim_alltoall": (nb(A), nb(A), None, None, None, None, A),
        "c10d_same_size": (s2, s2, None, None, None, None, A),
        "c10d_broadcast": (s2 if me_root else 0, 0 if me_root else s2, None, None, None, root, A),
        "c10d_allgather": (s2, o2, None, None, None, None, A),
        "c10d_allgather_base": (nb(A), nb(O1), None, None, None, None, A),
        "c10d_allgather_coalesced": (s2, o2, None, None, None, None, A),
        "c10d_allgather_into_tensor_coalesced": (s2, o2, None, None, None, None, A),
        "c10d_alltoall_base": (nb(A), nb(A), [r * row for r in IN_SPLITS], [r * row for r in OUT_SPLITS], None, None, A),
        "c10d_alltoall": (s2, o2, [nb(A), nb(B)], [nb(O1), nb(O2)], None, None, A),
        "c10d_reduce_scatter": (s2, o2, None, None, None, None, A),
        "c10d_reduce_scatter_base": (nb(A), nb(O1), None, None, None, None, A),
        "c10d_reduce_scatter_tensor_coalesced": (s2, o2, None, None, None, None, A),
        "c10d_reduce": (s2, s2 if me_root else 0, None, None, None, root, A),
        "c10d_gather": (s2, o2 if me_root else 0, None, None, None, root, A),
        "c10d_scatter": (s2 if me_root else 0, o2, None, None, None, root, O1),
        "c10d_send": (s2, 0, None, None, RANKS[2], None, A),
        "c10d_recv": (0, s2, None, None, RANKS[3], None, A),
        "no_bytes": (0, 0, None, None, None, None, None),
    }
    return exp[kind]


def _real_op(aten_op: str):
    ns, name = aten_op.split(".", 1)
    packet = getattr(getattr(torch.ops, ns), name, None)
    return packet.default if packet is not None else None


def _counted(c: comm_bytes.CommBytes):
    return (c.sent, c.recv, c.splits_sent, c.splits_recv, c.peer, c.root, c.first_tensor)


def _same(got, want):
    return got[:6] == want[:6] and got[6] is want[6]


def test_every_byte_count_against_sizes_from_real_tensors():
    seen = set()
    for aten_op, (kind, api, byte_count) in collectives.SPECS.items():
        func = _real_op(aten_op)
        if func is None:  # an op this torch does not have (e.g. _dtensor ops on an older torch)
            continue
        spec = collectives.spec_of(func)
        assert (spec.kind, spec.api, spec.count_bytes) == (kind, api, comm_bytes.BYTE_COUNTS[byte_count]), aten_op
        assert spec.arg_names == [a.name for a in func._schema.arguments]
        for me_root in (True, False):
            args = {a.name: _value(a.name, str(a.type), root=1) for a in func._schema.arguments}
            got = _counted(spec.count_bytes(args, RANKS, 11 if me_root else 12))
            want = _expected(byte_count, me_root)
            if aten_op == "c10d.recv_any_source_":  # no source argument: the peer is not known
                want = want[:4] + (None,) + want[5:]
            assert _same(got, want), (aten_op, me_root, got, want)
        seen.add(byte_count)
    # every entry of the table is used by some op and was checked above
    assert seen == set(comm_bytes.BYTE_COUNTS)


def test_byte_counts_from_kept_sizes_and_without_group_ranks():
    # what export does for funcol's common ops: the input's sizes instead of the tensor, same answer
    meta = comm_bytes.TensorMeta(A.shape, A.dtype, A.element_size())
    for kind in ("funcol_all_gather", "funcol_same_size", "funcol_reduce_scatter", "funcol_all_to_all"):
        f = comm_bytes.BYTE_COUNTS[kind]
        args = {"input": A, "group_size": GROUP_SIZE, "input_split_sizes": IN_SPLITS,
                "output_split_sizes": OUT_SPLITS}
        got, kept = _counted(f(args, RANKS, 11)), _counted(f(dict(args, input=meta), RANKS, 11))
        assert got[:6] == kept[:6] and kept[6] is meta
    # all_to_all without splits: equal chunks per group rank; with the group unknown: no splits
    a2a = comm_bytes.BYTE_COUNTS["funcol_all_to_all"]
    c = a2a({"input": A, "input_split_sizes": [], "output_split_sizes": []}, RANKS, 11)
    assert (c.sent, c.recv, c.splits_sent, c.splits_recv) == (nb(A), nb(A), [nb(A) // 4] * 4, [nb(A) // 4] * 4)
    c = a2a({"input": A, "input_split_sizes": None, "output_split_sizes": None}, None, 11)
    assert (c.sent, c.recv, c.splits_sent, c.splits_recv) == (nb(A), nb(A), None, None)
    # peers and roots stay group ranks when the group's ranks are unknown
    assert comm_bytes.BYTE_COUNTS["c10d_send"]({"tensors": [A], "dst": 2}, None, 0).peer == 2
    assert comm_bytes.BYTE_COUNTS["c10d_broadcast"]({"tensors": [A], "root_rank": 0}, None, 0).sent == nb(A)


def test_specs_of_every_collective_op():
    names = [n for n in torch._C._dispatch_get_all_op_names()
             if n.startswith(("c10d::", "_c10d_functional::", "_c10d_functional_autograd::"))]
    assert len(names) > 30
    for full in names:
        ns, name = full.split("::")
        packet = getattr(getattr(torch.ops, ns), name)
        for ov in packet.overloads():
            s = collectives.spec_of(getattr(packet, ov))
            assert s is None or s in (collectives.WAIT, collectives.WRAP) or isinstance(s, collectives.CollectiveSpec)
    assert collectives.spec_of(torch.ops._c10d_functional.wait_tensor.default) is collectives.WAIT
    assert collectives.spec_of(torch.ops._c10d_functional._wrap_tensor_autograd.default) is collectives.WRAP
    assert collectives.spec_of(torch.ops.aten.add.Tensor) is None
    # the autograd variant is reported as the functional op it runs
    s = collectives.spec_of(torch.ops._c10d_functional_autograd.all_to_all_single.default)
    assert (s.aten_op, s.kind, s.sizes_only) == ("_c10d_functional.all_to_all_single", "all_to_all_single", True)
    # an op outside the table is still a collective, bytes unknown
    s = collectives.spec_of(torch.ops._c10d_functional.batch_p2p_ops.default)
    assert (s.kind, s.api, s.count_bytes) == ("batch_p2p_ops", "functional", comm_bytes.no_bytes)
    assert collectives.spec_of(torch.ops.c10d.send.default).point_to_point
    assert not collectives.spec_of(torch.ops.c10d.allreduce_.default).sizes_only
    # every kind the table names is one the schema knows
    assert {k for k, _a, _b in collectives.SPECS.values()} <= set(schema.COLLECTIVE_KINDS)


# ---- tensors and names ----------------------------------------------------------------------------------

class NoShardTensor:
    """Stands for the ShardTensor class where none is involved."""


def test_tensor_info_plain_fake_and_collected():
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = torch.zeros(2, 3, dtype=torch.float16)
    i = tensor_info(t, NoShardTensor)
    assert (list(i.local_shape), list(i.global_shape), i.placements, i.local_bytes, i.dtype, i.sharding_shapes,
            i.fake, i.on_cuda) == ([2, 3], [2, 3], None, nb(t), torch.float16, None, False, False)
    assert tensor_info(3, NoShardTensor) is None and tensor_info(None, NoShardTensor) is None
    with FakeTensorMode():
        fake = torch.empty(4, 5, device="cuda")
    f = tensor_info(fake, NoShardTensor)
    assert f.fake and not f.on_cuda and f.local_bytes == 4 * 5 * 4
    # top level and one level of lists, kwargs too; non-tensors skipped; at most `limit`
    infos = collect_tensors((t, [t, 1, t], 2.0, [[t]]), {"out": t, "alpha": 1}, NoShardTensor)
    assert len(infos) == 4
    assert len(collect_tensors(([t] * 100,), None, NoShardTensor, limit=64)) == 100  # a list counts once
    assert len(collect_tensors(tuple([t] * 100), None, NoShardTensor, limit=64)) == 64


def test_names():
    assert op_name(torch.conv2d) == "torch.conv2d"
    assert op_name(torch.Tensor.add) == "Tensor.add"
    assert op_name(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
    assert op_name(torch.Tensor.ndim.__get__) == "Tensor.ndim.__get__"
    assert qualname(_h_fn) == f"{__name__}._h_fn" and qualname(None) is None
    node = (torch.ones(2, requires_grad=True) * 2).grad_fn
    assert node_name(node) == node.name() == "MulBackward0"


def test_type_error_trap_tells_operators_from_method_calls():
    t = torch.ones(1)

    class Probe:
        """Asks the question from inside the operator, while the caller's frame is at that instruction."""

        def __radd__(self, other):
            return would_swallow_type_error(torch.Tensor.add, (t, t), sys._getframe(1))

        def __eq__(self, other):
            return would_swallow_type_error(torch.Tensor.eq, (t, t), sys._getframe(1))

        def add(self):
            return would_swallow_type_error(torch.Tensor.add, (t, t), sys._getframe(1))

    assert (1 + Probe()) is True
    assert (1 == Probe()) is True
    assert Probe().add() is False
    assert torch.Tensor.__rsub__ in PY_SWALLOWING_DUNDERS
    assert would_swallow_type_error(torch.Tensor.__rsub__, (t, 1), None)
    assert not would_swallow_type_error(torch.Tensor.__rsub__, (t, "a"), None)  # NotImplemented is right here
    assert not would_swallow_type_error(torch.Tensor.__rsub__, (t,), None)


# ---- the undo log ---------------------------------------------------------------------------------------

def test_undo_log_restores_everything_newest_first():
    class K:
        @classmethod
        def cm(cls):
            return "original"

    raw = K.__dict__["cm"]
    undo = UndoLog()
    undo.setattr(K, "cm", classmethod(lambda cls: "patched"))
    undo.setattr(K, "added", 1)
    order = []
    undo.add(lambda: order.append("first added"))
    undo.add(lambda: order.append("second added"))
    assert K.cm() == "patched" and K.added == 1
    assert undo.restore() == []
    assert K.__dict__["cm"] is raw and K.cm() == "original"  # the classmethod object itself is back
    assert not hasattr(K, "added")
    assert order == ["second added", "first added"]
    # a failing undo does not stop the others; its error is returned
    undo.setattr(K, "x", 1)

    def fails():
        raise RuntimeError("cannot undo")

    undo.add(fails)
    errs = undo.restore()
    assert [str(e) for e in errs] == ["cannot undo"] and not hasattr(K, "x")


def test_undo_log_rebinds_a_function_wherever_a_package_holds_it():
    def original():
        return "original"

    def replacement():
        return "replacement"

    pkg, sub, other = (types.ModuleType("sdbg_units_pkg"), types.ModuleType("sdbg_units_pkg.sub"),
                       types.ModuleType("sdbg_units_other"))
    pkg.helper = original
    sub.imported_by_name = original
    sub.unrelated = len
    other.helper = original  # outside the package: left alone
    sys.modules.update({m.__name__: m for m in (pkg, sub, other)})
    try:
        undo = UndoLog()
        where = undo.replace_globals([(original, replacement)], package="sdbg_units_pkg")
        assert sorted(where) == ["sdbg_units_pkg.helper", "sdbg_units_pkg.sub.imported_by_name"]
        assert pkg.helper is replacement and sub.imported_by_name is replacement and other.helper is original
        assert undo.restore() == []
        assert pkg.helper is original and sub.imported_by_name is original and sub.unrelated is len
    finally:
        for m in (pkg, sub, other):
            sys.modules.pop(m.__name__, None)


# ---- events and their export ------------------------------------------------------------------------------

def _rec() -> RecordingState:
    return RecordingState(RecordingOptions(max_events=3), rank=11, world_size=4)


def _op(rec, seq, depth=0, start=0, parent=None, op="torch.conv2d"):
    t = torch.zeros(1, 3, 5, 8)
    ev = OpEvent(seq, parent, parent, depth, op, "function_handler", "mod.handler", "conv1",
                 ("/u/cell.py", 3, "<module>"), None, 0, [tensor_info(t, NoShardTensor)], start)
    ev.t_start_ns = 1_000
    return ev


def test_every_slot_is_set_by_each_constructor():
    rec = _rec()
    fwd = _op(rec, 0)
    bw = OpEvent.backward(1, None, 0, fwd, "MulBackward0", None, 1, [], [], 5, 9)
    for ev in (fwd, bw):
        assert all(hasattr(ev, s) for s in OpEvent.FIELDS)
    c = CollectiveEvent(2, 0, None, None, 0)
    assert all(hasattr(c, s) for s in CollectiveEvent.FIELDS)
    # a default is the class's until an instance sets its own
    c.waited = True
    assert CollectiveEvent(3, 0, None, None, 0).waited is False


def test_keep_counts_what_a_full_buffer_drops():
    rec = _rec()
    for i in range(5):
        rec.keep(_op(rec, i))
    assert [e.seq for e in rec.buffer] == [0, 1, 2] and rec.dropped == 2


def test_op_record_export():
    rec = _rec()
    parent = _op(rec, 0)
    ev = _op(rec, 1, depth=1, parent=parent, op="Tensor.abs")
    out = torch.zeros(1, 3, 5, 8, dtype=torch.float64)
    ev.output = tensor_info(out, NoShardTensor)
    ev.out_bytes = nb(out)
    ev.t_end_ns = 3_500_000
    ev.fallback = True
    ev.promotions = [Promotion("conv1.weight", torch.Size([4, 3, 3, 3]), torch.float32)]
    r = export.op_record(ev, in_flight=False)
    schema.validate_event(r)
    assert list(r) == list(schema.OP_FIELDS)
    assert (r["seq"], r["parent_seq"], r["depth"], r["op"], r["module"]) == (1, 0, 1, "Tensor.abs", "conv1")
    assert r["in_local_shapes"] == [[1, 3, 5, 8]] and r["out_local_shape"] == [1, 3, 5, 8]
    assert (r["in_bytes"], r["out_bytes"], r["dtype"]) == (1 * 3 * 5 * 8 * 4, nb(out), "float64")
    assert r["user_frame"] == "/u/cell.py:3 in <module>" and r["host_ms"] == pytest.approx(3.499)
    assert r["promotions"] == [{"param": "conv1.weight", "shape": [4, 3, 3, 3], "dtype": "float32"}]
    assert r["fallback"] and r["device_ms"] is None and r["mem_delta_bytes"] is None and r["placements"] is None
    # a backward event takes op, path, handler, module and fallback from its forward event
    bw = OpEvent.backward(7, None, 0, ev, "AbsBackward0", None, 1, [ev.output], [], 10, 20)
    b = export.op_record(bw, in_flight=False)
    schema.validate_event(b)
    assert (b["op"], b["path"], b["module"], b["fwd_seq"], b["phase"], b["fallback"], b["thread"]) == (
        "Tensor.abs", "function_handler", "conv1", 1, "backward", True, 1)
    assert b["user_frame"] is None and b["in_global_shapes"] == [[1, 3, 5, 8]] and b["out_bytes"] == 0


def test_records_are_formatted_without_a_cyclic_collection(monkeypatch):
    """Formatting a recording's records allocates enough containers to start collections, the oldest generation's
    walking every object of the rank's process: the collector is off while each record is made, and on again after
    (off again where it was off)."""
    import gc

    rec = RecordingState(RecordingOptions(max_events=50), rank=0, world_size=1)
    for i in range(50):
        rec.keep(_op(rec, i))
    collector_on = []
    format_one = export._record

    def noting(*args):
        collector_on.append(gc.isenabled())
        return format_one(*args)

    monkeypatch.setattr(export, "_record", noting)
    assert gc.isenabled()
    records = export.records(rec, include_in_flight=False)
    assert collector_on == [False] * 50 and gc.isenabled()
    assert [r["seq"] for r in records] == list(range(50))
    gc.disable()
    try:
        export.records(rec, include_in_flight=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_forward_op_of_a_backward_node():
    rec = _rec()
    # thread 0's forward ops in end order: a nested op (depth 1) ends before its enclosing one
    top1, inner, top2 = _op(rec, 0, start=0), _op(rec, 1, depth=1, start=2), _op(rec, 2, start=10)
    rec.forward_ops = [inner, top1, top2]
    rec.forward_op_ends = [5, 8, 14]
    assert export.forward_op_of(rec, 3) is inner  # made inside the nested op
    assert export.forward_op_of(rec, 1) is top1 and export.forward_op_of(rec, 6) is top1
    assert export.forward_op_of(rec, 9) is None  # between two top-level ops
    assert export.forward_op_of(rec, 12) is top2
    assert export.forward_op_of(rec, 12, limit=2) is None  # top2 had not ended when the node was looked for
    assert export.forward_op_of(rec, 20) is None


def test_collective_record_export_bytes_worked_out_later():
    rec = _rec()
    spec = collectives.spec_of(torch.ops._c10d_functional.all_gather_into_tensor.default)
    g = GroupInfo("g", RANKS, "domain")
    op = _op(rec, 0)
    ev = CollectiveEvent(1, 0, spec, g, 0)
    ev.dtype, ev.shape, ev.input_element_size, ev.deferred_args = A.dtype, A.shape, A.element_size(), (GROUP_SIZE, "g")
    ev.op = ev.outer = op
    ev.t_issue_ns = 5
    r = export.collective_record(ev, in_flight=False, rec=rec)
    schema.validate_event(r)
    assert set(r) == set(schema.COLLECTIVE_FIELDS)
    assert (r["coll"], r["aten_op"], r["api"], r["group_ranks"], r["group_size"], r["mesh_dim"]) == (
        "all_gather_into_tensor", "_c10d_functional.all_gather_into_tensor", "functional", RANKS, 4, "domain")
    assert (r["bytes_sent"], r["bytes_recv"], r["dtype"], r["shape"]) == (nb(A), 4 * nb(A), "float32", [6, 4])
    assert (r["op"], r["op_seq"], r["outer_op"], r["in_flight"]) == ("torch.conv2d", 0, "torch.conv2d", True)
    # the group's ranks unknown: its size from the arguments; issued and returned but never waited for:
    # not completed, so still in flight
    ev.group = GroupInfo("g", None, None)
    ev.t_return_ns = 6
    r = export.collective_record(ev, in_flight=False, rec=rec)
    assert (r["group_ranks"], r["group_size"], r["in_flight"]) == (None, GROUP_SIZE, True)
    ev.t_done_ns, ev.waited = 9, True  # its wait returned: completed
    assert export.collective_record(ev, in_flight=False, rec=rec)["in_flight"] is False
    # backward: attributed at export to the forward op that made the node
    rec.forward_ops, rec.forward_op_ends = [op], [10]
    ev.node_seq_nr, ev.forward_ops_ended, ev.phase = 4, 1, "backward"
    r = export.collective_record(ev, in_flight=False, rec=rec)
    assert (r["op"], r["op_seq"], r["outer_op_seq"], r["phase"]) == ("torch.conv2d", 0, 0, "backward")


def test_memory_deltas_are_opt_in():
    """The CUDA allocator's counter is read around each device-timed op only with ``memory=True`` (two reads
    per op cost as much as the rest of its recording on a host-bound GPU); the payload says which it was."""
    from sharddbg.engine.recorder import Recorder

    with Recorder() as default:
        pass
    with Recorder(memory=True) as with_memory:
        pass
    assert default.memory is False and default.payload(complete=True)["meta"]["memory"] is False
    assert with_memory.memory is True and with_memory.payload(complete=True)["meta"]["memory"] is True


class _FinishedDeviceSpan:
    """What a closed CudaSpan holds once the device passed its end event (CUDA does not run on this machine:
    the export's formatting is what is tested here, the span's CUDA events are not)."""

    __slots__ = ("closed", "mem_delta")

    def __init__(self, mem_delta):
        self.closed = True
        self.mem_delta = mem_delta

    def device_ms(self) -> float:
        return 0.25


@pytest.mark.parametrize("mem_delta", [None, 4096])
def test_device_timed_op_exports_with_and_without_memory(mem_delta):
    """A device-timed op recorded without ``memory=True`` has no allocator delta: exported as None, not an
    error; with it, the delta."""
    rec = _rec()
    ev = _op(rec, 0)
    ev.t_end_ns = 2_000_000
    ev.cuda = _FinishedDeviceSpan(mem_delta)
    r = export.op_record(ev, in_flight=False)
    schema.validate_event(r)
    assert r["device_ms"] == 0.25 and r["mem_delta_bytes"] == mem_delta


@pytest.fixture
def one_rank_mesh():
    """A real DeviceMesh of one CPU rank (a gloo group of one, in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if started:
            dist.destroy_process_group()


def test_records_sharing_a_formatting_pass_keep_their_own_shapes_placements_and_spec_findings(one_rank_mesh):
    """One formatting pass works out each distinct shape, placements, dtype and spec once and reuses it: ops that
    differ in any one of them (the same placements object with another shape, the same shape with other placements,
    the same shape and placements with sharding shapes that disagree with the local tensor, another dtype) must keep
    their own values, and each record its own lists."""
    from torch.distributed.tensor import Replicate, Shard

    rec = RecordingState(RecordingOptions(max_events=20), rank=0, world_size=1)  # rank 0 of one: the mesh's
    assert rec.spec_check
    sharded, replicated = (Shard(0),), (Replicate(),)
    agreeing = {0: (torch.Size([4, 3]),)}
    agreeing_5 = {0: (torch.Size([5, 3]),)}
    lying = {0: (torch.Size([4, 17, 3]),)}  # another tensor's sharding shapes: the spec says (4, 17, 3)

    def info(shape, placements, sharding_shapes, dtype=torch.float32):
        i = tensor_info(torch.zeros(shape, dtype=dtype), NoShardTensor)
        i.placements, i.sharding_shapes, i.mesh, i.shard_tensor = placements, sharding_shapes, one_rank_mesh, True
        return i

    outputs = [info((4, 3), sharded, agreeing), info((4, 3), sharded, lying), info((5, 3), sharded, agreeing_5),
               info((4, 3), replicated, agreeing), info((4, 3), sharded, agreeing, torch.float64),
               info((4, 3), sharded, agreeing)]
    for seq, out in enumerate(outputs):
        ev = _op(rec, seq)
        ev.inputs = [info((4, 3), sharded, agreeing)]  # the same input: the ops differ in their results only
        ev.output = out
        rec.keep(ev)
    several = _op(rec, len(outputs))  # two results, the second lying; _op's plain tensor as its input
    several.outputs = [info((4, 3), sharded, agreeing), info((4, 3), sharded, lying)]
    several.output = several.outputs[0]
    rec.keep(several)
    other_input = _op(rec, len(outputs) + 1)  # the first op's, but for its input's placements
    other_input.inputs = [info((4, 3), replicated, agreeing)]
    # and for sharding shapes of two mesh dims (the second beyond this mesh: not checked)
    other_input.output = info((4, 3), sharded, {0: (torch.Size([4, 3]),), 1: (torch.Size([4, 3]), (2, 3))})
    rec.keep(other_input)
    other_global = _op(rec, len(outputs) + 2)  # the first op's, but for its result's global shape: a wrong one
    other_global.inputs = [info((4, 3), sharded, agreeing)]
    other_global.output = info((4, 3), sharded, agreeing)
    other_global.output.global_shape = torch.Size([8, 3])
    rec.keep(other_global)

    records = export.records(rec, include_in_flight=False)
    # each against the record made on its own (a pass of its own: nothing shared)
    alone = [export.op_record(ev, False, None, {}, None) for ev in rec.buffer]
    assert records == alone
    assert [r["out_local_shape"] for r in records] == [[4, 3], [4, 3], [5, 3]] + [[4, 3]] * 6
    assert [r["out_global_shape"] for r in records] == [[4, 3], [4, 3], [5, 3]] + [[4, 3]] * 5 + [[8, 3]]
    assert [r["placements"] for r in records] == ["(S(0),)"] * 3 + ["(R,)"] + ["(S(0),)"] * 5
    assert [r["in_placements"] for r in records] == [["(S(0),)"]] * 6 + [[None], ["(R,)"], ["(S(0),)"]]
    assert [r["in_local_shapes"] for r in records] == [[[4, 3]]] * 6 + [[[1, 3, 5, 8]], [[4, 3]], [[4, 3]]]
    assert [r["dtype"] for r in records] == ["float32"] * 4 + ["float64"] + ["float32"] * 4
    assert [r["sharding_shapes"] for r in records][:3] == [{"0": [[4, 3]]}, {"0": [[4, 17, 3]]}, {"0": [[5, 3]]}]
    assert records[7]["sharding_shapes"] == {"0": [[4, 3]], "1": [[4, 3], [2, 3]]}
    assert [[(f["output"], f["check"], f["spec_shape"]) for f in r.get("spec_mismatches", [])] for r in records] == [
        [], [(0, "sharding_shapes", [4, 17, 3])], [], [], [], [], [(1, "sharding_shapes", [4, 17, 3])], [],
        [(0, "global_shape", [8, 3])]]
    # lists of their own: changing one record's changes no other's
    records[0]["out_local_shape"][0] = 99
    records[0]["in_local_shapes"][0][0] = 99
    records[0]["sharding_shapes"]["0"][0][0] = 99
    assert records[5]["out_local_shape"] == [4, 3] and records[5]["in_local_shapes"] == [[4, 3]]
    assert records[5]["sharding_shapes"] == {"0": [[4, 3]]}
