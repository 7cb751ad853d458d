"""Collective recording on a real 4-rank CPU cluster (gloo, patches registered).

Every expected kind, count and byte size is computed here from the tensor sizes (uneven rows 17,17,16,16;
halo of one row for a 3x3 conv; chunked Shard(3)), and cross-checked against torch's CommDebugMode
run on the same code, for what CommDebugMode can see.

Seen while writing these: CommDebugMode around an ``nn.Module`` call on an UNEVEN ShardTensor (rows
17,17,16,16) crashes on the 16-row ranks ("shape '[1, 3, 17, 8]' is invalid for input of size 384"): its
module backward hooks (``BackwardHookFunction.apply``) go through ShardTensor's DTensor fallback, which
infers even chunks; the 17-row ranks then hang in the halo all_to_all. So the CommDebugMode comparisons
run the functional conv (``cconv``), the same code as the traced one.
"""

from __future__ import annotations

import pandas as pd
import pytest

from sharddbg import schema
from sharddbg.errors import ClusterError
from sharddbg.analysis.comm import COLLECTIVE_COLUMNS
from sharddbg.exporters.perfetto import perfetto_dict
from sharddbg.trace import Trace, load_trace

N = 4
H, W, C, CO = 66, 8, 3, 4
ROWS = [H // N + (1 if r < H % N else 0) for r in range(N)]  # 17, 17, 16, 16
F32 = 4

SETUP = f"""
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor

cmesh = DistributedManager().global_mesh["domain"]
torch.manual_seed(1)
cX = torch.randn(1, {C}, {H}, {W})
crank = dist.get_rank()
_cp = torch.tensor_split(cX, {N}, dim=2)
_cshapes = {{0: [tuple(p.shape) for p in _cp]}}
cx = ShardTensor.from_local(_cp[crank].clone().requires_grad_(True), cmesh, (Shard(2),), sharding_shapes=_cshapes)

class CNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d({C}, {CO}, 3, padding=1)
    def forward(self, x):
        return self.conv(x)

cnet = CNet()
_gshapes = {{0: [(1, {CO}, p.shape[2], {W}) for p in _cp]}}
cgy = ShardTensor.from_local(torch.ones(1, {CO}, _cp[crank].shape[2], {W}), cmesh, (Shard(2),), sharding_shapes=_gshapes)

def cconv(x):  # the conv without the module: CommDebugMode's module hooks break on uneven shards (see below)
    return torch.nn.functional.conv2d(x, cnet.conv.weight, cnet.conv.bias, padding=1)

def cdm_counts(cdm):
    return {{str(k).split('.')[-1]: int(v) for k, v in cdm.get_comm_counts().items() if v}}
"""


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=120)
    return cluster4


def _colls(t: Trace, rank: int | None = None) -> pd.DataFrame:
    c = t.get_collectives()
    return c if rank is None else c[c["rank"] == rank].reset_index(drop=True)


def _halo_splits(r: int) -> list[int]:
    """3x3 conv, padding 1, rows sharded: one input row (C x W floats) to each neighbouring rank."""
    return [C * W * F32 if abs(j - r) == 1 else 0 for j in range(N)]


def _check_clean(t: Trace) -> None:
    for p in t.payloads.values():
        assert p["meta"]["internal_errors"] == [] and p["meta"]["reentries"] == 0
        for ev in p["events"]:
            schema.validate_event(ev)


def _cdm(cl, code: str) -> list[dict]:
    """CommDebugMode's counts per rank for ``code`` (run without the recorder)."""
    cl.run("with CommDebugMode() as _cdm:\n" + "".join("    " + ln + "\n" for ln in code.strip().splitlines())
           + "_cdm_counts = cdm_counts(_cdm)\n", timeout=60)
    return cl.eval("_cdm_counts")


def _kind_counts(c: pd.DataFrame) -> dict:
    return {k: int(v) for k, v in c["kind"].value_counts().items()}


