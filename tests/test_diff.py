"""The op-by-op diff (``Cluster.diff``, ``%%shard_diff``) on the shared real 4-rank CPU cluster (ddp=1 x domain=4):
the demo's 3-conv net agrees op by op, and without the conv2d patch its first conv is the first op that departs,
at the shard boundaries; a custom op whose handler gets one rank's halo wrong is named with that rank; an op
called in a loop is matched call by call; a gradient reduced once more is named at the backward of the op that
read the parameter; bad requests are refused; ``blame=True`` re-runs the statement in plain processes without
sharddbg and says whether it departs there too.
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from sharddbg.analysis.diff import DiffResult
from sharddbg.cluster.verify import CheckError, DiffError

from ranks_changed import changed_on_ranks

pytestmark = pytest.mark.cluster

N = 4
BOUNDARIES = (17, 34, 50)  # 66 rows over 4 ranks: 17, 17, 16, 16
SETUP = """
torch.manual_seed(0)
df_x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 16), dim=2, requires_grad=True)
df_net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(4, 2, 3, padding=1))

# a custom op: the mean of each row and its two neighbours along dim 2 (the first and last rows kept), with a
# ShardTensor handler that takes one halo row from each neighbour; df_wrong makes it zero the halo row from
# above on one rank ("rank") or on every rank but the first at one call ("call")
df_wrong = {"rank": None, "call": None, "calls": 0}

def df_blur_plain(x):
    y = x.clone()
    y[:, :, 1:-1] = (x[:, :, :-2] + x[:, :, 1:-1] + x[:, :, 2:]) / 3
    return y

def df_blur(x):
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(df_blur, (x,), x)
    return df_blur_plain(x)

def _df_blur_handler(func, types, args, kwargs):
    x = args[0]
    df_wrong["calls"] += 1
    full = x.full_tensor()
    spec = x._spec
    k = spec.mesh.get_local_rank()
    sizes = [int(s[2]) for s in spec._sharding_shapes[0]]
    start = sum(sizes[:k])
    lo, hi = max(start - 1, 0), min(start + sizes[k] + 1, full.shape[2])
    piece = full[:, :, lo:hi]
    if k > 0 and (df_wrong["rank"] == rank or df_wrong["call"] == df_wrong["calls"]):
        piece = torch.cat([torch.zeros_like(piece[:, :, :1]), piece[:, :, 1:]], dim=2)
    local = df_blur_plain(piece)[:, :, start - lo:start - lo + sizes[k]]
    return ShardTensor.from_local(local.contiguous(), spec.mesh, spec.placements, sharding_shapes=spec._sharding_shapes)

ShardTensor.register_function_handler(df_blur, _df_blur_handler)

# a helper of the user's: its conv is called on the helper's line, reached from the statement's line
df_w = torch.randn(2, 3, 3, 3)

def df_block(x):
    return torch.conv2d(x, df_w, padding=1)
