"""From a fallback to a verified patch, on the shared real 4-rank CPU cluster (ddp=1 x domain=4): the fallback's
patch family read from the trace, a handler written in the test (as in a notebook cell) registered on every
rank by value, checked against one device and the fallback side by side, and taken back, the registries exactly
as they were. ``torch.diff`` (a 2-point stencil, no physicsnemo patch) and ``F.silu`` (pointwise, no patch)
are real fallbacks of physicsnemo 2.2.2.
"""

from __future__ import annotations

import threading

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from sharddbg.cluster.patching import PatchError, handler_from_source
from sharddbg.engine import api
from sharddbg.patches import scaffold
from sharddbg.views import explorer

pytestmark = pytest.mark.cluster

ROWS = 40  # 10 rows per rank along dim 2
ROW_BYTES = 3 * 4  # one row of x (1, 3, ROWS) in float32
SETUP = """
torch.manual_seed(0)
pw_x = sharddbg.engine.scatter(torch.randn(1, 3, 40), dim=2, requires_grad=True)
"""
DIFF = "pw_y = torch.diff(pw_x, dim=2)"
SILU = "pw_y = F.silu(pw_x)"

NO_HALO = '''
def diff_without_halo(func, types, args, kwargs):
    # wrong on purpose: each shard differences its own rows only and repeats its last row for the one it lacks
    x = args[0]
    spec = x._spec
    local = x.to_local()
    rank, size = spec.mesh.get_local_rank(0), spec.mesh.size(0)
    rows = [s[2] for s in spec._sharding_shapes[0]]
    if rank < size - 1:
        out = torch.diff(local, dim=2, append=local[..., -1:])
    else:
        out = torch.diff(local, dim=2)
    shapes = {0: [(1, 3, rows[r] - (1 if r == size - 1 else 0)) for r in range(size)]}
    return ShardTensor.from_local(out, spec.mesh, spec.placements, sharding_shapes=shapes)
'''

RAISES_ON_RANK_1 = '''
def silu_on_some_ranks(func, types, args, kwargs):
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("rank 1 has no silu")
    x = args[0]
    return ShardTensor.from_local(func(x.to_local()), x._spec.mesh, x._spec.placements,
                                  sharding_shapes=x._spec._sharding_shapes)
'''

ADD_TYPE_ERROR = '''
def add_handler(func, types, args, kwargs):
    raise TypeError("this add handler takes no ShardTensor")
'''


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=60)
    yield cluster4
    cluster4.run("del pw_x\npw_y = None\ndel pw_y", timeout=30)


@pytest.fixture
def untouched(cl):
    """The registries and the handlers cl.patch registered, before the test; after it, they must be the same."""
    before = cl.apply(api.patch_registry_state)
    yield before
    for op in {p["op"] for s in cl.apply(api.patch_installed) for p in s}:
        cl.unpatch(op)
    assert cl.apply(api.patch_registry_state) == before, "the registries were left changed"


def _paths(trace, op):
    ops = trace.get_ops()
    calls = ops[(ops["op"] == op) & (ops["depth"] == 0) & (ops["phase"] == "forward")]
    return dict(calls.groupby("rank")["path"].agg(lambda p: sorted(set(p))))