def test_conv2d_forward_halo_all_to_all(cl):
    t = cl.trace("cy = cconv(cx)", timeout=60, display=False)
    _check_clean(t)
    c = _colls(t)
    assert list(c.columns[:len(COLLECTIVE_COLUMNS)]) == COLLECTIVE_COLUMNS
    ops = t.get_ops()
    for r in range(N):
        cr = c[c["rank"] == r]
        assert _kind_counts(cr) == {"all_to_all_single": 1}
        row = cr.iloc[0]
        assert row["splits_sent"] == _halo_splits(r) and row["splits_recv"] == _halo_splits(r)
        assert row["bytes_sent"] == sum(_halo_splits(r)) == row["bytes_recv"]
        conv = ops[(ops["rank"] == r) & (ops["op"] == "torch.conv2d") & (ops["phase"] == "forward")].iloc[0]
        assert row["op"] == row["outer_op"] == "torch.conv2d" and row["op_seq"] == conv["seq"]
        assert conv["t_start_ns"] <= row["t_issue_ns"] <= row["t_done_ns"] <= conv["t_end_ns"]
        assert row["group_ranks"] == list(range(N)) and row["mesh_dim"] == "domain"
        assert row["phase"] == "forward" and row["async"] and row["waited"]
        assert row["duration_ms"] > 0 and row["bandwidth_gbps"] == pytest.approx(
            row["bytes_sent"] / (row["duration_ms"] / 1e3) / 1e9)
    # CommDebugMode on the same code sees the same count
    for counts in _cdm(cl, "_y = cconv(cx)"):
        assert counts == {"all_to_all_single": 1}
    # comm per op: the conv owns its collective
    by_op = t.get_comm_by_op()
    conv_rows = by_op[by_op["op"] == "torch.conv2d"].set_index("rank")
    for r in range(N):
        assert conv_rows.loc[r, "n_collectives"] == 1 and conv_rows.loc[r, "calls"] == 1
        assert conv_rows.loc[r, "bytes_sent"] == sum(_halo_splits(r))
        assert 0 < conv_rows.loc[r, "comm_share"] <= 1
        assert conv_rows.loc[r, "comm_ms"] == pytest.approx(c[c["rank"] == r]["duration_ms"].sum())
        assert conv_rows.loc[r, "bwd_n_collectives"] == 0 and conv_rows.loc[r, "n_in_flight"] == 0
    by_call = t.get_comm_by_op(by="call")
    assert (by_call[by_call["op"] == "torch.conv2d"]["n_collectives"] == 1).all()
    imb = t.get_imbalance()
    ci = imb[imb["op"] == "torch.conv2d"].set_index("rank")
    for r in range(N):
        assert ci.loc[r, "shard_elems"] == ROWS[r] * C * W  # the input shard (the weights are replicated)
    assert ci["shard_imbalance"].iloc[0] == pytest.approx(17 / (66 / 4))
    assert (ci["wait_ms"] >= 0).all() and (ci["wait_ms"] == 0).any()  # the last rank to arrive waited 0
    # Perfetto: one slice per collective on a "collectives" track, issue -> wait returned
    pf = perfetto_dict(t)["traceEvents"]
    sl = [e for e in pf if str(e.get("cat", "")).startswith("collective")]
    assert sorted(e["pid"] for e in sl) == list(range(N))
    for e in sl:
        row = c[c["rank"] == e["pid"]].iloc[0]
        assert e["ph"] == "X" and e["name"] == "all_to_all_single" and {"ts", "dur", "tid", "args"} <= set(e)
        assert e["dur"] == pytest.approx((row["t_done_ns"] - row["t_issue_ns"]) / 1000.0)
        assert e["args"]["op"] == "torch.conv2d" and e["args"]["bytes_sent"] == row["bytes_sent"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in pf if e.get("name") == "thread_name"}
    assert all(names[(e["pid"], e["tid"])] == "collectives" for e in sl)


def test_conv2d_backward_weight_grad_all_reduce_named(cl):
    t = cl.trace("cy = cnet(cx)\ncy.backward(cgy)", timeout=60, display=False)
    _check_clean(t)
    c = _colls(t)
    ops = t.get_ops()
    for r in range(N):
        cr = c[(c["rank"] == r) & (c["phase"] == "backward")]
        assert _kind_counts(cr) == {"all_to_all_single": 1, "all_reduce": 2}
        conv = ops[(ops["rank"] == r) & (ops["op"] == "torch.conv2d") & (ops["phase"] == "forward")]
        assert set(cr["op"]) == {"torch.conv2d"} and set(cr["op_seq"]) == {conv["seq"].iloc[0]}  # the forward op
        ar = cr[cr["kind"] == "all_reduce"].set_index("param")
        assert ar.loc["conv.weight", "bytes_sent"] == CO * C * 3 * 3 * F32
        assert ar.loc["conv.bias", "bytes_sent"] == CO * F32
        assert set(ar["autograd_node"]) == {"GradReducerBackward"}
        assert ar.loc["conv.weight", "params"] == ["conv.weight"] and pd.isna(ar.loc["conv.weight", "bucket"])
        a2a = cr[cr["kind"] == "all_to_all_single"].iloc[0]
        # the halo's backward returns the gradient of the borrowed rows: the same rows, the other way
        assert a2a["splits_sent"] == _halo_splits(r) and pd.isna(a2a["param"])
        assert "Halo" in a2a["autograd_node"]
    # forward and backward apart: the conv's one halo forward, its three backward collectives
    by_op = t.get_comm_by_op().set_index(["op", "rank"])
    for r in range(N):
        row = by_op.loc[("torch.conv2d", r)]
        fwd = c[(c["rank"] == r) & (c["op"] == "torch.conv2d") & (c["phase"] == "forward")]
        bwd = c[(c["rank"] == r) & (c["op"] == "torch.conv2d") & (c["phase"] == "backward")]
        assert row["n_collectives"] == len(fwd) + len(bwd) == 4 and row["bwd_n_collectives"] == len(bwd) == 3
        assert row["comm_ms"] == pytest.approx(fwd["duration_ms"].sum()) and row["comm_share"] <= 1
        assert row["bwd_comm_ms"] == pytest.approx(bwd["duration_ms"].sum())
    # the gradient arrived where the collectives say: grad of the weight equals the single-process one
    ok = cl.eval("bool(torch.allclose(cnet.conv.weight.grad, torch.autograd.grad(torch.nn.functional.conv2d("
                 "cX, cnet.conv.weight, cnet.conv.bias, padding=1), cnet.conv.weight, torch.ones(1, 4, 66, 8))[0], "
                 "atol=1e-4))")
    assert ok == [True] * N
    cl.run("cnet.zero_grad(); cx.grad = None", timeout=30)
    cl.run("cy = cconv(cx)", timeout=60)
    for counts in _cdm(cl, "cy.backward(cgy)"):
        assert counts == {"all_to_all_single": 1, "all_reduce": 2}
    cl.run("cnet.zero_grad(); cx.grad = None", timeout=30)


