"""``sharddbg.engine.scatter`` on a real 4-rank CPU cluster: every argument is checked on every rank before
any data moves, every rank raises the same ScatterError (quickly, not after a collective timeout), the
requires_grad flag is the same on every rank, and empty shards are refused.

The cluster's collective timeout is 300 s: a rank left waiting in a collective would make a call take
minutes, so "returns within 20 s" shows no rank was left behind.
"""

from __future__ import annotations

import time

import pytest

import sharddbg
from sharddbg.errors import RankError

pytestmark = pytest.mark.cluster

N = 4
FAST_S = 20.0  # far below the 300 s collective timeout
SAMPLE = "torch.randn(1, 3, 66, 64)"
ROWS = [66 // N + (1 if r < 66 % N else 0) for r in range(N)]  # 17, 17, 16, 16, computed here


def scatter_error(cl, code: str, ranks=tuple(range(N))) -> str:
    """Run ``code``; it must raise ScatterError on exactly ``ranks``, with one message on all of them,
    within FAST_S. Returns that message."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cl.run(code, timeout=60, display=False)
    elapsed = time.monotonic() - t0
    assert elapsed < FAST_S, f"took {elapsed:.1f} s: a rank was left waiting in a collective"
    errors = info.value.errors
    assert sorted(errors) == sorted(ranks), errors
    assert {f.type_name for f in errors.values()} == {"ScatterError"}, errors
    messages = {f.message for f in errors.values()}
    assert len(messages) == 1, messages  # the same text on every rank
    assert cl.eval("1", timeout=10) == [1] * N  # nobody is stuck: the cluster still answers
    return messages.pop()


# First in the file, so that it runs before the module's 4 x 1 cluster exists (one cluster at a time).
def test_a_bad_argument_on_one_rank_fails_its_domain_group_only_on_a_2x2_mesh():
    with sharddbg.Cluster(n=4, mesh={"ddp": 2, "domain": 2}, timeout=120, collective_timeout=300) as cl:
        message = scatter_error(cl, f"x = sharddbg.engine.scatter({SAMPLE}, dim='2' if rank == 3 else 2)", ranks=(2, 3))
        assert message == "sharddbg.engine.scatter: dim='2' is not an int or None (on rank 3)"
        # the other domain group scattered its sample over ranks 0 and 1 (33 rows each)
        assert cl.eval("tuple(x._local_tensor.shape)", targets=[0, 1]) == [(1, 3, 33, 64)] * 2


@pytest.fixture(scope="module")
def cl(patient_cluster4):
    """4 x 1 ranks whose collective timeout (300 s) no test waits out: a rank left hanging fails the test."""
    return patient_cluster4


BAD_ARGUMENTS = [
    # (arguments as the cell passes them, the whole message every rank raises)
    ("dim='2'", "dim='2' is not an int or None (on every rank)"),
    ("dim=2.0", "dim=2.0 is not an int or None (on every rank)"),
    ("dim=True", "dim=True is not an int or None (on every rank)"),
    ("dim=2, batch_dim='0'", "batch_dim='0' is not an int or None (on every rank)"),
    ("dim=2, replicate=1", "replicate=1 is not a bool (on every rank)"),
    ("dim=2, requires_grad='yes'", "requires_grad='yes' is not a bool (on every rank)"),
    # a bad argument on a rank other than the source: it used to pass the source's checks unseen
    ("dim='2' if rank == 2 else 2", "dim='2' is not an int or None (on rank 2)"),
    ("dim=2, batch_dim='0' if rank == 0 else 0", "batch_dim='0' is not an int or None (on rank 0)"),
    # ranks that disagree
    ("dim=3 if rank == 1 else 2",
     "rank 1 passed dim=3, the others dim=2 (every rank of the domain group must pass the same dim)"),
    ("dim=2, requires_grad=(rank == 0)", ("rank 0 passed requires_grad=True, the others requires_grad=False "
                                          "(every rank of the domain group must pass the same requires_grad)")),
    ("dim=rank % 2 + 2", ("ranks 1, 3 passed dim=3, the others dim=2 "
                          "(every rank of the domain group must pass the same dim)")),
    # what the source's tensor does not allow, decided alike on every rank
    ("dim=7", "dim=7 is out of range for a 4-d tensor of shape (1, 3, 66, 64)"),
    ("dim=0", "dim=0 is the batch axis; shard along a spatial axis"),
]


@pytest.mark.parametrize("arguments, expected", BAD_ARGUMENTS, ids=[a for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_raise_the_same_error_on_every_rank_quickly(cl, arguments, expected):
    message = scatter_error(cl, f"sharddbg.engine.scatter({SAMPLE}, {arguments})")
    assert message == f"sharddbg.engine.scatter: {expected}"


def test_several_problems_are_all_named(cl):
    message = scatter_error(cl, f"sharddbg.engine.scatter({SAMPLE}, dim=2.0, replicate='no' if rank == 3 else False)")
    assert message == ("sharddbg.engine.scatter: dim=2.0 is not an int or None (on every rank); "
                       "replicate='no' is not a bool (on rank 3)")


def test_source_without_a_tensor_is_refused_on_every_rank(cl):
    message = scatter_error(cl, "sharddbg.engine.scatter([1, 2, 3] if rank == 0 else None, dim=0, batch_dim=None)")
    assert message == "sharddbg.engine.scatter: the source rank 0 holds a list, not a torch.Tensor"


@pytest.mark.parametrize("rows, empty", [(3, "rank 3"), (1, "ranks 1, 2, 3"), (0, "ranks 0, 1, 2, 3")])
def test_fewer_rows_than_ranks_is_refused_before_any_op(cl, rows, empty):
    message = scatter_error(cl, f"e = sharddbg.engine.scatter(torch.randn({rows}, 5), dim=0, batch_dim=None)")
    assert message == (f"sharddbg.engine.scatter: dim=0: {rows} row{'' if rows == 1 else 's'} over 4 ranks would "
                       f"leave {empty} with no rows; ShardTensor ops fail on empty shards: use fewer domain "
                       f"ranks or a larger dim")


def test_as_many_rows_as_ranks_is_fine(cl):
    cl.run("e = sharddbg.engine.scatter(torch.arange(4.0).reshape(4, 1), dim=0, batch_dim=None)", display=False)
    assert cl.eval("e._local_tensor.flatten().tolist()") == [[0.0], [1.0], [2.0], [3.0]]


def test_valid_scatter_is_balanced_and_plain(cl):
    cl.run(f"torch.manual_seed(0)\nx_full = {SAMPLE}\nx = sharddbg.engine.scatter(x_full, dim=2)", display=False)
    shapes = cl.eval("(tuple(x._local_tensor.shape), [s[2] for s in x._spec._sharding_shapes[0]])")
    assert [local[2] for local, _ in shapes] == ROWS == [17, 17, 16, 16]
    assert all(declared == ROWS for _, declared in shapes)
    assert cl.eval("(x.requires_grad, x.is_leaf, bool((x.full_tensor() == x_full).all()))") == [(False, True, True)] * N


GRAD_CELL = """
torch.manual_seed(0)
x_full = torch.randn(1, 1, 66, 4, requires_grad={source_grad})
g = sharddbg.engine.scatter(x_full, {arguments})
flags = (g.requires_grad, g.is_leaf)
g.square().sum().backward()
grad_ok = g.grad is not None and bool(torch.allclose(g.grad.full_tensor(), 2 * x_full.detach()))
local_grad_shape = tuple(g.grad._local_tensor.shape)
source_grad_untouched = x_full.grad is None
"""


@pytest.mark.parametrize("source_grad, arguments", [
    (True, "dim=2"),  # the source's flag alone
    (False, "dim=2, requires_grad=True"),  # the argument alone
    (True, "replicate=True"),
])
def test_requires_grad_is_the_same_on_every_rank_and_backward_works(cl, source_grad, arguments):
    cl.run(GRAD_CELL.format(source_grad=source_grad, arguments=arguments), timeout=60, display=False)
    assert cl.pull("flags") == [(True, True)] * N  # a leaf that requires grad, on every rank
    assert cl.pull("grad_ok") == [True] * N  # d(sum x^2)/dx = 2x, gathered from every rank's shard
    expected_rows = [66] * N if "replicate" in arguments else ROWS
    assert [s[2] for s in cl.pull("local_grad_shape")] == expected_rows
    # the result is a leaf of its own: nothing flows back into the tensor the source passed in
    assert cl.pull("source_grad_untouched") == [True] * N



def test_an_empty_batch_is_refused_on_every_rank(cl):
    message = scatter_error(cl, "sharddbg.engine.scatter(torch.randn(0, 3, 66, 64), dim=2)")
    assert message == ("sharddbg.engine.scatter: the batch axis (dim 0) has size 0: there is no sample to scatter "
                       "(shape (0, 3, 66, 64)); pass batch_dim=None for inputs without a batch axis (point clouds)")
