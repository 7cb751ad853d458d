"""A real 4-rank CPU cluster: gloo, physicsnemo ShardTensor with its own patches, ipyparallel engines."""

import time

import numpy as np
import pytest
import torch

import sharddbg
from sharddbg.errors import ClusterError

pytestmark = pytest.mark.cluster

CONV_CELL = """
torch.manual_seed(0)
x_full = torch.randn(1, 3, 66, 64)
w = torch.randn(4, 3, 3, 3, requires_grad=True)
x = sharddbg.engine.scatter(x_full, dim=2)
y = F.conv2d(x, w, padding=1)
loss = y.square().mean()
loss.backward()
local_shape = tuple(x._local_tensor.shape)
y_full = y.full_tensor().detach().numpy()
w_grad = w.grad.detach().numpy()
"""


def reference():
    """The same computation in this process, on one device, unsharded."""
    torch.manual_seed(0)
    x_full = torch.randn(1, 3, 66, 64)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    y = torch.nn.functional.conv2d(x_full, w, padding=1)
    y.square().mean().backward()
    return y.detach().numpy(), w.grad.numpy()


def rel_err(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_uneven_scatter_gives_balanced_local_heights(cluster4):
    cluster4.run(CONV_CELL, display=False)
    heights = [shape[2] for shape in cluster4.pull("local_shape")]
    expected = [66 // 4 + (1 if r < 66 % 4 else 0) for r in range(4)]  # computed here, independently
    assert heights == expected == [17, 17, 16, 16]
    spec = cluster4.eval("(tuple(x._spec.tensor_meta.shape), x._spec._sharding_shapes[0])")
    for global_shape, shard_shapes in spec:
        assert global_shape == (1, 3, 66, 64)
        assert [s[2] for s in shard_shapes] == expected


def test_conv2d_forward_and_weight_gradient_match_single_process(cluster4):
    cluster4.run(CONV_CELL, display=False)
    y_ref, grad_ref = reference()
    for y_full, w_grad in zip(cluster4.pull("y_full"), cluster4.pull("w_grad")):
        assert y_full.shape == y_ref.shape
        assert rel_err(y_full, y_ref) <= 1e-5
        # physicsnemo already reduces plain weights' gradients over the domain mesh: equal, not 4x.
        assert rel_err(w_grad, grad_ref) <= 1e-5


def test_status_reports_every_rank(cluster4):
    brief = cluster4.status()
    assert len(brief.columns) <= 8 and {"pid", "state", "patch_mode"} <= set(brief.columns)
    status = cluster4.status(full=True)
    assert list(status.index) == [0, 1, 2, 3]
    assert list(status["domain"]) == [0, 1, 2, 3] and set(status["ddp"]) == {0}
    assert set(status["backend"]) == {"gloo"} and set(status["device"]) == {"cpu"}
    assert set(status["patch_mode"]) == {"registered-by-sharddbg"} and cluster4.patch_mode == "registered-by-sharddbg"
    assert (status["n_patches"] > 10).all()
    assert list(status["pid"]) == [cluster4.pids[r] for r in range(4)]
    assert list(status["engine_id"]) == cluster4.engine_ids
    assert set(status["physicsnemo"]) == {"2.2.2"}
    assert (status["dist_initialized"]).all()


def test_engines_keep_the_preloaded_stack_out_of_cyclic_collections(cluster4):
    """The objects the fork server's preload made (torch, physicsnemo, ipyparallel) are in the permanent
    generation the engines inherit: a full collection there walks only what the engine made since."""
    frozen, live = zip(*cluster4.eval("(__import__('gc').get_freeze_count(), len(__import__('gc').get_objects()))"))
    assert all(n > 100_000 for n in frozen), frozen  # torch alone is hundreds of thousands
    assert all(n < f for n, f in zip(live, frozen)), (live, frozen)


LOOKED_AT_THEN_WAITING = """
import time
t = torch.ones(2)
time.sleep(3)  # busy, in no collective
if rank == 0:
    dist.all_reduce(t)  # waits for the others
else:
    time.sleep(6)
    dist.all_reduce(t)
"""


def test_the_panel_looks_at_a_busy_rank_less_often_until_it_waits_in_a_collective(cluster4, monkeypatch):
    """A look reads the rank's Flight Recorder (2,000 entries as JSON): a busy rank in no collective is looked at
    after doubling gaps, one waiting in a collective every STUCK_AFTER_S, and the one that waits is named stuck,
    with the ranks that never joined it."""
    import threading

    from sharddbg.cluster import state_file

    monkeypatch.setattr(state_file, "STUCK_AFTER_S", 0.5)
    looks: list[tuple[float, tuple[int, ...]]] = []
    control = cluster4._control
    real_diagnose = control.diagnose

    def diagnose(ranks, *args, **kwargs):  # the real call, its time and ranks noted when the test's writer asks
        ranks = list(ranks)
        if threading.current_thread() is threading.main_thread():
            looks.append((time.monotonic() - t0, tuple(ranks)))
        return real_diagnose(ranks, *args, **kwargs)

    monkeypatch.setattr(control, "diagnose", diagnose)
    writer = state_file.StateFileWriter(cluster4)
    t0 = time.monotonic()
    pending = cluster4.submit(LOOKED_AT_THEN_WAITING, timeout=60)
    stuck_at = None
    try:
        while time.monotonic() - t0 < 8.0:
            stuck = writer._find_stuck()
            if stuck and stuck_at is None:
                stuck_at = time.monotonic() - t0
                assert sorted(stuck) == [0] and stuck[0].collective == "all_reduce", stuck
                assert stuck[0].missing_ranks == [1, 2, 3], stuck[0]
            time.sleep(0.05)
    finally:
        pending.get()  # every rank joins the all_reduce after 9 s: the cell ends by itself
    asked = {r: [t for t, ranks in looks if r in ranks] for r in range(4)}
    assert stuck_at is not None and 3.0 < stuck_at < 6.5, (stuck_at, asked)
    # every 0.5 s would be 15 looks at each rank: doubling gaps (0.5, then 1, 2, 4 s) make 4 at most
    assert all(1 <= len(asked[r]) <= 4 for r in (1, 2, 3)), asked
    # the waiting rank: looked at again about every STUCK_AFTER_S once it was found waiting
    after = [t for t in asked[0] if t >= stuck_at - 0.01]
    assert len(after) >= 3 and max(b - a for a, b in zip(after, after[1:])) < 1.5, asked[0]
    assert cluster4.eval("t.tolist()") == [[4.0, 4.0]] * 4


def test_patches_really_registered_on_cpu(cluster4):
    # conv2d must take physicsnemo's halo handler, not the (silently wrong on CPU) fallback
    found = cluster4.eval("torch.nn.functional.conv2d in ShardTensor._function_registry")
    assert found == [True] * 4


BATCH_CELL = """
torch.manual_seed(3)
bx_full = torch.randn(2, 3, 66, 5)
bx = sharddbg.engine.scatter(bx_full, dim=2)
"""


def test_batch_of_two_is_sharded_like_one_sample_with_a_warning_once(cluster4):
    outs = cluster4.run(BATCH_CELL, display=False)
    # every rank says once what a batch of 2 per domain group costs and risks, pointing at the doctor
    for out in outs:
        assert "BatchPerDomainGroupWarning: sharddbg.engine.scatter: a batch of 2 per domain group (dim 0 of " \
               "shape (2, 3, 66, 5)), sharded along dim 2 like one sample. It costs 2 times the memory" in out.stderr
        assert "mixes the samples" in out.stderr and "cl.doctor()" in out.stderr, out.stderr
    # each rank holds its rows of both samples, 66 rows split 17, 17, 16, 16; the whole is the input
    assert cluster4.eval("tuple(bx._local_tensor.shape)") == [(2, 3, 17, 5), (2, 3, 17, 5), (2, 3, 16, 5),
                                                              (2, 3, 16, 5)]
    assert cluster4.eval("[s[2] for s in bx._spec._sharding_shapes[0]]") == [[17, 17, 16, 16]] * 4
    assert cluster4.eval("bool((bx.full_tensor() == bx_full).all())") == [True] * 4
    # the rows of each sample are the input's own: rank 2 holds rows 34..49 of both
    assert cluster4.eval("bool((bx._local_tensor == bx_full[:, :, 34:50]).all())", targets=[2]) == [True]
    # the same shape again: nothing more is said
    assert all("BatchPerDomainGroupWarning" not in out.stderr for out in cluster4.run(BATCH_CELL, display=False))


def test_scatter_without_batch_axis_and_replicate(cluster4):
    cluster4.run("p = sharddbg.engine.scatter(torch.arange(10.0).reshape(10, 1), dim=0, batch_dim=None)\n"
                 "r = sharddbg.engine.scatter(torch.ones(1, 5), replicate=True)", display=False)
    assert [s[0] for s in cluster4.eval("tuple(p._local_tensor.shape)")] == [3, 3, 2, 2]
    assert cluster4.eval("(tuple(r._local_tensor.shape), str(r._spec.placements[0]))") == [((1, 5), "R")] * 4


def test_source_rank_tensor_is_the_one_that_counts(cluster4):
    # every rank passes a different tensor; the result must be rank 0's
    cluster4.run("s = sharddbg.engine.scatter(torch.full((1, 8), float(rank)), dim=1)", display=False)
    assert cluster4.eval("s.full_tensor().sum().item()") == [0.0] * 4


def test_double_start_and_bad_targets_are_clear_errors(cluster4):
    with pytest.raises(ClusterError, match="already running"):
        cluster4.start()
    with pytest.raises(ClusterError, match="ranks \\[7\\] do not exist"):
        cluster4.run("1", targets=[7])


def test_stop_without_start_is_a_clear_error():
    with pytest.raises(ClusterError, match="not running"):
        sharddbg.Cluster(n=2).stop()


def test_cluster_output_is_per_rank_and_in_rank_order(cluster4, capsys):
    cluster4.run("print('hello from', rank)")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[rank {r}] hello from {r}" for r in range(4)]


def test_active_cluster_is_the_last_started_that_still_runs(cluster4):
    from sharddbg.cluster import running_clusters

    assert sharddbg.active_cluster() is cluster4
    with sharddbg.Cluster(n=1) as other:
        assert sharddbg.active_cluster() is other
        assert running_clusters()[-2:] == [cluster4, other]
    assert sharddbg.active_cluster() is cluster4  # back to the one still running
    assert other not in running_clusters() and not other.running


def test_everything_listens_on_loopback_only(cluster4):
    import ipaddress

    procs = cluster4.processes()
    # fork server, controller, 4 engines (and the controller's children, if any)
    assert {p.pid for p in procs} >= set(cluster4.pids.values()) | {cluster4.fork_server_pid}
    assert len(procs) >= 6
    listening = [(p.pid, c.laddr) for p in procs for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
    assert listening, "expected the controller, the store and gloo to listen somewhere"
    exposed = [(pid, addr) for pid, addr in listening if not ipaddress.ip_address(addr.ip).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
