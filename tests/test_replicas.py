"""Replica consistency on a real 4-rank CPU cluster with a ddp=2 x domain=2 mesh (two domain groups, [0, 1]
and [2, 3]): tensors that claim Replicate digested after each op in a trace (``replicas=True``), the first op
where the ranks of a group diverge named with the ranks and the largest difference gathered from them; and the
stand-alone check of a model's parameters over a mesh dim (``Cluster.check_replicas``).

Every divergence is made on purpose on one rank, and every expected difference is computed here from the
values the ranks hold (pulled as plain lists), not read back from sharddbg.
"""

from __future__ import annotations

import math

import pytest

from sharddbg.errors import ClusterError, RankError
from sharddbg.magics import trace_summary

SETUP = """
torch.manual_seed(0)
x = sharddbg.engine.scatter(torch.randn(1, 3, 34, 16), dim=2)
net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
"""
CELL = "y = net(x)\ny.square().mean().backward()"


@pytest.fixture(scope="module")
def cl(cluster22):
    cluster22.run(SETUP, timeout=60)
    return cluster22


def _values(cl, expression: str) -> list[list[float]]:
    """Each rank's values of ``expression`` (a tensor on the ranks), flattened, as plain floats."""
    return cl.eval(f"({expression}).detach().reshape(-1).tolist()")


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_synced_weights_agree_after_every_op(cl):
    t = cl.trace(CELL, replicas=True)
    assert t.checks["replicas"]
    digests = t.get_replica_digests()
    # each conv promotes its weight and bias on every rank; each digest is taken within the rank's domain group
    for r in range(4):
        mine = digests[digests["rank"] == r]
        assert {"torch.conv2d#0/parameter 0.weight", "torch.conv2d#0/parameter 0.bias",
                "torch.conv2d#1/parameter 2.weight", "torch.conv2d#1/parameter 2.bias"} <= set(mine["key"])
        assert set(mine["group_ranks"]) == {(0, 1) if r < 2 else (2, 3)}
        assert mine["kept"].all()
    assert t.get_replica_divergence().empty
    assert "replicas agree on every rank" in trace_summary(t)


def test_a_weight_changed_on_one_rank_is_named_at_its_first_op(cl):
    cl.run("with torch.no_grad():\n    if rank == 3:\n        net[2].weight.mul_(1.5)", timeout=30)
    try:
        t = cl.trace(CELL, replicas=True)
        div = t.get_replica_divergence()
        assert len(div) == 1  # the other group, and every other tensor, agree
        row = div.iloc[0]
        assert row["first"] and row["op"] == "torch.conv2d" and row["what"] == "parameter 2.weight"
        assert row["key"] == "torch.conv2d#1/parameter 2.weight"
        assert row["group_ranks"] == (2, 3) and row["n_versions"] == 2 and row["missing_ranks"] == []
        # two ranks, one each: a tie, so the lower rank's version is the reference
        assert row["reference_ranks"] == [2] and row["ranks_differing"] == [3]
        w = _values(cl, "net[2].weight")
        expected = _max_diff(w[3], w[2])
        assert expected > 0
        assert row["max_abs_diff"] == pytest.approx(expected, rel=1e-6)
        assert row["max_abs_diff_by_rank"][2] == 0.0
        assert row["location"].endswith("line 1: `y = net(x)`")
        line = trace_summary(t)
        assert (f"replicas diverge first at torch.conv2d (parameter 2.weight, {row['location']}): rank 3 differs "
                f"from rank 2 by up to {expected:.3g}") in line
    finally:
        cl.run("with torch.no_grad():\n    if rank == 3:\n        net[2].weight.div_(1.5)", timeout=30)


def test_a_distributed_replicate_weight_changed_on_one_rank_is_named(cl):
    """A weight that is itself a DTensor claiming Replicate over the domain axis (not promoted: read as it is by
    the op) is digested where the user's call reads it."""
    cl.run("from torch.distributed.tensor import DTensor, Replicate\n"
           "torch.manual_seed(3)\n"
           "dl = nn.Linear(16, 5)\n"
           "dl.weight = nn.Parameter(DTensor.from_local(dl.weight.detach().clone(), mesh['domain'], [Replicate()]))\n"
           "with torch.no_grad():\n"
           "    if rank == 3:\n"
           "        dl.weight._local_tensor.mul_(1.5)", timeout=30)
    t = cl.trace("yl = dl(x)", replicas=True)
    digests = t.get_replica_digests()
    assert set(digests["what"]) == {"parameter weight", "parameter bias"}
    div = t.get_replica_divergence()
    assert len(div) == 1
    row = div.iloc[0]
    assert row["what"] == "parameter weight" and row["group_ranks"] == (2, 3) and row["ranks_differing"] == [3]
    w = _values(cl, "dl.weight._local_tensor")
    assert row["max_abs_diff"] == pytest.approx(_max_diff(w[3], w[2]), rel=1e-6) and row["max_abs_diff"] > 0


