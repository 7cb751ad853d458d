"""Pre-flight for collectives on a real 4-rank CPU cluster (gloo, patches registered): before each collective
inside a recorded op, the ranks of its group compare what they are about to send through the rendezvous store,
so that a mismatch is named on every rank before the collective can hang.

The mismatches are real bugs in handlers registered on ShardTensor for custom ops: an all_gather of uneven
shards without padding (rows 17, 17, 16, 16), an all_to_all whose receive sizes one rank gets wrong, two
kinds of collective at one place. Every expected size is computed here from the split. ``compare`` itself is
unit-tested without a cluster.
"""

from __future__ import annotations

import time

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import sharddbg
from sharddbg.engine.recorder.preflight import PREFLIGHT_TIMEOUT_S, compare
from sharddbg.errors import RankError
from sharddbg.magics import trace_summary

N = 4
H = 66
ROWS = [H // N + (1 if r < H % N else 0) for r in range(N)]  # 17, 17, 16, 16
C, W = 4, 64
F32 = 4
NS = "sharddbg_preflight_test"

SETUP = f"""
import time
import torch.distributed._functional_collectives as funcol

def _custom(name, handler):
    def impl(x: torch.Tensor) -> torch.Tensor:
        return x.clone()
    op = torch.library.custom_op(f"{NS}::{{name}}", mutates_args=())(impl)
    ShardTensor.register_named_function_handler(f"{NS}.{{name}}.default", handler)
    return op

def _gather_rows(func, types, args, kwargs):
    x = args[0]
    # the bug: an all_gather of uneven shards without padding them to one size
    return funcol.all_gather_tensor(x._local_tensor, gather_dim=2, group=x._spec.mesh.get_group())

def _exchange(func, types, args, kwargs):
    x = args[0]
    rows = x._local_tensor.reshape(-1, {W})[:4]  # 4 rows of {W} to send, one to each rank
    recv = [1, 1, 1, 1]
    if rank == 1:
        recv = [2, 1, 1, 0]  # the bug: rank 1 expects two rows from rank 0 and none from rank 3
    out = funcol.all_to_all_single(rows, recv, [1, 1, 1, 1], x._spec.mesh.get_group())
    return out.wait() if hasattr(out, "wait") else out

def _two_kinds(func, types, args, kwargs):
    x = args[0]
    s = x._local_tensor.sum().reshape(1)
    g = x._spec.mesh.get_group()
    if rank == 3:
        return funcol.all_gather_tensor(s, 0, g)  # the bug: rank 3 takes the other branch
    return funcol.all_reduce(s, "sum", g)

def _slow_sum(func, types, args, kwargs):
    x = args[0]
    if rank == 3:
        time.sleep({PREFLIGHT_TIMEOUT_S} + 0.5)
    s = x._local_tensor.sum().reshape(1)
    return funcol.all_reduce(s, "sum", x._spec.mesh.get_group())

gather_rows = _custom("gather_rows", _gather_rows)
exchange = _custom("exchange", _exchange)
two_kinds = _custom("two_kinds", _two_kinds)
slow_sum = _custom("slow_sum", _slow_sum)
torch.manual_seed(0)
xp = sharddbg.engine.scatter(torch.randn(1, {C}, {H}, {W}), dim=2)
netp = nn.Sequential(nn.Conv2d({C}, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
"""


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=60)
    yield cluster4
    cluster4.run("for _n in ('gather_rows', 'exchange', 'two_kinds', 'slow_sum'):\n"
                 f"    ShardTensor._named_function_registry.pop(f'{NS}.{{_n}}.default', None)", timeout=30)


def _shape(dims) -> str:
    return "(" + ", ".join(map(str, dims)) + ")"


def test_a_conv_net_passes_and_computes_the_same(cl):
    """Forward and backward of the halo convs: every collective inside an op is checked, all agree, and the
    results are those of the same step without pre-flight."""
    cl.run("netp.zero_grad()", timeout=30)
    plain = cl.trace("yp = netp(xp)\nyp.square().mean().backward()\n"
                     "ref = (yp.full_tensor().sum().item(), netp[0].weight.grad.sum().item())")
    ref = cl.pull("ref")
    cl.run("netp.zero_grad()", timeout=30)
    t = cl.trace("yp = netp(xp)\nyp.square().mean().backward()\n"
                 "got = (yp.full_tensor().sum().item(), netp[0].weight.grad.sum().item())", preflight=True)
    assert cl.pull("got") == ref
    assert t.checks["preflight"] and not plain.checks["preflight"] and plain.get_preflight().empty
    pf = t.get_preflight()
    colls = t.get_collectives()
    inside = colls[colls["op"].notna() & (colls["op"] != "<outside recorded ops>")]
    assert len(pf) == len(inside) > 0  # each collective of an op (forward and backward) was checked ...
    assert set(pf["status"]) == {"ok"} and (pf["ms"] >= 0).all()  # ... and agreed
    assert {"all_to_all_single", "all_reduce"} <= set(pf["kind"])
    assert "backward" in set(pf["phase"])
    assert f"pre-flight: {len(pf)} collective checks ok" in trace_summary(t)


def test_the_checks_leave_no_keys_in_the_store(cl):
    """Each rank deletes its descriptions once the group has read them, the last ones when the recording stops."""
    keys = "dist.distributed_c10d._get_default_store().num_keys()"
    before = cl.eval(keys)
    cl.trace("yp = netp(xp)\nyp.square().mean().backward()", preflight=True)
    after = cl.eval(keys)
    assert after == before


