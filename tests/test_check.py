"""The numerical check (``Cluster.check``, ``%%shard_check``) on the shared real 4-rank CPU cluster (ddp=1 x
domain=4): the demo's 3-conv net on 66 rows (17/17/16/16) passes, outputs and every gradient; without the
conv2d patch the output is wrong only within the halo width of the shard boundaries; a gradient reduced once
more over the domain group is found N times too large; bad requests are refused before the statement runs.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from sharddbg.cluster.verify import CheckError, CheckResult
from sharddbg.engine.verify import TensorLayout, locate, statement_names
from sharddbg.errors import RankError

from ranks_changed import changed_on_ranks

pytestmark = pytest.mark.cluster

N = 4
ROWS = 66
SHARD_ROWS = [ROWS // N + (1 if r < ROWS % N else 0) for r in range(N)]  # 17, 17, 16, 16
BOUNDARIES = [sum(SHARD_ROWS[:r]) for r in range(1, N)]  # 17, 34, 50
HALO = 3  # three 3x3 convs with padding 1: each needs one row from each neighbour
SETUP = """
torch.manual_seed(0)
ck_x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 16), dim=2, requires_grad=True)
ck_net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(4, 2, 3, padding=1))
"""
PARAM_GRADS = {f"ck_net.{i}.{p}.grad" for i in (0, 2, 4) for p in ("weight", "bias")}


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=60)
    return cluster4


def _distance(row: int, boundaries: list[int]) -> int:
    """Rows from ``row`` to the nearest cut (the last row before a cut and the first after it are 1 away)."""
    return min(b - row if row < b else row - b + 1 for b in boundaries)


def test_three_conv_net_on_uneven_shards_passes_with_every_gradient(cl):
    r = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert isinstance(r, CheckResult) and r.ok, r.verdict
    assert r.verdict.startswith(f"check passed: 8 tensors (outputs and gradients) on {N} ranks agree")
    assert "float32 rtol 1e-04" in r.verdict and "TF32 does not apply (CPU ranks)" in r.verdict
    assert not r.tf32_was_on and r.backward == "check"
    assert r.tensors() == ["ck_y", "ck_x.grad"] + [f"ck_net.{i}.{p}.grad" for i in (0, 2, 4) for p in ("weight", "bias")]
    table = r.table
    assert len(table) == 8 * N and set(table.groupby("tensor")["rank"].apply(tuple)) == {tuple(range(N))}
    assert set(table.loc[table["tensor"] == "ck_x.grad", "kind"]) == {"input grad"}
    assert set(table.loc[table["tensor"].isin(PARAM_GRADS), "kind"]) == {"parameter grad"}
    assert (table["max_abs"] <= table["atol"] + table["rtol"]).all() and (table["bad"] == 0).all()
    assert set(table["rtol"]) == {1e-4} and set(table["dtype"]) == {"torch.float32"}
    # the output and the input gradient are compared shard by shard, the weights' gradients whole
    y = table[table["tensor"] == "ck_y"].set_index("rank")
    assert [y.loc[k, "shape"] for k in range(N)] == [(1, 2, s, 16) for s in SHARD_ROWS]
    assert set(y["reference_shape"]) == {(1, 2, ROWS, 16)} and set(y["compared"]) == {"local shard"}
    assert set(table.loc[table["tensor"].isin(PARAM_GRADS), "compared"]) == {"whole"}
    assert r.boundaries("ck_y") == BOUNDARIES and r.boundaries("ck_x.grad") == BOUNDARIES
    rows = r.rows[r.rows["tensor"] == "ck_y"]
    assert sorted(rows["row"]) == list(range(ROWS)) and rows["ok"].all()
    assert r.loss == pytest.approx(r.reference_loss, rel=1e-5)
    # the check put back what it changed: no gradient was there before, none after; determinism off again
    assert cl.eval("(ck_x.grad is None, ck_net[0].weight.grad is None, torch.are_deterministic_algorithms_enabled())") \
        == [(True, True, False)] * N


def test_each_reference_is_a_new_process_forked_from_the_clusters_warm_python(cl):
    """A check's reference runs in a process of its own, forked from a Python of the cluster's that imported torch
    while the ranks worked: what an earlier reference did is never seen by the next; that Python is reused
    while the notebook's environment stays the same, replaced when it changed, and named among the cluster's
    processes (so a stop or a reap ends it with the rest)."""
    import os

    import psutil

    counted = "import sys\nsys.ck_count = getattr(sys, 'ck_count', 0) + 1\nck_y = ck_net(ck_x) * sys.ck_count"
    try:
        # the ranks count 1, then 2; a reference process that had seen the first check would count 2 as well
        assert cl.check(counted, inputs=["ck_x"], outputs=["ck_y"], model="ck_net", grads=False, display=False).ok
        warm = cl._processes.reference
        assert warm is not None and warm.serves_now()
        assert psutil.Process(warm.pid).cmdline()[-2:] == ["sharddbg.engine.reference", "--serve"]
        assert psutil.Process(warm.pid).ppid() == os.getpid() and warm.pid in {p.pid for p in cl.processes()}
        second = cl.check(counted, inputs=["ck_x"], outputs=["ck_y"], model="ck_net", grads=False, display=False)
        assert not second.ok and second.table["ratio"].max() == pytest.approx(2.0, rel=1e-3), second.verdict
        assert cl._processes.reference is warm  # reused
        # the environment changed: a reference started now would see it, so a new warm Python serves
        os.environ["SHARDDBG_CHECK_ENV_MARK"] = "1"
        try:
            r = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net", grads=False,
                         display=False)
        finally:
            del os.environ["SHARDDBG_CHECK_ENV_MARK"]
        assert r.ok and cl._processes.reference is not warm and warm.proc.poll() is not None
    finally:
        cl.run("import sys\nsys.__dict__.pop('ck_count', None)", display=False)


def test_conv_without_its_patch_is_wrong_only_near_shard_boundaries(cl):
    r = cl.check("with sharddbg.engine.without_patches(F.conv2d):\n    ck_y = ck_net(ck_x)",
                 inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert not r.ok
    failing = r.failures()
    assert set(failing["tensor"]) == {"ck_y"} and sorted(failing["rank"]) == list(range(N))
    rows = r.rows[r.rows["tensor"] == "ck_y"]
    bad = sorted(int(x) for x in rows.loc[~rows["ok"], "row"])
    assert bad, "no failing row"
    assert all(_distance(x, BOUNDARIES) <= HALO for x in bad), bad
    # every boundary is hit, and the rows in the middle of each shard agree with the reference
    assert all(any(_distance(x, [b]) == 1 for x in bad) for b in BOUNDARIES)
    assert rows[rows["row"].apply(lambda x: _distance(x, BOUNDARIES) > HALO)]["ok"].all()
    pattern = r.boundary_pattern("ck_y")
    assert pattern.near_boundaries and list(pattern.failing_rows) == bad and list(pattern.boundaries) == BOUNDARIES
    assert pattern.max_distance <= HALO
    assert f"only in rows near the shard boundaries {', '.join(map(str, BOUNDARIES))}" in r.verdict
    assert "a missing halo?" in r.verdict and r.verdict.startswith("check FAILED: 1 of 1 tensors differ")
    # the fallback's output claims a whole dim 2: compared as the slices the ranks hold, and no backward through it
    assert r.backward == "skipped" and "backward not run" in r.verdict
    assert all("the spec says dim 2 is whole (66)" in note for note in failing["note"])
    # the view: the verdict, the failing rows against the boundaries, the boundaries in the plot
    view = r.show()
    text = view.text()
    assert text.startswith("check FAILED") and f"shard boundaries at rows {', '.join(map(str, BOUNDARIES))}" in text
    assert "a missing halo?" in text
    # the note, the same on every rank, is written once under the table; each row refers to it
    assert text.count("the spec says dim 2 is whole (66)") == 1
    assert text.splitlines()[-1].startswith("[1] the spec says dim 2 is whole (66)")
    # (in the HTML also whole on hover of each row's "[1]")
    assert view.html().count("the spec says dim 2 is whole (66)") == 1 + N and view.html().count(">[1]<") == N
    shown, _ = InteractiveShell.instance().display_formatter.format(r)  # what a notebook shows for the result
    assert 'class="sd-check-fail"' in view.html() and "sd-check-verdict" in shown["text/html"]
    assert shown["text/plain"] == r.verdict
    fig = r.plot_rows("ck_y")
    cuts = sorted(s.x0 for s in fig.layout.shapes if s.line.dash == "dash")
    assert cuts == [b - 0.5 for b in BOUNDARIES]
    red = [x for trace in fig.data if trace.visible for x, c in zip(trace.x, trace.marker.color) if c == "#d62728"]
    assert sorted(red) == bad


def test_a_gradient_reduced_once_more_over_the_domain_group_is_caught(cl):
    # a hand-written gradient sync over the domain group, on top of the reduction ShardTensor already made
    with changed_on_ranks(cl, "_ck_hook = ck_net[0].weight.register_post_accumulate_grad_hook(\n"
                              "    lambda p: torch.distributed.all_reduce(p.grad, group=mesh['domain'].get_group()))",
                          "_ck_hook.remove()"):
        r = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert not r.ok
    failing = r.failures()
    assert set(failing["tensor"]) == {"ck_net.0.weight.grad"} and sorted(failing["rank"]) == list(range(N))
    assert failing["ratio"].tolist() == pytest.approx([float(N)] * N, rel=1e-4)
    assert f"ck_net.0.weight.grad (parameter grad, ranks 0-{N - 1}" in r.verdict
    assert f"{N}x the reference: reduced once more than it should be?" in r.verdict
    assert r.table[r.table["tensor"] != "ck_net.0.weight.grad"]["ok"].all()


def test_a_backward_that_raises_on_every_rank_is_a_finding_and_the_outputs_are_still_compared(cl):
    """A backward raising alike on every rank (as physicsnemo's fallback conv does on torch 2.11 GPUs) is named
    in the verdict, with its place; the outputs are compared; no gradient is; nothing waits or breaks."""
    with changed_on_ranks(cl, "def _ck_boom(g):\n    raise RuntimeError('boom in backward')\n"
                              "_ck_hook = ck_net[4].bias.register_hook(_ck_boom)", "_ck_hook.remove()"):
        r = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert not r.ok and r.backward == "failed"
    assert r.tensors() == ["ck_y"] and r.table["ok"].all()  # the output agrees; no gradient was compared
    assert r.verdict.startswith("check FAILED: the backward raised on every rank: RuntimeError: boom in backward "
                                "(at cell sent by cl.run, ")
    assert r.backward_note.endswith(", line 2: `raise RuntimeError('boom in backward')`); gradients not compared")
    assert "; every tensor compared (1) agrees with the unsharded reference; " in r.verdict
    assert cl.broken is None and cl.busy_ranks() == []
    assert cl.eval("ck_net[4].bias.grad is None") == [True] * N  # put back as it was


def test_a_backward_that_raises_on_one_rank_only_is_raised_as_that_ranks_error(cl):
    """Only rank 2's backward raises: the others may be waiting in a backward collective, so the check does not
    go on: the error names rank 2 and its exception, the ranks are released, and the next check runs."""
    with changed_on_ranks(cl, "def _ck_boom(g):\n    raise RuntimeError('boom on rank 2')\n"
                              "_ck_hook = ck_net[0].weight.register_hook(_ck_boom) if rank == 2 else None",
                          "_ck_hook.remove() if _ck_hook is not None else None"):
        with pytest.raises(RankError, match="rank 2 raised RuntimeError: boom on rank 2"):
            cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net").ok


def test_weights_that_differ_across_the_domain_group_are_named(cl):
    with changed_on_ranks(cl, "_ck_saved = ck_net[2].weight.detach().clone()\n"
                              "with torch.no_grad():\n    if rank == 3:\n        ck_net[2].weight.mul_(1.5)",
                          "with torch.no_grad():\n    ck_net[2].weight.copy_(_ck_saved)"):
        r = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net")
    assert not r.ok and r.unsynced == ["ck_net.2.weight"]
    assert ("the ranks of a domain group hold different values of ck_net.2.weight (the reference has the group's "
            "first rank's): weights not broadcast at start-up? (cl.doctor())") in r.verdict
    # rank 3's shard of the output is wrong (its weight), and rank 2's only next to rank 3 (the halo it receives);
    # ranks 0 and 1 agree with the reference (rank 0's weights)
    y = r.table[r.table["tensor"] == "ck_y"].set_index("rank")
    assert not y.loc[3, "ok"] and y.loc[0, "ok"] and y.loc[1, "ok"]
    rows = r.rows[(r.rows["tensor"] == "ck_y") & (r.rows["rank"] == 2)]
    assert set(rows.loc[~rows["ok"], "row"]) <= {BOUNDARIES[-1] - 2, BOUNDARIES[-1] - 1}


def test_a_multi_op_statement_with_its_own_loss_and_random_numbers(cl):
    # plain tensors drawn inside the statement come from the same RNG state in the reference; that state seeded
    # here, so that what is drawn (and the cubed loss's agreement within the tolerance) does not depend on what
    # the tests before drew
    cl.run("torch.manual_seed(5)", timeout=30)
    stmt = ("ck_h = ck_net(ck_x)\n"
            "ck_noise = torch.randn(1, 2, 1, 1)\n"
            "ck_z = torch.tanh(ck_h) * 2 + ck_noise\n"
            "ck_s = ck_z.sum(dim=1)")
    r = cl.check(stmt, loss="(ck_s ** 3).mean() + ck_z.abs().mean()")
    assert r.ok, r.verdict
    assert r.inputs == ["ck_x"] and r.models == ["ck_net"] and r.outputs == ["ck_h", "ck_noise", "ck_z", "ck_s"]
    assert set(r.tensors()) == {"ck_h", "ck_noise", "ck_z", "ck_s", "ck_x.grad"} | PARAM_GRADS
    s = r.table[r.table["tensor"] == "ck_s"].set_index("rank")
    assert [s.loc[k, "shape"] for k in range(N)] == [(1, n, 16) for n in SHARD_ROWS]
    assert r.loss == pytest.approx(r.reference_loss, rel=1e-5)
    # a statement that runs its own backward: the check compares the gradients it left
    r = cl.check("ck_y = ck_net(ck_x)\n(ck_y ** 2).sum().backward()")
    assert r.ok and r.backward == "statement" and len(r.tensors()) == 8 and r.loss is None
    # outputs only: no gradient compared, and a tolerance of the caller's
    r = cl.check("ck_y = ck_net(ck_x)", grads=False, rtol=1e-3)
    assert r.ok and r.tensors() == ["ck_y"] and set(r.table["rtol"]) == {1e-3} and r.backward == "none"


def test_bad_requests_are_refused_before_the_statement_runs(cl):
    stmt = "ck_ran = 1\nck_y = ck_net(ck_x)"
    with pytest.raises(CheckError, match="no variable 'ck_nope' on the ranks"):
        cl.check(stmt, inputs=["ck_x", "ck_nope"], outputs=["ck_y"])
    with pytest.raises(CheckError, match="ck_net is a Sequential, not a tensor"):
        cl.check(stmt, inputs=["ck_net"], outputs=["ck_y"])
    with pytest.raises(CheckError, match="rtol must be a finite number of at least 0"):
        cl.check(stmt, outputs=["ck_y"], rtol=-1)
    with pytest.raises(CheckError, match="the statement is not valid Python"):
        cl.check("ck_y = (", outputs=["ck_y"])
    with pytest.raises(CheckError, match="outputs: '1y' is not a variable name"):
        cl.check(stmt, outputs=["1y"])
    assert cl.eval("'ck_ran' in globals()") == [False] * N
    # a statement the single reference process cannot run: named, with its line
    with pytest.raises(CheckError, match=r"the unsharded reference raised NameError: name 'mesh' is not defined .*"
                                         r"line 2 of the statement"):
        cl.check("ck_y = ck_net(ck_x)\nck_g = mesh['domain'].size()")
    assert cl.eval("(ck_x.grad is None, torch.are_deterministic_algorithms_enabled())") == [(True, False)] * N
    # a statement that raises on a rank: the rank's error, and everything put back
    cl.run("ck_x.grad = torch.zeros_like(ck_x)", timeout=30)
    with pytest.raises(RankError) as info:
        cl.check("ck_y = ck_net(ck_x)\nif rank == 2:\n    raise ValueError('boom on rank 2')")
    assert info.value.causes == [2] and "boom on rank 2" in str(info.value)
    assert cl.eval("(float(ck_x.grad.to_local().abs().sum()), torch.are_deterministic_algorithms_enabled())") \
        == [(0.0, False)] * N
    cl.run("ck_x.grad = None", timeout=30)


def test_shard_check_magic(cl):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    with capture_output():
        r = ip.run_cell_magic("shard_check", "--rtol 1e-3 --inputs ck_x --model ck_net", "ck_y = ck_net(ck_x)")
    assert isinstance(r, CheckResult) and r.ok and set(r.table["rtol"]) == {1e-3} and len(r.tensors()) == 8
    with capture_output():
        r = ip.run_cell_magic("shard_check", "--no-grads --outputs ck_y", "ck_y = ck_net(ck_x)")
    assert r.ok and r.tensors() == ["ck_y"]
    with pytest.raises(UsageError, match="not a finite number of at least 0"):
        ip.run_cell_magic("shard_check", "--atol -1", "ck_y = ck_net(ck_x)")
    magic = ip.find_magic("shard_check", "cell")
    assert magic.__doc__.startswith("::\n\n  %shard_check [--inputs NAMES]") and "--no-grads" in magic.__doc__


def test_the_names_a_statement_reads_and_binds():
    stmt = ("h = net(x)\n"
            "h += bias\n"
            "zs = [torch.tanh(v) * k for v in (h, h2)]\n"
            "def f(a, b=scale):\n    return a * b + c\n"
            "out = f(h) if flag else None\n"
            "import math as m\n"
            "r = m.pi * w")
    reads, binds = statement_names(stmt, loss="(out ** 2).mean() + extra")
    # in the order Python reads them (a comprehension's iterable first), builtins and names bound before left out;
    # names a function body reads count as reads too
    assert reads == ["net", "x", "bias", "h2", "torch", "k", "scale", "c", "flag", "w", "extra"]
    assert binds == ["h", "zs", "f", "out", "m", "r"]


def test_placing_uneven_shards_in_the_global_tensor():
    layouts = [TensorLayout(mesh_ranks=(0, 1, 2, 3), coordinate=(0, k), placements=(("replicate",), ("shard", 2)),
                            local_shape=(1, 2, n, 16), global_shape=(1, 2, ROWS, 16)) for k, n in enumerate(SHARD_ROWS)]
    where = [locate(mine, layouts) for mine in layouts]
    assert [w.offsets for w in where] == [(0, 0, o, 0) for o in [0] + BOUNDARIES]
    assert {w.row_dim for w in where} == {2} and not any(w.inferred or w.problem for w in where)
    # a spec that calls dim 2 whole while the ranks hold slices of it: placed in mesh order, and said so
    whole = [TensorLayout(l.mesh_ranks, l.coordinate, (("replicate",), ("replicate",)), l.local_shape, l.global_shape)
             for l in layouts]
    w = locate(whole[2], whole)
    assert w.offsets == (0, 0, BOUNDARIES[1], 0) and w.inferred and "dim 2 is whole (66)" in w.inferred[0]
    short = [TensorLayout(l.mesh_ranks, l.coordinate, l.placements, l.local_shape, (1, 2, ROWS + 1, 16)) for l in layouts]
    assert "hold 66 of dim 2's 67" in locate(short[0], short).problem


LOCAL_MODEL = """
import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))
"""
RANK_BOUND_MODEL = """
import torch.distributed as dist
from torch import nn