def test_a_replicate_result_that_differs_is_caught_at_the_op_that_made_it(cl):
    """A rank-dependent scalar added to a Replicate ShardTensor: each rank's result claims Replicate and
    differs; the first op call that diverges is that add, before any op that reads it."""
    cl.run("torch.manual_seed(1)\nr = sharddbg.engine.scatter(torch.randn(5, 6), dim=None, batch_dim=None, "
           "replicate=True)", timeout=60)
    t = cl.trace("r2 = r * 2.0\nr3 = r2 + (1.0 if rank == 1 else 0.0)\nr4 = r3.exp()", replicas=True)
    div = t.get_replica_divergence()
    first = div[div["first"]].iloc[0]
    assert first["what"] == "output 0" and first["group_ranks"] == (0, 1) and first["ranks_differing"] == [1]
    assert first["op"] == "Tensor.add" and "r3 = r2 +" in first["location"]
    assert first["max_abs_diff"] == pytest.approx(1.0, rel=1e-6)
    # the exp of the diverged values diverges too (later), and is listed after the first one
    later = div[~div["first"]]
    assert len(later) >= 1 and (later["t_start_ns"] >= first["t_start_ns"]).all()
    assert later["note"].str.startswith("values not gathered").all() and later["max_abs_diff"].isna().all()
    # the other domain group never diverged
    assert set(div["group_ranks"]) == {(0, 1)}


def test_check_replicas_finds_weights_never_broadcast(cl):
    cl.run("torch.manual_seed(100 + rank)\n"  # every rank its own weights: the missing start-up broadcast
           "unsynced = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))", timeout=30)
    res = cl.check_replicas("unsynced")
    assert not res.ok
    table = res.table
    assert set(table["group_ranks"]) == {(0, 1), (2, 3)}
    differ = table[table["state"] == "differs"]
    # the Linear's weight and bias differ in both groups; the LayerNorm's start as ones and zeros everywhere
    assert set(differ["name"]) == {"0.weight", "0.bias"} and len(differ) == 4
    assert set(table.loc[table["state"] == "same", "name"]) == {"1.weight", "1.bias"}
    w = _values(cl, "unsynced[0].weight")
    for row in differ[differ["name"] == "0.weight"].itertuples():
        first, other = row.group_ranks
        assert row.reference_rank == first and row.ranks_differing == [other]
        assert row.max_abs_diff == pytest.approx(_max_diff(w[other], w[first]), rel=1e-6)
    assert res.differing == ["0.weight", "0.bias"]  # in the model's order
    assert res.verdict.startswith("unsynced: 2 of 4 parameters and buffers differ across the ranks of a domain group")
    assert "broadcast the parameters from domain rank 0" in repr(res)
    text = str(res.show())
    assert text.splitlines()[0] == res.verdict and "✖ differs" in text and "✔ same" in text
    assert "<script" not in res.show()._repr_html_()

    # the fix the verdict names: broadcast from domain rank 0; then every group agrees
    cl.run("g = mesh['domain'].get_group()\n"
           "for p in unsynced.parameters():\n"
           "    dist.broadcast(p.data, src=dist.get_process_group_ranks(g)[0], group=g)", timeout=30)
    fixed = cl.check_replicas("unsynced")
    assert fixed.ok and (fixed.table["state"] == "same").all()
    assert fixed.verdict == "unsynced: all 4 parameters and buffers are the same on every rank of each of 2 domain groups"
    # over ddp the two groups hold different weights (broadcast within each domain group only)
    over_ddp = cl.check_replicas("unsynced", mesh_dim="ddp")
    assert set(over_ddp.table["group_ranks"]) == {(0, 2), (1, 3)} and not over_ddp.ok
    assert "differ across the ranks of a ddp group" in over_ddp.verdict


def test_check_replicas_leaves_parameters_sharded_over_the_axis_alone(cl):
    cl.run("from torch.distributed.tensor import DTensor\n"
           "torch.manual_seed(7)\n"
           "class WithTable(nn.Module):\n"
           "    def __init__(self):\n"
           "        super().__init__()\n"
           "        self.lin = nn.Linear(2, 2)\n"
           "        self.table = nn.Parameter(DTensor.from_local(torch.randn(3) + rank, mesh['domain'], [Shard(0)]))\n"
           "tabled = WithTable()", timeout=30)
    res = cl.check_replicas("tabled")
    row = res.table[res.table["name"] == "table"].iloc[0]
    assert row["state"] == "sharded" and row["placements"] == "(S(0),)"
    assert res.ok and "(1 sharded over domain, not compared)" in res.verdict


def test_check_replicas_refuses_bad_input_before_running(cl):
    with pytest.raises(ClusterError, match="mesh_dim must be one of"):
        cl.check_replicas("net", mesh_dim="rows")
    with pytest.raises(ClusterError, match="model must name an nn.Module"):
        cl.check_replicas(3)
    with pytest.raises(RankError, match="NameError"):
        cl.check_replicas("no_such_model")
    with pytest.raises(RankError, match="expected an nn.Module, got ShardTensor"):
        cl.check_replicas("x")
    assert cl.broken is None
    assert math.isfinite(cl.eval("float(net[0].weight.sum())")[0])