def test_full_tensor_uneven_and_redistribute(cl):
    t = cl.trace("cf = cx.full_tensor()\ncz = cx.redistribute(cmesh, (Shard(3),))", timeout=60, display=False)
    _check_clean(t)
    assert cl.eval("bool(torch.equal(cf, cX))") == [True] * N
    c = _colls(t)
    pad = max(ROWS) * C * W * F32  # all_gather of an uneven tensor: every shard padded to the largest
    cols = [len(x) for x in __import__("numpy").array_split(range(W), N)]  # Shard(3) chunks: 2,2,2,2
    for r in range(N):
        cr = c[c["rank"] == r]
        assert list(cr["kind"]) == ["all_gather_into_tensor", "all_to_all_single"]
        ag, a2a = cr.iloc[0], cr.iloc[1]
        assert ag["bytes_sent"] == pad and ag["bytes_recv"] == N * pad
        assert ag["outer_op"] == "ShardTensor.full_tensor" and ag["op"] == "ShardTensor.redistribute"
        assert a2a["splits_sent"] == [C * ROWS[r] * cols[j] * F32 for j in range(N)]
        assert a2a["splits_recv"] == [C * ROWS[j] * cols[r] * F32 for j in range(N)]
        assert a2a["bytes_sent"] == ROWS[r] * C * W * F32
        assert a2a["op"] == a2a["outer_op"] == "ShardTensor.redistribute"
        assert list(cr["group_seq"]) == sorted(cr["group_seq"])
    for counts in _cdm(cl, "_f = cx.full_tensor()"):
        assert counts == {"all_gather_into_tensor": 1}
    # what CommDebugMode counts for full_tensor is its inclusive total (issued by the redistribute inside)
    inc = t.get_comm_by_op(inclusive=True).set_index(["op", "rank"])
    exc = t.get_comm_by_op().set_index(["op", "rank"])
    for r in range(N):
        assert exc.loc[("ShardTensor.full_tensor", r), "n_collectives"] == 0
        assert inc.loc[("ShardTensor.full_tensor", r), "kinds"] == {"all_gather_into_tensor": 1}
        assert inc.loc[("ShardTensor.full_tensor", r), "bytes_sent"] == pad
        # the redistribute of the second line is a user call of its own: its all_to_all, and the all_gather
        # of the one inside full_tensor
        assert inc.loc[("ShardTensor.redistribute", r), "kinds"] == {"all_gather_into_tensor": 1, "all_to_all_single": 1}
    for counts in _cdm(cl, "_z = cx.redistribute(cmesh, (Shard(3),))"):
        assert counts == {"all_to_all_single": 1}


