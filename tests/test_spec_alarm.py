"""The spec-vs-reality alarm: a ShardTensor result whose spec disagrees with its local tensor is flagged at the
op that made it, on the rank where it holds (real 4-rank CPU cluster, physicsnemo's ShardTensor).

The real case: a custom op (``torch.library.custom_op`` with a handler registered on ShardTensor) that builds
its result with the sharding shapes of its input, the points (``(rows, 3)`` per rank), for an output of
``(rows, K, 3)``. Nothing in physicsnemo checks it; the trace must name that op. Every expected shape is
computed here from the split (1250 points over 4 ranks: 313, 313, 312, 312), not read back from the recorder.
The rule itself (``spec_check.spec_mismatches``) and the schema records are unit-tested without a cluster.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from sharddbg import schema
from sharddbg.engine.recorder.spec_check import spec_mismatches
from sharddbg.magics import trace_summary
from sharddbg.trace import Trace, load_trace
from sharddbg.views import explorer

N = 4
POINTS = 1250  # over 4 ranks: 313, 313, 312, 312
ROWS = [POINTS // N + (1 if r < POINTS % N else 0) for r in range(N)]
K = 17
OP = "sharddbg_spec_test.neighbor_features.default"

SETUP = f"""
@torch.library.custom_op("sharddbg_spec_test::neighbor_features", mutates_args=())
def neighbor_features(points: torch.Tensor, k: int) -> torch.Tensor:
    return points.unsqueeze(1).expand(-1, k, -1).contiguous()

@neighbor_features.register_fake
def _(points, k):
    return points.new_empty(points.shape[0], k, points.shape[1])

def _handler_passing_the_points_shapes(func, types, args, kwargs):
    points, k = args
    local = neighbor_features(points._local_tensor, k)
    # the bug: the points' sharding shapes, (rows, 3) per rank, for an output of (rows, k, 3)
    return ShardTensor.from_local(local, points._spec.mesh, points._spec.placements,
                                  sharding_shapes=points._spec._sharding_shapes)