def test_a_stencil_fallback_is_classified_halo_and_its_scaffold_passes_moving_only_halo_rows(cl, untouched):
    handler = handler_from_source(scaffold("torch.diff", "halo", halo_width=1))
    r = cl.check_patch("torch.diff", DIFF, handler, inputs="pw_x", outputs="pw_y", repeat=2)
    # the side without the handler is a trace of the fallback: its family, as get_fallbacks() reads it
    t = r.traces["before"]
    row = t.get_fallbacks().set_index("op").loc["torch.diff"]
    assert row["family"] == "halo"
    assert (row["sharded_dim"], row["halo_width"]) == (2, 1)
    assert "conv1d's halo patch" in row["closest_patch"]
    assert "1 row shorter along the sharded dim 2" in row["evidence"]
    assert "all_gather" in row["fallback_collectives"]
    # the explorer's detail of a fallback call shows the same
    ops = t.get_ops()
    first = ops[(ops["op"] == "torch.diff") & (ops["rank"] == 0)].iloc[0]
    family = explorer.op_detail(t, 0, int(first["seq"]))["patch_family"]
    assert (family["family"], family["halo_width"]) == ("halo", 1) and family["evidence"] == row["evidence"]

    assert r.ok, r.verdict
    assert r.verdict.startswith("patched: correct")
    assert r.before.paths == ("dtensor_fallback_function",) and r.after.paths == ("function_handler",)
    assert any(c.kind.startswith("all_gather") for c in r.before.collectives)
    # the halo exchange only: one all_to_all_single of at most one row from each neighbour
    assert [c.kind for c in r.after.collectives] == ["all_to_all_single"]
    assert 0 < r.after.bytes_per_call <= 2 * ROW_BYTES
    assert r.after.check.table["kind"].isin(["output", "input grad"]).all() and len(r.after.check.table) == 8
    assert "replaced by 1 all_to_all_single" in r.verdict
    assert set(r.table.columns) == {"before", "after"}
    assert r.show().text().startswith(r.verdict)
    assert not any(cl.apply(api.patch_installed)), "check_patch left its handler registered"


def test_a_handler_without_halo_fails_the_check_at_the_shard_boundaries(cl, untouched):
    r = cl.check_patch("torch.diff", DIFF, handler_from_source(NO_HALO), inputs="pw_x", outputs="pw_y", repeat=1,
                       before=False)
    assert not r.ok and r.handled and r.before is None
    assert r.verdict.startswith("patched: WRONG")
    pattern = r.after.check.boundary_pattern("pw_y")
    assert pattern.near_boundaries and pattern.failing_rows, pattern
    assert set(pattern.failing_rows) <= {b - 1 for b in (10, 20, 30)}  # the last row before each cut
    assert "missing halo" in r.verdict


def test_a_pointwise_fallback_is_classified_pointwise_and_patched_without_a_collective(cl, untouched):
    row = cl.trace(SILU, display=False).get_fallbacks().set_index("op").loc["torch.nn.functional.silu"]
    assert row["family"] == "pointwise" and row["fallback_bytes"] == 0
    assert "unary_ops" in row["closest_patch"]
    handler = handler_from_source(scaffold("torch.nn.functional.silu", "pointwise"))
    r = cl.check_patch("F.silu", SILU, handler, inputs="pw_x", outputs="pw_y", repeat=1, before=False)
    assert r.ok, r.verdict
    assert r.op == "torch.nn.functional.silu"
    assert r.after.paths == ("function_handler",) and r.after.collectives == ()
    assert r.verdict.startswith("patched: correct") and "no collective per call and rank" in r.verdict


def test_unpatch_restores_the_fallback_path_on_every_rank(cl, untouched):
    handler = handler_from_source(scaffold("torch.nn.functional.silu", "pointwise"))
    record = cl.patch("torch.nn.functional.silu", handler)
    assert (record.op, record.kind, record.replaces) == ("torch.nn.functional.silu", "function", None)
    try:
        assert _paths(cl.trace(SILU, display=False), record.op) == {r: ["function_handler"] for r in range(4)}
    finally:
        cl.unpatch("torch.nn.functional.silu")
    assert _paths(cl.trace(SILU, display=False), record.op) == {r: ["dtensor_fallback_function"] for r in range(4)}
    assert cl.apply(api.patch_registry_state) == untouched


def test_a_handler_registered_over_a_physicsnemo_patch_gives_it_back(cl, untouched):
    handler = handler_from_source("def mean_handler(func, types, args, kwargs):\n    raise RuntimeError('unused')\n")
    record = cl.patch("torch.mean", handler)
    try:
        assert record.replaces == "physicsnemo.domain_parallel.custom_ops._reductions.mean_wrapper"
        assert cl.apply(api.patch_registry_state) != untouched
    finally:
        cl.unpatch("torch.mean")
    assert cl.apply(api.patch_registry_state) == untouched