def test_own_and_nested_calls_of_one_op_are_named_in_both_tables(cl):
    """``redistribute`` called by the user (its all_to_all) and inside ``full_tensor`` (its all_gather): the op
    summary counts the user's own call, get_comm_by_op every call; each table says which it counts."""
    t = cl.trace("cf = cx.full_tensor()\ncz = cx.redistribute(cmesh, (Shard(3),))", timeout=60, display=False)
    _check_clean(t)
    c = _colls(t)
    by_op = t.get_comm_by_op().set_index(["op", "rank"])
    for r in range(N):
        red = by_op.loc[("ShardTensor.redistribute", r)]
        assert (red["calls"], red["own_calls"], red["nested_calls"]) == (2, 1, 1)
        # the collectives of each call, as get_collectives() attributes them
        cr = c[(c["rank"] == r) & (c["op"] == "ShardTensor.redistribute")]
        nested = cr[cr["outer_op"] == "ShardTensor.full_tensor"]
        assert (red["n_collectives"], red["own_n_collectives"], red["nested_n_collectives"]) == (
            len(cr), len(cr) - len(nested), len(nested)) == (2, 1, 1)
        ft = by_op.loc[("ShardTensor.full_tensor", r)]
        assert (ft["own_calls"], ft["nested_calls"], ft["n_collectives"]) == (1, 0, 0)
    calls = t.get_comm_by_op(by="call")
    assert sorted(calls[calls["op"] == "ShardTensor.redistribute"]["nested"]) == [False] * N + [True] * N
    # the op summary: the user's own call only (what own_calls / own_n_collectives say), every call when nested
    own = t.get_op_summary().set_index(["op", "phase"]).loc[("ShardTensor.redistribute", "forward")]
    assert (own["calls"], own["nested_calls"], own["n_collectives"]) == (N, 0, N)
    every = t.get_op_summary(nested=True).set_index(["op", "phase"]).loc[("ShardTensor.redistribute", "forward")]
    assert (every["calls"], every["nested_calls"], every["n_collectives"]) == (2 * N, N, 2 * N)
    # self counts over every call add up to every collective issued inside a recorded op (here: all of them)
    assert t.get_op_summary(nested=True)["n_collectives"].sum() == len(c) == c["op_seq"].notna().sum()


def test_backward_comm_stands_apart_from_the_backward_events_host_time(cl):
    """A conv's backward collectives run in autograd nodes of their own (weight and bias reductions, the halo's
    gradient), outside the backward event timed at its output node: the op summary puts them in a column of
    their own, and the explorer shows them apart from the host time they are not part of."""
    from sharddbg.views import explorer

    t = cl.trace("cy = cnet(cx)\ncy.backward(cgy)", timeout=60, display=False)
    cl.run("cnet.zero_grad(); cx.grad = None", timeout=30)
    _check_clean(t)
    c, ops = _colls(t), t.get_ops()
    summary = explorer.summary_frame(t).set_index(["op", "phase"])  # what the explorer shows
    for phase in ("forward", "backward"):
        row = summary.loc[("torch.conv2d", phase)]
        mine = c[(c["op"] == "torch.conv2d") & ((c["phase"] == "backward") == (phase == "backward"))]
        events = ops[(ops["op"] == "torch.conv2d") & (ops["phase"] == phase)]
        # issued while one of the row's timed events ran on that rank (a backward event times its forward call's
        # output node): the part of the communication that lies within host_ms_total
        within = [any(e.t_start_ns <= x.t_issue_ns <= e.t_end_ns for e in events.itertuples()
                      if e.rank == x.rank and (e.seq if phase == "forward" else e.fwd_seq) == x.op_seq)
                  for x in mine.itertuples()]
        inside, outside = mine[within], mine[[not w for w in within]]
        assert row["comm_ms_within_host"] == pytest.approx(inside["duration_ms"].sum())
        assert row["comm_ms_outside_host"] == pytest.approx(outside["duration_ms"].sum())
        assert row["comm_ms_within_host"] + row["comm_ms_outside_host"] == pytest.approx(row["comm_ms_inclusive"])
        assert row["comm_ms_inclusive"] == pytest.approx(mine["duration_ms"].sum())
        assert row["host_ms_total"] == pytest.approx(events["host_ms"].sum())
    fwd, bwd = summary.loc[("torch.conv2d", "forward")], summary.loc[("torch.conv2d", "backward")]
    assert fwd["comm_ms_outside_host"] == 0 and fwd["comm_ms_within_host"] > 0  # the halo, inside each call
    # the weight and bias reductions and the halo's gradient, 3 per rank: none in the timed output node
    assert bwd["n_collectives"] == 3 * N and bwd["comm_ms_within_host"] == 0 and bwd["comm_ms_outside_host"] > 0
    # the explorer's headers say which is which, and what each stands against
    heads = {c[0]: c for c in explorer.SUMMARY_LIST_COLUMNS}
    assert heads["comm_ms_within_host"][1] == "comm ms in host" and "part of host ms" in heads["comm_ms_within_host"][3]
    assert "other autograd nodes" in heads["comm_ms_outside_host"][3]
    assert "comm_ms_inclusive" not in heads
    html = explorer.explorer_html(t)
    assert ">bwd comm ms, other nodes</th>" in html and "outside host ms" in html
    assert "bwd comm other nodes" in explorer.explorer_text(t)