"""


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=60)
    yield cluster4
    cluster4.run("ShardTensor._function_registry.pop(df_blur, None)", timeout=30)


def smoke_setup():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))


def smoke_step(model, ctx):
    import torch

    return model(ctx.shard(torch.randn(1, 3, 16, 8), 2)).pow(2).mean()


def smoke_setup_tokens():
    from torch import nn

    return nn.Linear(8, 8)


def smoke_step_merging_batch_and_tokens(model, ctx):
    """``x.reshape(B * N, C)`` merges the batch with the sharded dim: a batch of 2 per domain group raises."""
    import torch

    x = ctx.shard(torch.randn(1, 16, 8), 1)
    b, n, c = x.shape
    return model(x.reshape(b * n, c)).reshape(b, n, c).pow(2).mean()


def _wrong(cl, rank=None, call=None) -> None:
    cl.run(f"df_wrong.update(rank={rank}, call={call}, calls=0)", timeout=30)


def test_without_the_conv2d_patch_the_first_conv_departs_at_the_shard_boundaries(cl):
    r = cl.diff("df_y = df_net(df_x)")
    assert isinstance(r, DiffResult) and r.ok and r.first is None, r.answer
    ops = r.get_ops()
    forward = ops[ops["phase"] == "forward"]
    assert forward["op"].tolist() == ["torch.conv2d", "torch.nn.functional.relu"] * 2 + ["torch.conv2d"]
    assert forward["call"].tolist() == [1, 1, 2, 2, 3] and set(forward["verdict"]) == {"agrees"}
    assert forward["module"].tolist() == [f"df_net.{i}" for i in range(5)]
    # the backward: the gradient reaching each op, and each parameter's gradient at the op that read it
    backward = ops[ops["phase"] == "backward"]
    assert backward["tensor"].tolist()[:3] == ["gradient", "df_net.4.weight.grad", "df_net.4.bias.grad"]
    assert len(backward) == 5 + 6 and set(backward["verdict"]) == {"agrees"}
    assert r.answer.startswith("every op agrees with the single-device run: 16 op outputs and gradients compared "
                               "on 4 ranks")

    r = cl.diff("with sharddbg.engine.without_patches(F.conv2d):\n    df_y = df_net(df_x)")
    assert not r.ok
    first = r.first
    assert (first.op, first.call, first.phase, first.module) == ("torch.conv2d", 1, "forward", "df_net.0")
    assert first.ranks == (0, 1, 2, 3) and first.boundaries == BOUNDARIES
    failing = [int(x) for part in first.rows.split(", ") for x in part.split("-")]
    assert all(min(abs(row - b) for b in BOUNDARIES) <= 1 for row in failing), first.rows
    assert r.answer.startswith("the first op that departs: `torch.conv2d` (1st call) at line 2 of the statement "
                               "(`df_y = df_net(df_x)`), module df_net.0: output max abs ")
    assert "on ranks 0-3, rows 16-17, 33-34, 49-50 (the shard boundaries are at rows 17, 34, 50): its inputs " \
           "agreed: the statement's inputs (gathered whole); parameters df_net.0.weight, df_net.0.bias" in r.answer
    # the view: the answer first, then the table, the first departing row tinted most
    view = r.show()
    assert view.text().splitlines()[0] == r.answer and "torch.conv2d" in view.text().splitlines()[3]
    # the explorer opens on the first departing op: that conv's call on the first departing rank, its detail shown
    assert first.rank == 0 and first.seq == int(r.get_ranks().query("key == @first.key and rank == 0")["seq"].iloc[0])
    explorer = r.explore()
    assert explorer.selected == [0, first.seq]
    detail = explorer.detail()["row"]
    assert (detail["op"], detail["rank"], detail["seq"], detail["phase"]) == ("torch.conv2d", 0, first.seq, "forward")
    assert view.text().splitlines()[1] == (f"r.explore(): the trace explorer opened on this op's call on rank 0 "
                                           f"(seq {first.seq}), its detail shown")
    assert f"class='sd-diff-explore' data-rank='0' data-seq='{first.seq}'" in view.html()
    assert view.html().index("sd-diff-fail") < view.html().index("<table") and "rgba(220, 40, 40, 0.32)" in view.html()
    shown, _ = InteractiveShell.instance().display_formatter.format(r)
    assert shown["text/plain"] == r.answer and "sd-diff" in shown["text/html"]



def test_a_handler_that_gets_one_ranks_halo_wrong_is_named_with_that_rank(cl):
    _wrong(cl, rank=2)
    r = cl.diff("df_b = df_blur(df_x) * 2", grads=False)
    first = r.first
    assert first.op == "__main__.df_blur" and first.ranks == (2,) and first.rows == "34", r.answer
    ops = r.get_ops()
    assert ops["op"].tolist() == ["__main__.df_blur", "Tensor.mul"] and ops["verdict"].tolist() == ["departs"] * 2
    assert r.answer.startswith("the first op that departs: `__main__.df_blur` (1st call) at cell sent by cl.run, "
                               "line 18 in df_blur: `return torch.overrides.handle_torch_function(df_blur, (x,), x)`, called from line 1 "
                                "of the statement (`df_b = df_blur(df_x) * 2`): output ")
    assert "on rank 2, rows 34 (the shard boundaries are at rows 17, 34, 50): its inputs agreed" in r.answer
    # the handler's own full_tensor() has no single-device partner: skipped, and said so
    assert r.get_skipped().set_index("op")["calls"].to_dict()["ShardTensor.full_tensor"] == 1
    assert "calls inside other ops or ShardTensor methods skipped (no single-device partner: " in r.answer


def test_an_op_called_in_a_loop_is_matched_call_by_call(cl):
    _wrong(cl, call=3)
    r = cl.diff("df_h = df_x\nfor _ in range(4):\n    df_h = df_blur(df_h)", grads=False)
    ops = r.get_ops()
    assert ops["call"].tolist() == [1, 2, 3, 4]
    assert ops["verdict"].tolist() == ["agrees", "agrees", "departs", "departs"]
    assert r.first.call == 3 and r.first.site == ("cell sent by cl.run, line 18 in df_blur: `return torch.overrides.handle_torch_"
                                                "function(df_blur, (x,), x)`, called from line 3 of the statement "
                                                "(`df_h = df_blur(df_h)`)")
    assert r.first.ranks == (1, 2, 3) and "its inputs agreed: the outputs of the 1 op before it (max abs 0)" in r.answer
    _wrong(cl)


def test_a_gradient_reduced_twice_is_named_at_the_backward_of_the_op_that_read_it(cl):
    with changed_on_ranks(cl, "_df_hook = df_net[0].weight.register_post_accumulate_grad_hook(\n"
                              "    lambda p: torch.distributed.all_reduce(p.grad, group=mesh['domain'].get_group()))",
                          "_df_hook.remove()"):
        r = cl.diff("df_y = df_net(df_x)")
    assert set(r.get_ops("forward")["verdict"]) == {"agrees"}
    first = r.first
    assert (first.phase, first.op, first.call, first.tensor) == ("backward", "torch.conv2d", 1, "df_net.0.weight.grad")
    assert r.answer.startswith("the first op whose backward departs: `torch.conv2d` (1st call) at line 1 of the "
                               "statement (`df_y = df_net(df_x)`), module df_net.0: gradient of df_net.0.weight ")
    assert "the gradient reaching its output agreed" in r.answer and "4x the reference: reduced once more" in r.answer


def test_bad_requests_are_refused(cl):
    with pytest.raises(DiffError, match="ops= names no op: leave it out"):
        cl.diff("df_y = df_net(df_x)", ops=[])
    with pytest.raises(DiffError, match="max_memory must be a number of bytes above 0"):
        cl.diff("df_y = df_net(df_x)", max_memory=0)
    with pytest.raises(DiffError, match=r"ops=\['conv3d'\] names no op the statement called; it called "
                                        r"torch\.conv2d, torch\.nn\.functional\.relu"):
        cl.diff("df_y = df_net(df_x)", ops="conv3d", grads=False)
    # the memory is said before the ranks run anything: the statement sized on the meta device (the
    # custom op's 1 x 3 x 66 x 16 floats, two convs' and two relus' 1 x 4 x 66 x 16, and their gradients)
    _wrong(cl)
    with pytest.raises(DiffError, match=r"cl.diff would keep about 156\.8 KiB in the single-device reference \(every "
                                        r"compared op's whole output and its gradient, sized by a run of the statement "
                                        r"on the meta device\), above max_memory=1000 bytes\. Nothing ran: narrow ops= "
                                        r"to the ops you suspect, or raise max_memory="):
        cl.diff("df_m = df_net[:4](df_blur(df_x))", max_memory=1000)
    # nothing ran: the custom op's handler was never called, the statement bound nothing
    assert cl.eval("(df_wrong['calls'], 'df_m' in globals())") == [(0, False)] * N
    # a statement the meta device cannot run is told after the sharded run, as before
    with pytest.raises(DiffError, match=r"cl.diff would keep .* on a rank and .* in the single-device reference "
                                        r".*above max_memory=1000 bytes\. Nothing was compared"):
        cl.diff("df_y = df_net(df_x)\ndf_n = int(df_y.sum() > 0)", max_memory=1000)
    with pytest.raises(CheckError, match=r"the unsharded reference raised NameError: name 'mesh' is not defined"):
        cl.diff("df_y = df_net(df_x)\ndf_g = mesh['domain'].size()", grads=False)
    # every refusal put back what the diff changed: no keeper, no recording, no gradient
    assert cl.eval("(df_x.grad is None, sharddbg.engine.recorder.is_recording(), "
                   "sharddbg.engine.recorder.recording.active_recorder() is None)") == [(True, False, True)] * N
    # ops= narrows the comparison
    r = cl.diff("df_y = df_net(df_x)", ops="relu", grads=False)
    assert r.ok and r.get_ops()["op"].tolist() == ["torch.nn.functional.relu"] * 2


def test_shard_diff_magic(cl):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    with capture_output():
        r = ip.run_cell_magic("shard_diff", "--no-grads --ops conv2d", "df_y = df_net(df_x)\ndf_z = df_block(df_x)")
    assert isinstance(r, DiffResult) and r.ok and r.get_ops()["op"].tolist() == ["torch.conv2d"] * 4
    # an op inside a function of the user's: the function's line, then the statement's line that called it
    line = SETUP.lstrip("\n").splitlines().index("    return torch.conv2d(x, df_w, padding=1)") + 1
    assert r.get_ops()["site"].tolist()[3] == (f"cell sent by cl.run, line {line} in df_block: `return torch.conv2d(x, "
                                              f"df_w, padding=1)`, called from line 2 of the statement "
                                              f"(`df_z = df_block(df_x)`)")
    with pytest.raises(UsageError, match="is not a number of bytes above 0"):
        ip.run_cell_magic("shard_diff", "--max-memory -1", "df_y = df_net(df_x)")
    magic = ip.find_magic("shard_diff", "cell")
    assert magic.__doc__.startswith("::\n\n  %shard_diff [--inputs NAMES]") and "--blame" in magic.__doc__


def test_blame_tells_a_failure_of_your_own_from_one_of_sharddbgs(cl):
    # physicsnemo's fallback conv (the patch removed) is wrong without sharddbg too
    stmt = "with sharddbg.engine.without_patches(F.conv2d):\n    df_y = df_net(df_x)"
    r = cl.check(stmt, grads=False, blame=True)
    assert not r.ok and r.blame is not None and r.blame.fails_without is True, r.blame
    assert r.blame.sharddbg_loaded == [] and r.blame.tensors[0].name == "df_y" and not r.blame.tensors[0].ok
    assert "Without sharddbg: fails without sharddbg too (torch " in r.verdict
    assert "df_y max abs " in r.verdict and "still departs from the single-device run: not sharddbg's doing" in r.verdict
    # the recorder itself breaks the first conv's output on rank 2 (a test-only hook): the same statement in plain
    # processes agrees with the single-device run, so the diff's departure is sharddbg's own
    with changed_on_ranks(cl, "import sharddbg.engine.recorder.outputs as _df_outputs\n"
                              "_df_outputs.TEST_CORRUPTION = ('torch.conv2d', 2)", "_df_outputs.TEST_CORRUPTION = None"):
        r = cl.diff("df_y = df_net(df_x)", grads=False, blame=True)
    assert (r.first.op, r.first.call, r.first.ranks) == ("torch.conv2d", 1, (2,))
    assert r.blame.fails_without is False and r.blame.sharddbg_loaded == []
    assert r.answer.endswith("Without sharddbg: passes without sharddbg (torch " + r.blame.versions["torch"]
                             + ", physicsnemo " + r.blame.versions["physicsnemo"] + "): in plain processes every "
                             "output and gradient (1) agrees with the single-device run, so sharddbg itself changed "
                             "the result: a sharddbg problem, please report it")
    # the smoke matrix: a configuration whose step raises on the ranks raises without sharddbg too
    result = cl.smoke(smoke_setup_tokens, smoke_step_merging_batch_and_tokens,
                      ["domain=4, 2 samples per domain group"], steps=2, blame=True)
    row = result.table.loc["domain=4, 2 samples per domain group"]
    assert not row["ok"] and row["outcome"].startswith("ranks [0, 1, 2, 3] raised "), row["outcome"]
    assert row["without_sharddbg"].startswith("fails without sharddbg too (") and \
        row["without_sharddbg"].endswith(" on ranks 0, 1, 2, 3)") and row["outcome"].endswith(row["without_sharddbg"])
    assert result.blames["domain=4, 2 samples per domain group"].sharddbg_loaded == []
    # sharddbg's engines without physicsnemo's conv2d patch (as a fault of sharddbg's patch handling would leave
    # them): the configuration is off on the ranks and matches the single device in plain processes
    with changed_on_ranks(cl, "_df_unpatched = sharddbg.engine.without_patches(F.conv2d)\n_df_unpatched.__enter__()",
                          "_df_unpatched.__exit__(None, None, None)"):
        result = cl.smoke(smoke_setup, smoke_step, ["domain=4, inference"], steps=2, blame=True)
    row = result.table.loc["domain=4, inference"]
    assert row["outcome"].startswith("loss off from step 0") and \
        row["without_sharddbg"] == "passes without sharddbg: sharddbg's doing", row["outcome"]
    assert result.verdict.endswith("beyond rtol 0.001; passes without sharddbg: sharddbg's doing")
