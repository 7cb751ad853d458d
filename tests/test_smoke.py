"""The smoke matrix (``Cluster.smoke``) on a real 4-rank CPU cluster: the reduced matrix CI runs (single
device, domain=4, ddp=2 x domain=2 with DDP and with FSDP2, domain=4 compiled, a batch of 2 per domain group
against the single device taking the same 2 samples at once), a port that runs but is wrong (the conv2d patch
removed) caught by its loss and gradients, the invalid mesh refused, the mesh rebuilt on the same engines and
restored, and bad arguments refused before anything runs."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from sharddbg.cluster.smoke import (
    TABLE_COLUMNS,
    SmokeConfig,
    SmokeError,
    SmokeResult,
    full_matrix,
    reduced_matrix,
)

N = 4
ROWS = 16  # rows of the sharded axis: 4 per rank


def setup():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))


def step(model, ctx):
    import torch

    x = ctx.shard(torch.randn(1, 3, ROWS, 8), 2)
    return model(x).pow(2).mean()


def step_reducing_twice(model, ctx):
    """A port that runs and is wrong: the first conv's weight gradient all_reduced over the domain group once
    more, on top of the reduction ShardTensor already made (4x too large)."""
    import torch

    if ctx.domain_size > 1 and not hasattr(model, "extra_reduce_hook"):
        group = ctx.mesh["domain"].get_group()
        model.extra_reduce_hook = model[0].weight.register_post_accumulate_grad_hook(
            lambda p: torch.distributed.all_reduce(p.grad, group=group))
    x = ctx.shard(torch.randn(1, 3, ROWS, 8), 2)
    return model(x).pow(2).mean()


def step_without_conv_patch(model, ctx):
    """conv2d through the DTensor fallback: no halo at shard boundaries (forward only: its backward fails)."""
    import torch

    from sharddbg.engine import without_patches

    x = ctx.shard(torch.randn(1, 3, ROWS, 8), 2)
    with without_patches(torch.nn.functional.conv2d):
        return model(x).pow(2).mean()


def setup_tokens():
    from torch import nn

    return nn.Linear(8, 8)


def step_merging_batch_and_tokens(model, ctx):
    """Tokens sharded along N through a linear over rows: ``x.reshape(B * N, C)`` merges the batch with the
    sharded dim, right for a batch of 1 and mixing the samples of a larger one."""
    import torch

    x = ctx.shard(torch.randn(1, 16, 8), 1)
    weight = ctx.shard(torch.linspace(0.0, 1.0, 16 * 8).reshape(1, 16, 8), 1)
    b, n, c = x.shape
    y = model(x.reshape(b * n, c)).reshape(b, n, c)
    return (y * weight).pow(2).mean()


@pytest.fixture(scope="module")
def cl(cluster4):
    """The session's 4 x 1 cluster: the smoke run rebuilds its mesh per configuration and restores it at the end
    (this module runs after every other that uses it: tensors built on it before are stale then)."""
    return cluster4


# ---------------------------------------------------------------- the matrix (no cluster)
def test_full_matrix_holds_every_configuration_of_the_checklist():
    rows = full_matrix(N)
    names = [c.name for c in rows]
    assert names == [
        "single-device", "single-device, compiled", "ddp=4, DDP", "ddp=4, DDP, compiled", "domain=4",
        "domain=4, compiled", "ddp=2 x domain=2, DDP", "ddp=2 x domain=2, DDP, compiled",
        "ddp=2 x domain=2, FSDP2", "ddp=2 x domain=2, FSDP2, compiled", "domain=4, FSDP2 ddp=1",
        "domain=4, FSDP2 ddp=1, compiled", "domain=4, inference", "invalid mesh domain=3",
        "domain=4, 2 samples per domain group"]
    by = {c.name: c for c in rows}
    assert (by["ddp=2 x domain=2, FSDP2"].ddp, by["ddp=2 x domain=2, FSDP2"].domain) == (2, 2)
    assert by["ddp=2 x domain=2, FSDP2"].wrapper == "fsdp2" and by["ddp=4, DDP"].wrapper == "ddp"
    assert by["domain=4, inference"].training is False
    assert by["invalid mesh domain=3"].expect_error == "MeshError"
    batch2 = by["domain=4, 2 samples per domain group"]
    assert batch2.expect_error is None and batch2.samples_per_domain == 2 and (batch2.ddp, batch2.domain) == (1, N)
    assert sum(c.compiled for c in rows) == 6
    # a prime number of ranks has no ddp x domain split: those rows are left out, the rest stays
    assert [c.name for c in full_matrix(3) if "x domain" in c.name] == []
    assert [c.name for c in reduced_matrix(N)] == [
        "single-device", "domain=4", "ddp=2 x domain=2, DDP", "ddp=2 x domain=2, FSDP2", "domain=4, compiled",
        "domain=4, 2 samples per domain group"]


def test_a_configuration_that_cannot_run_is_named_with_its_problem():
    with pytest.raises(SmokeError, match=r"smoke configuration 'x': mesh ddp=2 x domain=1 has 2 ranks but the "
                                         r"cluster has 4 \(expect_error='MeshError' makes it an expected failure\)"):
        SmokeConfig("x", ddp=2, domain=1).check(N)
    with pytest.raises(SmokeError, match=r"wrapper must be one of \('none', 'ddp', 'fsdp2'\), got 'fsdp1'"):
        SmokeConfig("x", domain=4, wrapper="fsdp1").check(N)
    with pytest.raises(SmokeError, match=r"ddp must be a whole number of at least 1, got 0"):
        SmokeConfig("x", ddp=0, domain=4).check(N)
    with pytest.raises(SmokeError, match=r"a single-device configuration has no wrapper"):
        SmokeConfig("x", single_device=True, wrapper="ddp").check(N)
    SmokeConfig("fine", ddp=1, domain=3, expect_error="MeshError").check(N)  # an expected failure may not fit


# ---------------------------------------------------------------- on the cluster
def test_bad_arguments_are_refused_before_anything_runs(cl):
    with pytest.raises(SmokeError, match=r"step must be callable as step\(model, ctx\); its signature is step\(model\)"):
        cl.smoke(setup, lambda model: model)
    with pytest.raises(SmokeError, match=r"setup must be a function, got str 'net'"):
        cl.smoke("net", step)
    with pytest.raises(SmokeError, match=r"steps must be a whole number from 2 to 100, got int 1"):
        cl.smoke(setup, step, "reduced", steps=1)
    with pytest.raises(SmokeError, match=r"configs: 'domain=8' is neither a SmokeConfig nor the name of one of"):
        cl.smoke(setup, step, ["domain=8"])
    with pytest.raises(SmokeError, match=r"each name must be used once; \['domain=4'\] appear more than once"):
        cl.smoke(setup, step, ["domain=4", "domain=4"])
    assert cl.mesh.shape == (1, N)


def test_reduced_matrix_matches_the_single_device_run(cl):
    result = cl.smoke(setup, step, "reduced", steps=3)
    assert isinstance(result, SmokeResult)
    table = result.table
    assert list(table.columns) == TABLE_COLUMNS
    assert list(table.index) == [c.name for c in reduced_matrix(N)]
    assert result.ok, result.show().text()
    assert repr(result) == "smoke matrix on 4 ranks: all 6 configurations as expected (6 match the single-device " \
                           "run within rtol 0.001)"
    for name in ["domain=4", "ddp=2 x domain=2, DDP", "ddp=2 x domain=2, FSDP2", "domain=4, compiled",
                 "domain=4, 2 samples per domain group"]:
        row = table.loc[name]
        assert row["outcome"] == "matches the single-device run"
        # fp32, the same data and weights: only the reduction order differs
        assert row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, (name, row["loss_error"], row["grad_error"])
        assert len(row["losses"]) == 3 and row["losses"] != row["reference_losses"][::-1]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(row["losses"], row["reference_losses"]))
        assert row["step_ms"] > 0 and row["first_step_ms"] > 0
    # training moves the loss: three different steps
    assert len(set(table.loc["single-device", "losses"])) == 3
    # ddp=2 takes two samples per step; its reference is the single device taking both
    assert table.loc["ddp=2 x domain=2, DDP", "reference_losses"] != table.loc["domain=4", "reference_losses"]
    # a batch of 2 per domain group: its reference is the single device taking the same 2 samples at once (the
    # drawn one and another made from it), not the one sample domain=4 is compared with
    assert table.loc["domain=4, 2 samples per domain group", "reference_losses"] != \
        table.loc["domain=4", "reference_losses"]
    # the recorded step: the halo exchange of each conv and the domain all_reduce of the weight gradients
    for name in ["domain=4", "ddp=2 x domain=2, DDP", "ddp=2 x domain=2, FSDP2",
                 "domain=4, 2 samples per domain group"]:
        assert table.loc[name, "collectives_per_step"] > 4, name
        trace = result.trace(name)
        assert trace.ranks == list(range(N))
        assert "all_reduce" in set(trace.get_collectives()["kind"]), name
    # DDP adds its all_reduce over the ddp group, FSDP2 its all_gather and reduce_scatter
    fsdp_ops = set(result.trace("ddp=2 x domain=2, FSDP2").get_collectives()["kind"])
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} & fsdp_ops, fsdp_ops
    compiled = table.loc["domain=4, compiled"]
    assert compiled["compiled"] and math.isnan(compiled["collectives_per_step"])  # below the recorder
    with pytest.raises(SmokeError, match=r"configuration 'domain=4, compiled' is compiled: its steps run below the "
                                         r"recorder and none was recorded"):
        result.trace("domain=4, compiled")
    with pytest.raises(SmokeError, match=r"there is no configuration 'domain=2' in this result"):
        result.trace("domain=2")
    # the batch of 2 was sharded, not refused: each rank held both samples' rows
    batch2_ops = result.trace("domain=4, 2 samples per domain group").get_ops()
    assert any(tuple(shape) == (2, 3, ROWS // N, 8) for shapes in batch2_ops["in_local_shapes"] for shape in shapes)
    # the view: text and static HTML, the verdict first; the loss error per step as a figure
    view = result.show()
    text = view.text()
    assert text.splitlines()[0] == repr(result)
    assert "failed as expected" not in text
    html = view.html()
    assert html.count('class="sd-smoke-ok"') == 6 and 'class="sd-smoke-expected"' not in html
    assert "<script" not in html
    fig = result.plot_losses()
    assert [t.name for t in fig.data] == ["single-device", "domain=4", "ddp=2 x domain=2, DDP",
                                          "ddp=2 x domain=2, FSDP2", "domain=4, compiled",
                                          "domain=4, 2 samples per domain group"]
    # the mesh was rebuilt on the same engines and is back as it was: a collective on it works
    assert cl.mesh.shape == (1, N)
    cl.run("import torch, sharddbg\n_s = sharddbg.engine.scatter(torch.arange(8.).reshape(1, 8), 1)\n"
           "_total = float(_s.full_tensor().sum())")
    assert cl.eval("_total") == [28.0] * N


def test_a_port_that_runs_but_is_wrong_is_caught(cl):
    configs = ["single-device", "domain=4", "invalid mesh domain=3",
               SmokeConfig("domain=4, said to fail", ddp=1, domain=N, expect_error="ScatterError")]
    result = cl.smoke(setup, step_reducing_twice, configs, steps=3)
    assert not result.ok
    assert result.failed == ["domain=4", "domain=4, said to fail"]
    table = result.table
    wrong = table.loc["domain=4"]
    # the gradient is N times the single device's: its error is N - 1 times its largest value
    assert wrong["grad_error"] == pytest.approx(N - 1, rel=1e-3) and wrong["grad_error_param"].startswith("0.weight")
    # the first step's loss is right (the weights are the same), the later ones drift: the run departs at step 1
    # (the first step beyond rtol, named first: where to look), and is worst at step 2
    errors = [abs(a - b) / abs(b) for a, b in zip(wrong["losses"], wrong["reference_losses"])]
    assert errors[0] <= 1e-3 < errors[1] < errors[2], errors
    assert (wrong["loss_off_step"], wrong["loss_error_step"]) == (1, 2)
    assert wrong["loss_off_error"] == pytest.approx(errors[1]) and wrong["loss_error"] == pytest.approx(errors[2])
    assert wrong["outcome"] == (f"loss off from step 1 (by {errors[1]:.1e}, relative; worst {errors[2]:.1e} at step "
                                f"2); gradient of {wrong['grad_error_param']} off by {wrong['grad_error']:.1e} "
                                f"(relative to its largest value), beyond rtol 0.001")
    assert table.loc["single-device", "loss_off_step"] is pd.NA
    # the view names the step where the run departs in its own column
    assert "loss off from step" in result.show().text().splitlines()[1]
    assert table.loc["domain=4, said to fail", "outcome"] == "should have failed with ScatterError, but ran to the end"
    mesh = table.loc["invalid mesh domain=3"]
    assert mesh["ok"] and mesh["outcome"].startswith("failed as expected: MeshError: ")
    assert math.isnan(mesh["step_ms"]) and mesh["losses"] is None
    assert result.verdict.startswith("smoke matrix on 4 ranks: 2 of 4 configurations wrong: domain=4: loss off from "
                                     "step 1 ")
    assert "✖" in result.show().text()
    assert result.show().html().count('class="sd-smoke-expected"') == 1  # the invalid mesh
    assert cl.mesh.shape == (1, N)


def test_the_batch_of_2_catches_a_reshape_that_merges_the_batch_with_the_sharded_dim(cl):
    result = cl.smoke(setup_tokens, step_merging_batch_and_tokens, ["domain=4", "domain=4, 2 samples per domain group"],
                      steps=2)
    assert result.table.loc["domain=4", "ok"]  # one sample per domain group: the reshape is right
    assert result.failed == ["domain=4, 2 samples per domain group"]
    assert result.table.loc["domain=4, 2 samples per domain group", "outcome"].startswith("ranks [0, 1, 2, 3] raised ")
    assert cl.mesh.shape == (1, N)


def test_inference_without_the_halo_is_caught_with_its_fallback(cl):
    result = cl.smoke(setup, step_without_conv_patch, ["domain=4, inference"], steps=2)
    row = result.table.loc["domain=4, inference"]
    assert not result.ok and not row["training"] and math.isnan(row["grad_error"])
    assert row["loss_error"] > 1e-3 and row["outcome"].startswith("loss off from step ")
    # the single-device forward is the reference; the recorded step shows every conv taking the fallback
    assert row["reference_losses"] is not None and len(row["losses"]) == 2
    assert row["fallbacks"] >= 2 and "conv" in row["fallback_ops"]


def test_remesh_rebuilds_the_mesh_on_the_same_engines(cl):
    from sharddbg.errors import MeshError

    pids = cl.eval("__import__('os').getpid()")
    with pytest.raises(MeshError, match=r"mesh ddp=3 x domain=1 has 3 ranks but the cluster has n=4"):
        cl.remesh({"ddp": 3, "domain": 1})
    assert cl.mesh.shape == (1, N)  # refused before anything changed
    cl.remesh("ddp=2,domain=2")
    try:
        assert cl.mesh.shape == (2, 2) and str(cl.mesh) == "ddp=2,domain=2"
        assert cl.eval("tuple(mesh.shape)") == [(2, 2)] * N  # the %px namespace's mesh is the new one
        cl.run("_s = sharddbg.engine.scatter(torch.arange(8.).reshape(1, 8) * (1 + rank // 2), 1)\n"
               "_local = _s._local_tensor.tolist()")
        # two domain groups of two ranks, each sharding its first rank's tensor in halves
        assert cl.eval("_local") == [[[0.0, 1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0, 7.0]],
                                     [[0.0, 2.0, 4.0, 6.0]], [[8.0, 10.0, 12.0, 14.0]]]
    finally:
        cl.remesh({"ddp": 1, "domain": N})
    assert cl.eval("__import__('os').getpid()") == pids  # the same processes
    assert cl.eval("tuple(mesh.shape)") == [(1, N)] * N