def test_every_view_puts_a_collective_under_the_same_op(cl):
    """A conv forward and backward, a Partial loss's backward() (its redistribute all_reduce) and a full_tensor
    (its redistribute all_gather): the comm-per-op figure and get_comm_by_kind put each collective under the op
    the explorer's op summary counts it for, the user's own call, and name the op inside that issued it."""
    from sharddbg.views import explorer
    from sharddbg.views import timeline as tl
    from sharddbg.views.comm import plot_comm_by_op

    t = cl.trace("cy = cnet(cx)\ncy.square().mean().backward()\ncf = cx.full_tensor()", timeout=60, display=False)
    cl.run("cnet.zero_grad(); cx.grad = None", timeout=30)
    _check_clean(t)
    c = _colls(t)
    assert set(c["op"]) == {"torch.conv2d", "ShardTensor.redistribute"}  # who issued them: the innermost op
    # the explorer's rows: within the calls' host time plus in the op's other autograd nodes, over both phases
    rows = explorer.summary_frame(t)
    shown = (rows["comm_ms_within_host"] + rows["comm_ms_outside_host"]).groupby(rows["op"]).sum()
    shown = shown[shown > 0]
    fig = plot_comm_by_op(t)
    drawn: dict[str, float] = {}
    for d in fig.data:
        if d.xaxis == "x2":
            for op, ms in zip(d.y, d.x):
                drawn[op] = drawn.get(op, 0.0) + float(ms)
    drawn = {op: ms for op, ms in drawn.items() if ms > 0}
    assert set(drawn) == set(shown.index) == {"torch.conv2d", "ShardTensor.backward", "ShardTensor.full_tensor"}
    for op, ms in drawn.items():
        assert ms == pytest.approx(shown[op]), op
    assert sum(drawn.values()) == pytest.approx(c["duration_ms"].sum())  # every collective once
    # the table behind the figure says the same, and which op inside issued them
    kinds = t.get_comm_by_kind().set_index(["op", "kind"])
    assert kinds.loc[("ShardTensor.backward", "all_reduce"), "via"] == "ShardTensor.redistribute"
    assert kinds.loc[("ShardTensor.full_tensor", "all_gather_into_tensor"), "via"] == "ShardTensor.redistribute"
    assert set(kinds.xs("torch.conv2d")["via"]) == {""}
    hovers = {(op, v) for d in fig.data if d.xaxis == "x2" for op, (_, v) in zip(d.y, d.customdata) if v}
    assert ("ShardTensor.backward", "<br>issued via ShardTensor.redistribute") in hovers
    # the timeline's span of that all_reduce names both
    spans = tl.collective_spans(t)
    assert (spans["kind"] == "all_reduce").any()
    assert any("from op ShardTensor.redistribute (in ShardTensor.backward)<br>" in h for h in spans["hover"])
    # a call's detail in the explorer lists the collectives its row counts, by the same rule (one call here on
    # every rank, so the row's and the detail's are the same): the backward() call its redistribute's all_reduce,
    # the conv's backward event those of its autograd nodes, the conv's forward call its halo exchange and, apart
    # by phase, its backward's too
    ops = t.get_ops()
    expected_phases = {("ShardTensor.backward", "forward"): {"forward"}, ("torch.conv2d", "backward"): {"backward"},
                       ("torch.conv2d", "forward"): {"forward", "backward"}}
    for (op, phase), phases in expected_phases.items():
        first = ops[(ops["op"] == op) & (ops["phase"] == phase) & (ops["rank"] == 0)].iloc[0]
        listed = explorer.op_detail(t, 0, int(first["seq"]))["collectives"]
        for shown_phase, part in listed.groupby("phase"):
            row = rows[(rows["op"] == op) & (rows["phase"] == shown_phase)].iloc[0]
            assert part["duration_ms"].sum() == pytest.approx(row["comm_ms_within_host"] + row["comm_ms_outside_host"])
        assert set(listed["phase"]) == phases, (op, phase)


