"""The pitfall doctor (``Cluster.doctor``, ``%shard_doctor``) on a real 4-rank CPU cluster of its own, mesh
ddp=2 x domain=2 (domain groups [0, 1] and [2, 3], ddp groups [0, 2] and [1, 3]): a sound set-up has no
pitfall; then each of the eight mistakes is made for real (unsynced weights, a reshape that merges a batch of 2
with the sharded dim, a requires_grad flag autograd never sees, an unwaited async collective, an optimizer mixing DTensor and plain
parameters in foreach kernels, FSDP1, DDP over the whole world, a gradient reduced twice over the domain
axis) and the doctor names it, the ranks and the fix; a batch of 2 through a padded conv, which is right, is
a warning only.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from sharddbg.cluster import doctor as dr
from sharddbg.cluster.doctor import DoctorError, DoctorReport

from ranks_changed import changed_on_ranks

pytestmark = pytest.mark.cluster

SETUP = """
torch.manual_seed(0)  # the same weights on every rank
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed._functional_collectives as funcol
dk_x = sharddbg.engine.scatter(torch.randn(1, 3, 16, 8), dim=2, requires_grad=True)
dk_net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
dk_ddp = DDP(dk_net, process_group=mesh["ddp"].get_group())
dk_opt = torch.optim.AdamW(dk_net.parameters())
"""
SOUND = ["dk_x", "dk_net", "dk_ddp", "dk_opt"]


@pytest.fixture(scope="module")
def cl(cluster22):
    cluster22.run(SETUP, timeout=60)
    return cluster22


def _statuses(report: DoctorReport) -> dict[str, str]:
    return dict(zip(report.table["check"], report.table["status"]))


def test_a_sound_setup_has_no_pitfall(cl):
    report = cl.doctor(*SOUND)
    assert list(report.table.columns) == dr.TABLE_COLUMNS and list(report.table["check"]) == list(dr.CHECKS)
    not_yet = (dr.REDUCED_ONCE, dr.PLAN_CACHE)  # no numerical check, no trace yet
    assert _statuses(report) == {c: "ok" for c in dr.CHECKS if c not in not_yet} | {c: "skip" for c in not_yet}
    assert report.ok and report.verdict == "doctor: no pitfall found (7 ok, 2 skip)" and repr(report) == report.verdict
    assert "run cl.check(...)" in report.finding(dr.REDUCED_ONCE).sentence
    assert report.finding(dr.PLAN_CACHE).sentence.startswith("no trace yet: record a few training steps")
    assert report.finding(dr.WEIGHTS_SYNCED).sentence == ("every plain parameter (4 per group) is the same on every "
                                                       "rank of its domain group")


def test_weights_not_synced_over_the_domain_axis(cl):
    cl.run("torch.manual_seed(rank)\ndk_lin = nn.Linear(4, 4)", timeout=30)  # each rank its own weights
    report = cl.doctor("dk_lin")
    f = report.finding(dr.WEIGHTS_SYNCED)
    assert f.severity == "fail" and not report.ok and f.ranks == (1, 3)
    assert f.sentence == ("2 of 2 plain parameters differ across the ranks of a domain group (ranks 1, 3 from their "
                       "group's first rank): dk_lin.weight, dk_lin.bias; they train \"fine\" and wrong")
    assert "dist.broadcast(p.data" in f.fix
    assert report.verdict.startswith("doctor: FAILED (") and f"{dr.WEIGHTS_SYNCED}: {f.sentence}" in report.verdict
    # the fix as the doctor gives it: the same weights on the ranks of each domain group
    cl.run("_g = mesh['domain'].get_group()\nfor _p in dk_lin.parameters():\n"
           "    torch.distributed.broadcast(_p.data, src=torch.distributed.get_process_group_ranks(_g)[0], group=_g)",
           timeout=30)
    assert cl.doctor("dk_lin").status(dr.WEIGHTS_SYNCED) == "ok"


def test_a_batch_of_two_per_domain_group_through_a_padded_conv_is_a_warning(cl):
    """physicsnemo's own conv test: a batch of 2 sharded along H, through a padded conv: right (cl.check passes on
    it), so a warning that names the ops where a batch of 2 would matter, not a failure."""
    cl.run("torch.manual_seed(0)\n"
           "dk_xb = sharddbg.engine.scatter(torch.randn(2, 3, 16, 8), dim=2, batch_dim=None, requires_grad=True)\n"
           "dk_padded = nn.Conv2d(3, 4, 3, padding=1)\n"
           "dk_yb = dk_padded(dk_xb)", timeout=30)
    report = cl.doctor("dk_xb", "dk_yb")
    f = report.finding(dr.SAMPLES_APART)
    assert f.severity == "warn" and f.ranks == (0, 1, 2, 3) and report.ok
    assert f.sentence == ("dk_xb: global shape (2, 3, 16, 8), split along dim 2, a batch of 2 per domain group, "
                          "dk_yb: global shape (2, 4, 16, 8), split along dim 2, a batch of 2 per domain group: right "
                          "where every op keeps the samples apart (convolutions, normalizations, pointwise ops, a "
                          "linear over the last dim), at that many times the memory and work per rank; a "
                          "view/reshape that merges dim 0 with a sharded dim (batch x tokens flattened for a linear "
                          "or attention) would mix them: no trace yet: record a step (%%shard_trace) and run the "
                          "doctor again to see whether one does")
    assert "x.reshape(B, -1, C), not x.reshape(B * N, C)" in f.fix


def test_a_requires_grad_flag_that_autograd_never_sees(cl):
    # the flag set on the local tensor: .requires_grad answers True, autograd's own flag stays False
    cl.run("dk_xr = sharddbg.engine.scatter(torch.randn(1, 3, 16, 8), dim=2)\n"
           "dk_xr._local_tensor.requires_grad_(True)\n"
           "dk_net(dk_xr).square().mean().backward()", timeout=30)
    assert cl.eval("(dk_xr.requires_grad, dk_xr.grad is None)") == [(True, True)] * 4  # no gradient arrived
    f = cl.doctor("dk_xr", "dk_x").finding(dr.REQUIRES_GRAD)
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3)
    assert f.sentence.startswith("dk_xr: .requires_grad says True (its local tensor has the flag) but autograd's flag")
    assert "requires_grad=True" in f.fix
    assert cl.doctor("dk_x").status(dr.REQUIRES_GRAD) == "ok"
    # a physicsnemo whose ShardTensor has no requires_grad_ of its own (older releases): the call takes the
    # DTensor fallback, which sets the flag on a temporary
    with changed_on_ranks(cl, "dk_xn = sharddbg.engine.scatter(torch.randn(1, 3, 16, 8), dim=2)\n"
                              "_dk_own = ShardTensor.requires_grad_\ndel ShardTensor.requires_grad_",
                          "ShardTensor.requires_grad_ = _dk_own"):
        assert cl.eval("(dk_xn.requires_grad_(True), dk_xn.requires_grad)[1]") == [False] * 4  # silently nothing
        f = cl.doctor("dk_xn").finding(dr.REQUIRES_GRAD)
    assert f.severity == "warn" and f.ranks == (0, 1, 2, 3)
    assert f.sentence == ("requires_grad_(True) on a ShardTensor does nothing in this physicsnemo (it takes the DTensor "
                       "fallback and sets the flag on a temporary); ShardTensor leaves that do not require grad: dk_xn "
                       "(set on purpose?)")
    assert cl.doctor("dk_xn").status(dr.REQUIRES_GRAD) == "ok"


def test_an_async_collective_never_waited(cl):
    cl.run("dk_ar = funcol.all_reduce(torch.ones(4), 'sum', mesh['domain'].get_group())", timeout=30)
    f = cl.doctor("dk_ar").finding(dr.ASYNC_WAITED)
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3)
    assert f.sentence.startswith("dk_ar holds an AsyncCollectiveTensor never waited")
    cl.run("dk_ar = dk_ar.wait()", timeout=30)
    assert cl.doctor("dk_ar").status(dr.ASYNC_WAITED) == "ok"
    # a result dropped without waiting (a warm-up, a benchmark): no variable holds it, torch's registry still does
    cl.run("_dk_dropped = funcol.all_reduce(torch.ones(4), 'sum', mesh['domain'].get_group())\ndel _dk_dropped",
           timeout=30)
    f = cl.doctor("dk_ar").finding(dr.ASYNC_WAITED)
    assert f.severity == "warn" and f.ranks == (0, 1, 2, 3)
    assert f.sentence == ("1 functional collective(s) issued and never waited on ranks 0-3 (results dropped in a "
                       "warm-up or a benchmark?)")


def test_an_optimizer_mixing_distributed_and_plain_parameters(cl):
    cl.run("from torch.distributed.fsdp import fully_shard\n"
           "dk_f2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))\n"
           "fully_shard(dk_f2, mesh=mesh['ddp'])\n"
           "dk_extra = nn.Parameter(torch.zeros(4))\n"
           "dk_mixed = torch.optim.AdamW(list(dk_f2.parameters()) + [dk_extra], foreach=True)\n"
           "dk_mixed_default = torch.optim.AdamW(list(dk_f2.parameters()) + [dk_extra])\n"
           "dk_split = torch.optim.AdamW([{'params': list(dk_f2.parameters())}, {'params': [dk_extra]}], foreach=True)",
           timeout=60)
    f = cl.doctor("dk_mixed").finding(dr.OPTIMIZER_GROUPS)
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3)
    assert f.sentence == ("dk_mixed group 0: 4 distributed and 1 plain parameters with foreach=True: foreach kernels "
                       "cannot mix DTensor/ShardTensor and plain parameters")
    f = cl.doctor("dk_mixed_default").finding(dr.OPTIMIZER_GROUPS)
    assert f.severity == "warn" and "fine on CPU, where foreach is off by default" in f.sentence
    assert cl.doctor("dk_split").status(dr.OPTIMIZER_GROUPS) == "ok"


def test_fsdp1_anywhere_in_the_model(cl):
    cl.run("from torch.distributed.fsdp import FullyShardedDataParallel\n"
           "dk_outer = nn.Sequential(FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device('cpu')), nn.ReLU())",
           timeout=60)
    f = cl.doctor("dk_outer").finding(dr.NO_FSDP1)
    assert f.severity == "fail" and f.sentence == "FullyShardedDataParallel (FSDP1) wraps dk_outer.0" and "fully_shard" in f.fix


def test_ddp_over_the_whole_world(cl):
    cl.run("dk_world = DDP(nn.Linear(4, 4))", timeout=60)
    f = cl.doctor("dk_world").finding(dr.DDP_GROUP)
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3)
    assert f.sentence.startswith("dk_world is DDP over the whole world ([0, 1, 2, 3]), not over the ddp axis (rank 0: "
                              "[0, 2]): it averages the gradients over the domain axis too")
    assert f.fix == "DDP(model, process_group=mesh['ddp'].get_group())"


def test_a_gradient_reduced_twice_over_the_domain_axis(cl):
    with changed_on_ranks(cl, "_dk_hook = dk_net[2].weight.register_post_accumulate_grad_hook(\n"
                              "    lambda p: torch.distributed.all_reduce(p.grad, group=mesh['domain'].get_group()))",
                          "_dk_hook.remove()"):
        check = cl.check("dk_y = dk_net(dk_x)", inputs=["dk_x"], outputs=["dk_y"], model="dk_net")
    # two domain groups, each against its own reference
    assert check.groups == [0, 1] and set(check.failures()["tensor"]) == {"dk_net.2.weight.grad"}
    f = cl.doctor("dk_net").finding(dr.REDUCED_ONCE)  # the last check of the cluster
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3)
    assert f.sentence == ("dk_net.2.weight.grad is 2x the unsharded reference's (last cl.check): reduced over the "
                       "domain axis once more than it should be")
    sound = cl.check("dk_y = dk_net(dk_x)", inputs=["dk_x"], outputs=["dk_y"], model="dk_net")
    assert sound.ok and cl.doctor("dk_net").status(dr.REDUCED_ONCE) == "ok"
    assert cl.doctor("dk_net", check=check).status(dr.REDUCED_ONCE) == "fail"


def test_the_check_through_ddp_on_the_ddp_axis(cl):
    # DDP over the ddp axis averages identical gradients of the two domain groups: the reference (the module
    # DDP wraps, rank 0's weights) agrees
    r = cl.check("dk_y = dk_ddp(dk_x)", inputs=["dk_x"], outputs=["dk_y"], model="dk_ddp")
    assert r.ok, r.verdict
    assert r.models == ["dk_ddp"] and {f"dk_ddp.{i}.{p}.grad" for i in (0, 2) for p in ("weight", "bias")} <= set(r.tensors())


def test_every_variable_by_default_and_the_views(cl):
    # the mistakes made above that are still there: each found without naming it
    cl.run("torch.manual_seed(rank + 10)\ndk_lin2 = nn.Linear(4, 4)\n"
           "dk_ar2 = funcol.all_reduce(torch.ones(4), 'sum', mesh['domain'].get_group())", timeout=60)
    report = cl.doctor()
    statuses = _statuses(report)
    assert {c for c, s in statuses.items() if s == "fail"} == {dr.WEIGHTS_SYNCED, dr.REQUIRES_GRAD, dr.ASYNC_WAITED,
                                                              dr.OPTIMIZER_GROUPS, dr.NO_FSDP1, dr.DDP_GROUP}
    assert statuses[dr.SAMPLES_APART] == "warn"  # the batch of 2: no trace shows an op mixing its samples
    assert report.verdict.startswith(f"doctor: FAILED (1 ok, 1 warn, 6 fail, 1 skip); {dr.WEIGHTS_SYNCED}: ")
    assert report.verdict.endswith("; and 5 more") and not report.ok and len(report.failures()) == 6
    view = report.show()
    text = view.text()
    assert text.splitlines()[0] == report.verdict
    assert "fix: DDP(model, process_group=mesh['ddp'].get_group())" in text
    html = view.html()
    shown, _ = InteractiveShell.instance().display_formatter.format(report)  # what a notebook shows for it
    assert html.count('class="sd-doctor-fail"') == 6 and shown["text/html"] == html
    assert shown["text/plain"] == report.verdict
    cl.run("dk_ar2 = dk_ar2.wait()", timeout=30)


def test_shard_doctor_magic_and_bad_names(cl):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    report = ip.run_line_magic("shard_doctor", "dk_x dk_net")
    assert isinstance(report, DoctorReport) and report.status(dr.WEIGHTS_SYNCED) == "ok"
    magic = ip.find_magic("shard_doctor", "line")
    assert magic.__doc__.startswith("::\n\n  %shard_doctor [--timeout S] [NAME ...]"), magic.__doc__[:80]
    with pytest.raises(UsageError, match="takes names of variables"):
        ip.run_line_magic("shard_doctor", "dk_net[0]")
    with pytest.raises(DoctorError, match="no variable 'dk_nope' on ranks 0-3"):
        cl.doctor("dk_x", "dk_nope")
    with pytest.raises(DoctorError, match="takes names of variables on the ranks"):
        cl.doctor("1x")


def test_a_reshape_that_merges_the_batch_with_the_sharded_dim_mixes_samples(cl):
    """Tokens (batch 2, 16 sharded, 8) reshaped to rows (32, 8) for a linear: ShardTensor calls the result a plain
    shard of the 32 rows, but each rank holds rows of both samples; the doctor names that op from the last trace
    (this test comes last: the trace stays the cluster's last one)."""
    cl.run("torch.manual_seed(0)\n"
           "dk_tokens = sharddbg.engine.scatter(torch.randn(2, 16, 8), dim=1, batch_dim=None)\n"
           "dk_proj = nn.Linear(8, 4)", timeout=30)
    cl.trace("dk_out = dk_proj(dk_tokens)", timeout=60)  # a linear over the last dim keeps the samples apart
    f = cl.doctor("dk_tokens").finding(dr.SAMPLES_APART)
    assert f.severity == "warn" and f.sentence.endswith("would mix them: the last trace saw no op merge them")
    cl.trace("dk_rows = dk_tokens.reshape(32, 8)\ndk_out = dk_proj(dk_rows)", timeout=60)
    report = cl.doctor("dk_tokens")
    f = report.finding(dr.SAMPLES_APART)
    assert f.severity == "fail" and f.ranks == (0, 1, 2, 3) and not report.ok
    assert f.sentence.startswith("in the last trace, Tensor.reshape (cell sent by cl.run, "), f.sentence
    assert f.sentence.endswith(", line 1: `dk_rows = dk_tokens.reshape(32, 8)`) merged the batch (2 samples) with "
                               "sharded dim 1: (2, 16, 8) S(1) -> (32, 8) S(0) on ranks 0-3; each rank's shard now "
                               "holds rows of every sample, which the spec places as consecutive rows of one: the "
                               "samples are mixed (cl.check on that cell shows where)"), f.sentence
    # the numerical check agrees: the merged rows differ from the unsharded reference's
    check = cl.check("dk_rows = dk_tokens.reshape(32, 8)", inputs=["dk_tokens"], grads=False)
    assert not check.ok and check.failures()["tensor"].tolist() == ["dk_rows"] * 4