ShardTensor.register_named_function_handler("{OP}", _handler_passing_the_points_shapes)
torch.manual_seed(0)
pts = sharddbg.engine.scatter(torch.randn({POINTS}, 3), dim=0, batch_dim=None)
"""
CELL = f"feats = neighbor_features(pts, {K})\nfeats_sum = feats.sum()"


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=60)
    yield cluster4
    cluster4.run(f"ShardTensor._named_function_registry.pop({OP!r}, None)", timeout=30)


def _shape(*dims) -> str:
    return "(" + ", ".join(map(str, dims)) + ")"


def test_a_custom_op_passing_its_inputs_sharding_shapes_is_caught_at_the_op(cl):
    t = cl.trace(CELL)
    assert t.checks["spec_check"]
    found = t.get_spec_mismatches()
    assert sorted(found["rank"]) == list(range(N))
    assert set(found["op"]) == {OP} and set(found["check"]) == {"sharding_shapes"}
    for row in found.itertuples():
        rows = ROWS[row.rank]
        assert row.spec_shape == (rows, 3) and row.local_shape == (rows, K, 3)
        assert row.global_shape == (POINTS, K, 3) and row.mesh_dim == 0 and row.output == 0
        assert row.detail == (f"spec says {_shape(rows, 3)}, the local tensor is {_shape(rows, K, 3)} "
                              f"(sharding shapes of mesh dim 0, position {row.rank})")
        assert row.location.endswith(f"line 1: `feats = neighbor_features(pts, {K})`")
        assert row.placements == "(S(0),)"
    assert found["first"].sum() == 1 and found.loc[found["first"], "t_start_ns"].iloc[0] == found["t_start_ns"].min()
    # the op table carries the mark on that op only (the explorer's column); the sum's result is fine
    ops = t.get_ops()
    marked = ops[ops["spec_mismatch"].notna()]
    assert set(marked["op"]) == {OP} and sorted(marked["rank"]) == list(range(N))
    assert marked["spec_mismatch"].map(lambda s: s.startswith("output 0: spec says (")).all()
    assert ops.loc[ops["spec_mismatch"].isna(), "spec_mismatches"].isna().all()
    # the explorer marks it: the summary row counts the calls, each call (and its group) carries the text,
    # the static renderings show the chip and the count
    summary = explorer.summary_frame(t).set_index("op")
    assert summary.loc[OP, "spec_mismatches"] == N and summary["spec_mismatches"].sum() == N
    calls = explorer.explorer_frame(t)
    assert set(calls.loc[calls["spec_mismatch"].notna(), "op"]) == {OP}
    groups = explorer.call_groups(t)
    assert groups["spec_mismatch"].notna().sum() == N  # 313/313/312/312 rows: each rank's text names its own
    html = explorer.explorer_html(t)
    assert html.count('class="sd-chip-spec"') == 1 + N  # the summary row, and each rank's call in the list
    assert f"{N} results whose spec disagrees with their data" in html
    assert f"{N} spec mismatch(es)" in explorer.explorer_text(t)
    line = trace_summary(t)
    assert (f"4 result(s) whose spec disagrees with the local tensor on ranks 0-3, first at {OP} on rank "
            f"{int(found.loc[found['first'], 'rank'].iloc[0])}: spec says (") in line
    (finding,) = [f for f in t.findings if f.kind == "spec_mismatch"]
    assert finding.severity == "fail" and finding.op == OP and "get_spec_mismatches()" in finding.fix


def test_the_inspector_sees_it_too_but_only_later(cl):
    """The shard inspector, run after the cell, also finds the disagreement: the trace found it at the op."""
    cl.run(CELL, timeout=60)
    warnings = cl.inspect("feats").shard_layout.warnings
    for r in range(N):
        assert any(w.startswith(f"rank {r} holds a local tensor of shape {_shape(ROWS[r], K, 3)}, but")
                   and f"says {_shape(ROWS[r], 3)}: the spec disagrees with the local tensor" in w
                   for w in warnings), warnings


def test_uneven_conv_net_forward_and_backward_raises_no_alarm(cl):
    """Halo convolutions on 17/17/16/16 rows, a fallback relu, the loss, backward: every ShardTensor result's
    spec agrees with its local tensor."""
    cl.run("torch.manual_seed(0)\n"
           "x_spec = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2, requires_grad=True)\n"
           "net_spec = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))",
           timeout=60)
    t = cl.trace("y = net_spec(x_spec)\ny.square().mean().backward()")
    assert t.get_spec_mismatches().empty and t.checks["spec_check"]
    ops = t.get_ops()
    sharded = ops[ops["placements"].fillna("").str.contains("S") & ops["out_local_shape"].notna()]
    assert len(sharded) >= 4 * N  # the check had results to look at: conv, relu, conv, square on every rank
    assert "spec mismatch" not in trace_summary(t)


def test_spec_check_off_checks_nothing(cl):
    t = cl.trace(CELL, spec_check=False)
    assert not t.checks["spec_check"] and t.get_spec_mismatches().empty
    assert t.get_ops()["spec_mismatch"].isna().all()


def test_a_saved_trace_keeps_the_findings_and_older_files_say_not_checked(cl, tmp_path):
    t = cl.trace(CELL)
    back = load_trace(t.save(tmp_path / "spec.sdtrace.json"))
    cols = ["rank", "op", "check", "spec_shape", "local_shape", "detail"]
    assert back.get_spec_mismatches()[cols].equals(t.get_spec_mismatches()[cols])
    from pathlib import Path

    old = load_trace(Path(__file__).parent / "data" / "conv4.sdtrace.json")  # schema 4: nothing was checked
    assert old.checks == {"spec_check": False, "replicas": False, "preflight": False}
    assert old.get_spec_mismatches().empty and old.get_ops()["spec_mismatch"].isna().all()


# ---- the rule, without a cluster --------------------------------------------------------------------------

UNEVEN = {0: [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 16, 64), (1, 3, 16, 64)]}


def test_the_rule_accepts_what_agrees():
    assert spec_mismatches((1, 3, 16, 64), (1, 3, 66, 64), (Shard(2),), UNEVEN, (2,), (4,)) == []
    assert spec_mismatches((1, 3, 16, 64), (1, 3, 16, 64), (Replicate(),), None, (1,), (4,)) == []
    assert spec_mismatches((4, 4), (4, 4), (Partial(),), None, (3,), (4,)) == []
    # negative shard dim, no sharding shapes known: the local size only has to fit in the global one
    assert spec_mismatches((1, 3, 16, 64), (1, 3, 66, 64), (Shard(-2),), None, (0,), (4,)) == []
    # a 2-d mesh: the table is the cross-section through this rank's coordinates
    assert spec_mismatches((2, 17, 8), (4, 66, 8), (Shard(0), Shard(1)),
                           {0: [(2, 17, 8), (2, 17, 8)], 1: [(2, 17, 8), (2, 17, 8), (2, 16, 8), (2, 16, 8)]},
                           (1, 0), (2, 4)) == []
    # symbolic sizes (torch.compile) are not compared
    assert spec_mismatches((3, 2), (12, 2), (Shard(0),), {0: [("s0", 2)] * 4}, (0,), (4,)) == []


def test_the_rule_names_each_disagreement():
    chunked = {0: [(1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 17, 64), (1, 3, 15, 64)]}  # torch.chunk's 66 / 4
    (m,) = spec_mismatches((1, 3, 16, 64), (1, 3, 66, 64), (Shard(2),), chunked, (2,), (4,))
    assert (m.check, m.mesh_dim, m.spec_shape) == ("sharding_shapes", 0, (1, 3, 17, 64))
    assert m.detail == "spec says (1, 3, 17, 64), the local tensor is (1, 3, 16, 64) (sharding shapes of mesh dim 0, position 2)"
    (m,) = spec_mismatches((1, 3, 16, 64), (1, 3, 66, 64), (Replicate(),), None, (2,), (4,))
    assert m.check == "global_shape" and "dim 2 is whole (66)" in m.detail
    (m,) = spec_mismatches((313, 17, 3), (1252, 3), (Shard(0),), None, (0,), (4,))
    assert m.check == "ndim" and m.detail.startswith("the spec's global shape (1252, 3) has 2 dims")
    found = spec_mismatches((1, 3, 17, 64), (1, 3, 70, 64), (Shard(2),), {0: UNEVEN[0][:3]}, (0,), (4,))
    assert [f.check for f in found] == ["mesh_size", "global_shape"]
    assert found[0].detail == "the sharding shapes of mesh dim 0 list 3 ranks, the mesh dim has 4"
    assert found[1].detail == "the sharding shapes of mesh dim 0 add up to 50 along dim 2, the spec's global shape (1, 3, 70, 64) says 70"
    (m,) = spec_mismatches((1, 3, 80, 64), (1, 3, 66, 64), (Shard(2),), None, (0,), (4,))
    assert m.check == "global_shape" and "holds 80 along dim 2, more than" in m.detail


def _op(**extra):
    ev = {"kind": "op", "seq": 0, "parent_seq": None, "depth": 0, "op": "x", "path": "function_handler",
          "handler": None, "phase": "forward", "autograd_node": None, "module": None, "user_frame": None,
          "user_cell": None, "user_code": None, "in_local_shapes": [], "in_global_shapes": [], "out_local_shape": None,
          "out_global_shape": None, "placements": None, "dtype": None, "sharding_shapes": None, "in_bytes": 0,
          "out_bytes": 0, "t_start_ns": 0, "t_end_ns": 1, "host_ms": 0.0, "device_ms": None, "mem_delta_bytes": None,
          "local_ms": None, "error": None, "fwd_seq": None, "in_placements": [], "fallback": False, "promotions": [],
          "not_implemented": False, "in_flight": False, "thread": 0}
    ev.update(extra)
    return ev


MISMATCH = {"output": 0, "check": "sharding_shapes", "mesh_dim": 0, "spec_shape": [313, 3], "local_shape": [313, 17, 3],
            "global_shape": [1252, 17, 3], "placements": "(S(0),)", "detail": "spec says (313, 3), ..."}


def test_the_schema_takes_the_finding_only_well_formed():
    schema.validate_event(_op(spec_mismatches=[MISMATCH]))
    schema.validate_event(_op())  # absent: nothing to say
    with pytest.raises(schema.SchemaError, match="unknown spec check 'shape'"):
        schema.validate_event(_op(spec_mismatches=[dict(MISMATCH, check="shape")]))
    with pytest.raises(schema.SchemaError, match=r"missing field\(s\) \['detail'\]"):
        schema.validate_event(_op(spec_mismatches=[{k: v for k, v in MISMATCH.items() if k != "detail"}]))
    with pytest.raises(schema.SchemaError, match="'spec_mismatches'"):
        schema.validate_event(_op(spec_mismatches={"0": MISMATCH}))
    payload = {"format": schema.PAYLOAD_FORMAT, "schema_version": schema.SCHEMA_VERSION, "rank": 0, "world_size": 1,
               "complete": True, "events": [_op(spec_mismatches=[MISMATCH])], "dropped": 0, "clock": {},
               "meta": {"spec_check": True}}
    t = Trace.from_payloads([payload])
    assert t.checks["spec_check"] and t.get_spec_mismatches()["detail"].tolist() == [MISMATCH["detail"]]