def test_plain_dtensor_ops_are_recorded_and_without_them_the_trace_says_why(cl):
    """Plain torch DTensor code (its own DeviceMesh on gloo, distribute_tensor, a matmul and a sum, full_tensor):
    its calls are recorded as ops with DTensor's own paths, their collectives under them; recorded without
    them (``dtensor=False``), the findings say why there is no op, with the collectives counted from the trace."""
    from sharddbg.magics import trace_summary
    from sharddbg.options import RecordingOptions
    from sharddbg.views import explorer

    cl.run("from torch.distributed.device_mesh import init_device_mesh\n"
           "from torch.distributed.tensor import Replicate, distribute_tensor\n"
           f"_pmesh = init_device_mesh('cpu', ({N},))", timeout=60)
    code = ("_pa = distribute_tensor(torch.arange(64.0).reshape(8, 8), _pmesh, [Shard(0)])\n"
            "_pw = distribute_tensor(torch.ones(8, 2), _pmesh, [Replicate()])\n"
            "_pfull = (_pa @ _pw).sum().full_tensor()")
    t = cl.trace(code, timeout=60, display=False)
    _check_clean(t)
    assert cl.eval("float(_pfull)") == [2.0 * sum(range(64))] * N  # it computed, on every rank
    ops = t.get_ops()
    for rank in range(N):
        mine = ops[ops["rank"] == rank]
        assert list(zip(mine["op"], mine["path"])) == [("Tensor.matmul", "dtensor_propagation"),
                                                      ("Tensor.sum", "dtensor_propagation"),
                                                      ("DTensor.full_tensor", "dtensor_redistribute")]
    c = _colls(t)
    # the sum is Partial: full_tensor reduces it, one all_reduce per rank under it; distribute_tensor is no op
    reduced = c[c["op"] == "DTensor.full_tensor"]
    assert list(reduced["kind"]) == ["all_reduce"] * N and set(reduced["rank"]) == set(range(N))
    assert not [f for f in t.findings if f.kind == "no_recorded_ops"]

    t = cl.trace(code, timeout=60, display=False, options=RecordingOptions(dtensor=False))
    assert t.get_ops().empty
    c = _colls(t)
    per_rank = c.groupby("rank").size()
    assert len(c) > 0 and c["op"].isna().all() and set(per_rank) == {len(c) // N}
    (found,) = [f for f in t.findings if f.kind == "no_recorded_ops"]
    assert found.severity == "info" and found.ranks == tuple(range(N))
    assert found.sentence == (f"no ShardTensor op was called: {len(c)} collectives ({len(c) // N} per rank) ran "
                              "outside recorded ops (plain DTensor calls are recorded only with dtensor=True, "
                              "torch.distributed calls made by the user's code never are)")
    assert found.sentence in trace_summary(t) and found.text() in explorer.explorer_text(t)
    assert t.overview.op_calls == 0 and t.overview.collectives == len(c)


P2P = """
_n = dist.get_world_size()
_send = torch.full((7,), float(crank))
_recv = torch.zeros(7)
_reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, _send, (crank + 1) % _n),
                                dist.P2POp(dist.irecv, _recv, (crank - 1) % _n)])
for _q in _reqs:
    _q.wait()
_ar = torch.ones(5)
dist.all_reduce(_ar)
"""


def test_point_to_point_and_c10d(cl, tmp_path):
    t = cl.trace(P2P, timeout=60, display=False)
    _check_clean(t)
    t2 = load_trace(t.save(tmp_path / "p2p.sdtrace.json"))  # collectives survive a save / load round trip
    pd.testing.assert_frame_equal(t2.get_collectives(), t.get_collectives())
    assert cl.eval("int(_recv[0])") == [(r - 1) % N for r in range(N)]
    c = _colls(t)
    for r in range(N):
        cr = c[c["rank"] == r]
        assert list(cr["kind"]) == ["send", "recv", "all_reduce"]
        s, rv, ar = cr.iloc[0], cr.iloc[1], cr.iloc[2]
        assert (s["bytes_sent"], s["bytes_recv"], s["peer"]) == (7 * F32, 0, (r + 1) % N)
        assert (rv["bytes_sent"], rv["bytes_recv"], rv["peer"]) == (0, 7 * F32, (r - 1) % N)
        assert s["async"] and rv["async"] and s["waited"] and rv["waited"]
        assert s["t_done_ns"] >= s["t_issue_ns"] and rv["t_done_ns"] >= rv["t_issue_ns"]
        assert ar["bytes_sent"] == ar["bytes_recv"] == 5 * F32 and not ar["async"] and ar["waited"]
        assert ar["api"] == "c10d" and pd.isna(ar["op"])
    # CommDebugMode does not count point-to-point traffic at all (what the recorder adds)
    for counts in _cdm(cl, P2P):
        assert "send" not in counts and "recv_" not in counts and counts.get("allreduce_", 0) == 1
    assert t.get_collective_mismatches().empty
    # everything restored: no dispatch mode left, Work.wait is torch's own again
    assert cl.eval("(torch._C._len_torch_dispatch_stack(), dist.Work.wait.__name__)") == [(0, "wait")] * N
    assert cl.eval("type(dist.Work.__dict__['wait']).__name__") == ["instancemethod"] * N  # pybind's, not ours


A2A_REFUSED = """
_inp = torch.ones(4)
_out = torch.empty(4)
try:
    dist.all_to_all_single(_out, _inp, output_split_sizes=[1, 1, 1, 1], input_split_sizes=[3, 3, 3, 3])
except RuntimeError as e:
    a2a_error = str(e)
_b = torch.ones(3)
dist.all_reduce(_b)
"""


def test_collective_that_raised_at_once_is_failed_not_in_flight(cl):
    """gloo refuses split sizes that do not add up before anything is sent: that collective failed (its state
    and its error), it is not in flight like a hang; the cell caught it and went on, so nothing is a failure."""
    t = cl.trace(A2A_REFUSED, timeout=60, display=False)
    _check_clean(t)
    messages = cl.eval("a2a_error")
    c = _colls(t)
    for r in range(N):
        a2a, ar = c[c["rank"] == r].itertuples(index=False)
        assert (a2a.kind, a2a.state, a2a.in_flight) == ("all_to_all_single", "failed", False)
        assert a2a.error == f"RuntimeError: {messages[r]}" and "Split sizes" in a2a.error
        assert pd.isna(a2a.duration_ms)
        assert (ar.kind, ar.state, ar.in_flight, ar.error) == ("all_reduce", "completed", False, None)
    assert (t.get_comm_by_rank()["n_in_flight"] == 0).all()
    assert not [f for f in t.findings if f.severity == "fail"], t.findings


def test_clock_offset_recovered(cl):
    shift = 5_000_000_000  # rank 2's clock 5 s ahead
    cl.run(f"from sharddbg.engine import clock as _clk\nif crank == 2: _clk.set_offset_ns({shift})", timeout=30)
    try:
        t = cl.trace("_b = torch.ones(3); dist.all_reduce(_b); dist.all_reduce(_b)", timeout=60, display=False)
    finally:
        cl.run("_clk.set_offset_ns(0)", timeout=30)
    off = t.clock_offsets_ns
    # every rank reads this process's own clock (one host): each offset is known exactly, not measured
    assert off == {0: 0, 1: 0, 2: shift, 3: 0}
    assert t.meta["clock_uncertainty_ns"] == {str(r): 0 for r in range(N)}
    raw = {r: [e["t_done_ns"] for e in t.events(r) if e["kind"] == "collective"] for r in range(N)}
    assert abs(raw[2][0] - raw[0][0] - shift) < 1_000_000_000  # the raw stamps really are ~5 s apart
    c = _colls(t)
    for gs, d in c.groupby("group_seq"):
        # aligned: a synchronous all_reduce completes on every rank at about the same time
        assert d["t_done_ns"].max() - d["t_done_ns"].min() < 200_000_000


def test_a_clock_known_to_be_shared_agrees_with_round_trips_and_one_that_only_says_so_is_measured(cl):
    """The offsets taken as known for ranks that read the client's own clock agree with the same offsets measured by
    round trips, within the measurement's uncertainty. A rank whose clock says it is the client's but is shifted
    some other way (its clock function replaced, the injected offset still 0) is caught by its reading falling
    outside the round trip, and measured."""
    from sharddbg.engine import clock

    engine_domains = cl.eval("sharddbg.engine.clock.domain()")
    assert engine_domains == [clock.domain()] * N and clock.domain().count(" time:") == 1
    known, measured = cl.clock_offsets(), cl.clock_offsets(measure_all=True)
    for r in range(N):
        assert known[r] == {"offset_ns": 0, "uncertainty_ns": 0}
        assert 0 < measured[r]["uncertainty_ns"] < 50_000_000
        assert abs(measured[r]["offset_ns"] - known[r]["offset_ns"]) <= measured[r]["uncertainty_ns"]
    shift = 3_000_000_000
    cl.run(f"import time as _time\nfrom sharddbg.engine import clock as _clk\n"
           f"if crank == 1: _clk.now_ns = lambda: _time.monotonic_ns() + {shift}", timeout=30)
    try:
        assert cl.eval("_clk.reading()['injected_offset_ns']") == [0] * N
        offsets = cl.clock_offsets()
    finally:
        cl.run("_clk.set_offset_ns(0)", timeout=30)
    assert [offsets[r] for r in (0, 2, 3)] == [{"offset_ns": 0, "uncertainty_ns": 0}] * 3
    assert 0 < offsets[1]["uncertainty_ns"] < 50_000_000
    assert abs(offsets[1]["offset_ns"] - shift) <= offsets[1]["uncertainty_ns"]
    assert cl.clock_offsets() == {r: {"offset_ns": 0, "uncertainty_ns": 0} for r in range(N)}
    with pytest.raises(ClusterError, match="measure_all must be True or False, got str 'yes'"):
        cl.clock_offsets(measure_all="yes")


def test_group_seq_lines_up_on_a_real_trace(cl):
    t = cl.trace("cy2 = cnet(cx)\ncy2.backward(cgy)\n_f2 = cx.full_tensor()", timeout=60, display=False)
    cl.run("cnet.zero_grad(); cx.grad = None", timeout=30)
    c = _colls(t)
    assert len(c) == N * 5
    for (g, gs), d in c.groupby(["group_name", "group_seq"]):
        assert sorted(d["rank"]) == list(range(N)) and d["kind"].nunique() == 1
    assert t.get_collective_mismatches().empty


def test_stopped_from_another_thread_then_cleaned_up(cl):
    """Recovery after a hang stops the recorder from another thread. Collective recording holds no
    per-thread state (no dispatch mode stays on a thread's stack: kernels at a dispatch key and function
    wrappers, all global), so stopping from another thread removes everything at once."""
    cl.run("""
import threading
from sharddbg.engine import recorder as _R
from torch.utils._python_dispatch import _get_current_dispatch_mode as _cur
_R.start()
_th = threading.Thread(target=_R.stop); _th.start(); _th.join()
_left = (torch._C._len_torch_dispatch_stack(), type(_cur()).__name__, _R.peek()["meta"]["internal_errors"],
         type(torch.ops._c10d_functional.all_reduce).__name__,
         "sharddbg" in dist.all_reduce.__code__.co_filename + dist.distributed_c10d.all_reduce.__code__.co_filename)
_y = cconv(cx)  # still runs
_ok = bool(torch.equal(_y.full_tensor(), torch.nn.functional.conv2d(cX, cnet.conv.weight, cnet.conv.bias, padding=1)))
_R.start(); _p = _R.stop()
_after = (torch._C._len_torch_dispatch_stack(), _p["meta"]["internal_errors"])
""", timeout=60)
    for left, ok, after in zip(cl.eval("_left"), cl.eval("_ok"), cl.eval("_after")):
        assert tuple(left) == (0, "NoneType", [], "OpOverloadPacket", False)
        assert ok
        assert after == (0, [])


# ---- synthetic traces (no cluster) ----------------------------------------------------------------

def _coll(seq, gseq, coll, sent, recv, splits_s=None, splits_r=None, **kw):
    ev = {
        "kind": "collective", "seq": seq, "group_seq": gseq, "coll": coll, "aten_op": f"_c10d_functional.{coll}",
        "api": "functional", "group_name": "1", "group_ranks": [0, 1], "group_size": 2, "mesh_dim": "domain",
        "peer": None, "root": None, "bytes_sent": sent, "bytes_recv": recv, "splits_sent": splits_s,
        "splits_recv": splits_r, "dtype": "float32", "shape": [4], "async": True, "t_issue_ns": 1000 + seq,
        "t_return_ns": 1100 + seq, "t_done_ns": 3000 + seq, "wait_op_seq": None, "waited": True, "op": "torch.conv2d",
        "op_seq": 0, "outer_op": "torch.conv2d", "outer_op_seq": 0, "phase": "forward", "autograd_node": None,
        "param": None, "device_ms": None, "error": None, "in_flight": False, "thread": 0, "params": None,
        "bucket": None, "user_frame": None, "user_cell": None, "user_code": None,
    }
    ev.update(kw)
    return ev


def _payload(rank, events):
    return {"format": schema.PAYLOAD_FORMAT, "schema_version": schema.SCHEMA_VERSION, "rank": rank, "world_size": 2,
            "complete": True, "events": events, "dropped": 0, "clock": {}, "meta": {}}


def test_mismatched_pair_flagged_in_synthetic_trace():
    r0 = [_coll(1, 0, "all_reduce", 16, 16), _coll(2, 1, "all_to_all_single", 16, 16, [8, 8], [8, 8]),
          _coll(3, 2, "all_reduce", 8, 8), _coll(4, 3, "all_gather_into_tensor", 8, 16)]
    r1 = [_coll(1, 0, "all_reduce", 16, 16), _coll(2, 1, "all_to_all_single", 16, 12, [4, 12], [8, 4]),
          _coll(3, 2, "all_gather_into_tensor", 8, 16), _coll(4, 3, "all_gather_into_tensor", 12, 24)]
    t = Trace.from_payloads([_payload(0, r0), _payload(1, r1)])
    m = t.get_collective_mismatches()
    got = {(int(a), b) for a, b in zip(m["group_seq"], m["problem"])}
    # #0 agrees; #1: rank 1 sends 4 B to rank 0, which expects 8 B (0->1 agrees: 8 B); #2 different
    # kinds; #3 different sizes
    assert got == {(1, "splits"), (2, "kind"), (3, "size")}
    detail = m[m["group_seq"] == 1]["detail"].iloc[0]
    assert "1->0: sends 4 B, 0 expects 8 B" in detail and "0->1" not in detail
    # a rank that never issued the 5th collective of the group
    t2 = Trace.from_payloads([_payload(0, r0[:1] + [_coll(5, 1, "all_reduce", 16, 16)]), _payload(1, r0[:1])])
    m2 = t2.get_collective_mismatches()
    assert list(m2["problem"]) == ["missing"] and m2["group_seq"].iloc[0] == 1
    # and the schema validates these records (a wrong type is refused)
    with pytest.raises(schema.SchemaError, match="bytes_sent"):
        schema.validate_event(_coll(9, 9, "all_reduce", 1.5, 2))