def test_uneven_shards_into_one_all_gather_are_named_before_it_hangs(cl):
    t0 = time.perf_counter()
    with pytest.raises(RankError) as err:
        cl.trace("full = gather_rows(xp)", preflight=True, timeout=30)
    assert time.perf_counter() - t0 < 20  # no wait for a collective timeout
    detail = (f"ranks 2, 3 send {_shape((1, C, ROWS[2], W))}, the others {_shape((1, C, ROWS[0], W))}")
    head = str(err.value).splitlines()[0]
    assert head.startswith("ranks [0, 1, 2, 3] raised CollectiveMismatchError: all_gather_into_tensor on process "
                           f"group 'domain' (collective 0 of this trace on it) in {NS}.gather_rows.default: {detail}")
    assert "line 1 of the cell: `full = gather_rows(xp)`" in head
    t = cl.last_trace()
    pf = t.get_preflight()
    assert list(pf["rank"]) == [0, 1, 2, 3] and set(pf["status"]) == {"mismatch"} and set(pf["detail"]) == {detail}
    assert t.get_collectives().empty  # never issued: nothing moved, nothing in flight
    assert "collective(s) never completed" not in trace_summary(t)
    assert f"pre-flight stopped {NS}.gather_rows.default: {detail}" in trace_summary(t)
    errors = t.get_errors()
    assert set(errors["exc_type"]) == {"sharddbg.engine.recorder.preflight.CollectiveMismatchError"}
    # the group was never used wrongly: it still works
    assert cl.broken is None
    assert cl.eval("float(xp.full_tensor().sum())")[0] == pytest.approx(cl.eval("float(xp.full_tensor().sum())")[1])


def test_an_all_to_all_with_wrong_receive_sizes_is_named(cl):
    with pytest.raises(RankError, match="CollectiveMismatchError"):
        cl.trace("ex = exchange(xp)", preflight=True, timeout=30)
    row_bytes = W * F32
    detail = f"rank 0 sends {row_bytes} bytes to rank 1, which expects {2 * row_bytes} bytes from rank 0"
    pf = cl.last_trace().get_preflight()
    assert set(pf["detail"]) == {detail} and set(pf["kind"]) == {"all_to_all_single"}
    assert cl.broken is None


def test_two_kinds_of_collective_at_one_place_are_named(cl):
    with pytest.raises(RankError, match="rank 3 issues all_gather_into_tensor, the others all_reduce"):
        cl.trace("tk = two_kinds(xp)", preflight=True, timeout=30)
    assert cl.broken is None


def test_a_late_rank_does_not_stop_the_others(cl):
    """Rank 3 reaches the collective after the pre-flight's time limit: the others issue it unchecked and wait
    in it as they would anyway; rank 3 finds every description there and checks it."""
    t = cl.trace("ss = slow_sum(xp)", preflight=True, timeout=60)
    pf = t.get_preflight().set_index("rank")
    for r in (0, 1, 2):
        assert pf.loc[r, "status"] == "late" and pf.loc[r, "late_ranks"] == [3]
        assert pf.loc[r, "ms"] == pytest.approx(PREFLIGHT_TIMEOUT_S * 1e3, abs=500)
        assert pf.loc[r, "detail"] == f"rank 3 had not described it within {PREFLIGHT_TIMEOUT_S:g} s; issued unchecked"
    assert pf.loc[3, "status"] == "ok"
    assert len(set(cl.eval("float(ss)"))) == 1  # the all_reduce ran, the same sum everywhere
    assert "3 late" in trace_summary(t)


def test_the_magic_takes_preflight_and_replicas(cl):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    assert sharddbg.active_cluster() is cl
    with capture_output() as cap:
        ip.run_cell_magic("shard_trace", "--preflight --replicas", "yp = netp(xp)")
    t = sharddbg.last_trace()
    assert t.checks == {"spec_check": True, "replicas": True, "preflight": True}
    assert "pre-flight: " in cap.stdout and "replicas agree on every rank" in cap.stdout
    with capture_output() as cap:
        ip.run_cell_magic("shard_trace", "--no-spec-check --quiet", "yp = netp(xp)")
    assert sharddbg.last_trace().checks == {"spec_check": False, "replicas": False, "preflight": False}
    assert cap.stdout == ""


# ---- the comparison, without a cluster ----------------------------------------------------------------------

def _desc(kind="all_reduce", dtype="float32", shape=(1, 4, 17, 64), sent=None, recv=None):
    return {"kind": kind, "dtype": dtype, "shape": list(shape), "splits_sent": sent, "splits_recv": recv}


def test_compare_names_what_disagrees():
    same = {r: _desc() for r in range(4)}
    assert compare(same, [0, 1, 2, 3]) is None
    assert compare({**same, 2: _desc(shape=(1, 4, 16, 64))}, [0, 1, 2, 3]) == \
        "rank 2 sends (1, 4, 16, 64), the others (1, 4, 17, 64)"
    assert compare({**same, 1: _desc(dtype="float64")}, [0, 1, 2, 3]) == \
        "rank 1 sends float64, the others float32"
    assert compare({**same, 0: _desc(kind="broadcast")}, [0, 1, 2, 3]) == \
        "rank 0 issues broadcast, the others all_reduce"
    # a tie: the lowest rank's value is "the others'"
    assert compare({0: _desc(shape=(3,)), 1: _desc(shape=(4,))}, [0, 1]) == "rank 1 sends (4,), the others (3,)"
    # all_to_all: sizes may differ per rank; what one sends to another must be what that one expects
    a2a = {0: _desc("all_to_all_single", shape=(5, 2), sent=[8, 12], recv=[8, 16]),
           1: _desc("all_to_all_single", shape=(7, 2), sent=[16, 12], recv=[12, 12])}
    assert compare(a2a, [0, 1]) is None
    a2a[1]["splits_recv"] = [4, 12]
    assert compare(a2a, [0, 1]) == "rank 0 sends 12 bytes to rank 1, which expects 4 bytes from rank 0"