def test_bad_handlers_and_names_are_refused_in_one_sentence_leaving_the_ranks_as_they_were(cl, untouched):
    lock = threading.Lock()

    def holds_a_lock(func, types, args, kwargs):
        with lock:
            return func(*args, **kwargs)

    with pytest.raises(PatchError, match=r"cannot be sent to the ranks: cloudpickle could not pickle it "
                                         r"\(TypeError: cannot pickle '_thread.lock' object\)"):
        cl.patch("torch.nn.functional.silu", holds_a_lock)
    with pytest.raises(PatchError, match=r"^'sharddbg.engine.scatter' is a function, not a torch function or op "
                                         r"overload.*the ranks are as they were$"):
        cl.patch("sharddbg.engine.scatter", handler_from_source(scaffold("torch.diff", "pointwise")))
    with pytest.raises(PatchError, match=r"^'torch.no_such_op' names nothing on the ranks"):
        cl.patch("torch.no_such_op", handler_from_source(scaffold("torch.diff", "pointwise")))
    with pytest.raises(PatchError, match=r"has the wrong signature: ShardTensor calls a function handler as "
                                         r"handler\(func, types, args, kwargs\)"):
        cl.patch("torch.diff", handler_from_source("def one_arg(x):\n    return x\n"))
    with pytest.raises(PatchError, match=r"takes \(\), but ShardTensor calls a dispatch handler with the op's own "
                                         r"arguments \(self\)"):
        cl.patch("aten.diff.default", handler_from_source("def no_args():\n    pass\n"), kind="dispatch")
    with pytest.raises(PatchError, match=r"^kind must be"):
        cl.patch("torch.diff", handler_from_source(scaffold("torch.diff", "pointwise")), kind="both")
    with pytest.raises(PatchError, match=r"^torch.diff has no handler registered by cl.patch"):
        cl.unpatch("torch.diff")
    assert not any(cl.apply(api.patch_installed))
    assert cl.apply(api.patch_registry_state) == untouched


def test_a_handler_that_raises_on_some_ranks_only_is_named_and_taken_back(cl, untouched):
    with pytest.raises(PatchError) as caught:
        cl.check_patch("torch.nn.functional.silu", SILU, handler_from_source(RAISES_ON_RANK_1), inputs="pw_x",
                       outputs="pw_y", grads=False, repeat=1, before=False)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("the handler for torch.nn.functional.silu raised on rank 1 (it ran on ranks 0, 2, 3): "
                            "RuntimeError: rank 1 has no silu, at line 4 of the handler: "
                            "`raise RuntimeError(\"rank 1 has no silu\")`; the handler was taken back"), first
    assert not any(cl.apply(api.patch_installed))
    assert cl.broken is None
    assert cl.eval("pw_x._local_tensor.shape[2]") == [10, 10, 10, 10]


def test_a_type_error_a_handler_raises_inside_a_dunder_shows_the_handlers_own_line(cl, untouched):
    with pytest.raises(PatchError) as caught:
        cl.check_patch("Tensor.add", "pw_y = pw_x + pw_x", handler_from_source(ADD_TYPE_ERROR), inputs="pw_x",
                       outputs="pw_y", grads=False, repeat=1, before=False)
    text = str(caught.value)
    assert "this add handler takes no ShardTensor" in text.splitlines()[0], text
    assert "unsupported operand" not in text.splitlines()[0] and "TypeError: this add" in text.splitlines()[0]
    assert "at line 3 of the handler: `raise TypeError(\"this add handler takes no ShardTensor\")`" in text, text
    assert not any(cl.apply(api.patch_installed))