WORLD = dist.get_world_size()  # at import: only the ranks have a process group


class RankBoundNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x)
"""


def test_a_model_from_a_module_on_the_ranks_own_path(cl, tmp_path):
    """The ranks import the model's class from a folder they put on their own sys.path (the notebook's process
    and the reference's never did): the reference takes the ranks' path and folder and rebuilds it; a module the
    path no longer leads to travels by value; one whose import needs the ranks is named, with its file (its fix,
    ``cloudpickle.register_pickle_by_value`` on the ranks, is the by-value path tested last)."""
    (tmp_path / "ck_local_model.py").write_text(LOCAL_MODEL)
    (tmp_path / "ck_rank_bound_model.py").write_text(RANK_BOUND_MODEL)
    folder = str(tmp_path)
    with changed_on_ranks(cl, f"import sys\nsys.path.insert(0, {folder!r})\n"
                              "from ck_local_model import ConvNet\nfrom ck_rank_bound_model import RankBoundNet\n"
                              "torch.manual_seed(0)\nck_conv = ConvNet()\nck_bound = RankBoundNet()",
                          f"sys.path[:] = [p for p in sys.path if p != {folder!r}]\n"
                          "for _m in ('ck_local_model', 'ck_rank_bound_model'):\n    sys.modules.pop(_m, None)\n"
                          "del ck_conv, ck_bound"):
        r = cl.check("ck_y = ck_conv(ck_x)", inputs=["ck_x"], model="ck_conv")
        assert r.ok and r.tensors() == ["ck_y", "ck_x.grad", "ck_conv.conv.weight.grad", "ck_conv.conv.bias.grad"], \
            r.verdict
        with pytest.raises(CheckError) as info:
            cl.check("ck_y = ck_bound(ck_x)", inputs=["ck_x"], model="ck_bound", grads=False)
        message = str(info.value)
        assert message.startswith(
            f"the unsharded reference could not rebuild ck_bound: importing module 'ck_rank_bound_model' (the ranks "
            f"imported it from {tmp_path / 'ck_rank_bound_model.py'}) raised ValueError: Default process group has "
            f"not been initialized"), message
        assert "Nothing was compared" in message and "cloudpickle.register_pickle_by_value(ck_rank_bound_model)" \
            in message and "WORLD = dist.get_world_size()" in message
        # the folder gone from the ranks' path after the import: the module travels by value
        cl.run(f"sys.path.remove({folder!r})")
        assert cl.check("ck_y = ck_conv(ck_x)", inputs=["ck_x"], model="ck_conv", grads=False).ok