def test_shard_patch_magic_registers_the_cells_handler_by_value(cl, untouched):
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    with pytest.raises(UsageError, match="OP"):
        ip.run_cell_magic("shard_patch", "", scaffold("torch.nn.functional.silu", "pointwise"))
    ip.user_ns["SCALE"] = 1.0  # a notebook global the handler reads: it travels with it
    cell = scaffold("torch.nn.functional.silu", "pointwise").replace("out = func(local, *rest, **kwargs)",
                                                                     "out = func(local, *rest, **kwargs) * SCALE")
    record = ip.run_cell_magic("shard_patch", "torch.nn.functional.silu", cell)
    try:
        assert record.handler == "__main__.silu_handler" and callable(ip.user_ns["silu_handler"])
        assert _paths(cl.trace(SILU, display=False), record.op) == {r: ["function_handler"] for r in range(4)}
    finally:
        cl.unpatch(record.op)


def _calls(op, gin, gout, pl_in="(S(2),)", pl_out="(S(2),)"):
    """One forward fallback call of ``op`` as get_ops() has it (only the columns the classification reads)."""
    import pandas as pd

    return pd.DataFrame([{"rank": 0, "seq": 0, "op": op, "in_placements": [pl_in], "in_global_shapes": [gin],
                          "out_global_shape": gout, "placements": pl_out, "message": None, "exc_type": None}])


@pytest.mark.parametrize("op, gin, gout, pl_out, moved, family", [
    ("torch.amax", [1, 3, 40], [1, 3], "(P(max),)", ["all_reduce"], "reduction"),
    ("Tensor.flatten", [1, 3, 40], [1, 120], "(_S(1, 3),)", [], "view"),
    ("torch.cumsum", [1, 3, 40], [1, 3, 40], "(R,)", ["all_gather_into_tensor"], "global"),
    ("mylib.box3.default", [1, 3, 40], [1, 3, 38], "(R,)", ["all_gather_into_tensor"], "halo"),
    ("torch.nn.functional.gelu", [1, 3, 40], [1, 3, 40], "(S(2),)", [], "pointwise"),
    ("torch.outer_thing", [1, 3, 40], [7, 7], "(R,)", ["all_gather_into_tensor"], "none"),
], ids=["reduction", "view", "global", "halo", "pointwise", "none"])
def test_each_family_is_read_from_shapes_placements_and_what_moved(op, gin, gout, pl_out, moved, family):
    import pandas as pd

    from sharddbg.analysis.patch_families import classify_calls

    fit = classify_calls(op, _calls(op, gin, gout, pl_out=pl_out), pd.DataFrame({"kind": moved}))
    assert fit.family == family, fit
    assert fit.sharded_dim == 2
    assert (fit.halo_width == 1) if family == "halo" else fit.halo_width is None


CUSTOM_OP = """
import torch


@torch.library.custom_op("pwtest::softclip", mutates_args=())
def softclip(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softclip.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad / (1 + ctx.x.abs()) ** 2


softclip.register_autograd(_backward, setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))
"""


def test_a_custom_op_the_fallback_cannot_run_is_patched_and_checked(cl, untouched, tmp_path):
    # in a module, so that the unsharded reference of the check can import it too
    (tmp_path / "pwtest_softclip_ops.py").write_text(CUSTOM_OP)
    stmt = "from pwtest_softclip_ops import softclip\npw_y = softclip(pw_x)"
    cl.run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})", timeout=30)
    try:
        handler = handler_from_source(scaffold("pwtest.softclip.default", "pointwise"))
        r = cl.check_patch("pwtest.softclip.default", stmt, handler, inputs="pw_x", outputs="pw_y", repeat=1)
    finally:
        cl.run(f"sys.path.remove({str(tmp_path)!r})", timeout=30)
    assert r.ok and r.before is None, r.verdict
    assert r.before_error.startswith("without the handler 'pw_y = softclip(pw_x)' raised on every rank: "
                                     "NotImplementedError: Operator pwtest.softclip.default does not have a sharding "
                                     "strategy registered"), r.before_error
    assert r.verdict.startswith("patched: correct") and r.before_error in r.verdict
    assert r.after.paths == ("function_handler",) and r.after.collectives == ()
