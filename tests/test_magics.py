"""The magics through IPython itself (run_line_magic / run_cell_magic), on a real cluster."""

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import sharddbg
from sharddbg.errors import ClusterError, MeshError, NoActiveClusterError
from sharddbg.magics import parse_targets, split_px_line

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ip():
    from sharddbg.cluster import running_clusters

    running_before = running_clusters()  # e.g. the session's shared cluster: not ours to stop
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sharddbg")
    yield shell
    for cl in running_clusters():
        if cl not in running_before:
            cl.stop()


def test_px_option_parsing():
    args, code = split_px_line("--timeout 5 -t 0,2 print(rank, '--timeout')")
    assert args.timeout == 5.0 and parse_targets(args.targets) == [0, 2]
    assert code == "print(rank, '--timeout')"
    assert parse_targets("1:3") == slice(1, 3) and parse_targets("1:3", 4) == [1, 2]
    assert parse_targets("2:", 4) == [2, 3] and parse_targets("::2", 4) == [0, 2]


def test_magic_errors_before_start(ip):
    with pytest.raises(NoActiveClusterError, match="nothing to stop"):
        ip.run_line_magic("shard_cluster", "stop")
    with pytest.raises(NoActiveClusterError, match="no sharddbg cluster is running"):
        ip.run_cell_magic("px", "", "print(1)")
    with pytest.raises(MeshError, match="has 8 ranks but the cluster has n=6"):
        ip.run_line_magic("shard_cluster", "start -n 6 --mesh ddp=4,domain=2")
    with pytest.raises(UsageError):
        ip.run_line_magic("shard_cluster", "launch")


def test_start_px_status_stop(ip):
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "start -n 4 --mesh ddp=1,domain=4")
    assert "4 ranks ready" in cap.stdout and "registered-by-sharddbg" in cap.stdout
    cl = sharddbg.active_cluster()
    with pytest.raises(ClusterError, match="already running"):
        ip.run_line_magic("shard_cluster", "start -n 4")
    with capture_output() as cap:
        ip.run_cell_magic("px", "", "torch.manual_seed(0)\n"
                          "x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)\n"
                          "w = torch.randn(4, 3, 3, 3)\n"
                          "y = torch.nn.functional.conv2d(x, w, padding=1)\n"
                          "print(tuple(y._local_tensor.shape))")
    assert cap.stdout.splitlines() == [f"[rank {r}] (1, 4, {h}, 64)" for r, h in enumerate([17, 17, 16, 16])]
    with capture_output() as cap:
        ip.run_line_magic("px", "-t 1 print('only', rank)")
    assert cap.stdout.strip() == "[rank 1] only 1"
    with capture_output() as cap:
        ip.run_cell_magic("shard_trace", "--max-events 1000", "z = torch.nn.functional.conv2d(x, w, padding=1).abs()")
    trace = sharddbg.last_trace()
    assert trace.ranks == [0, 1, 2, 3] and trace is cl.last_trace()
    ops = trace.get_ops()
    assert set(ops.loc[ops["op"].str.contains("conv2d"), "path"]) == {"function_handler"}
    assert f"recorded {len(ops)} op calls on 4 ranks" in cap.stdout and "DTensor fallback" in cap.stdout
    with pytest.raises(UsageError):
        ip.run_cell_magic("shard_trace", "--max-events lots", "pass")
    # a cell that fails is still traced and summarised, then its error is raised
    with capture_output() as cap, pytest.raises(sharddbg.errors.RankError, match="ValueError: boom"):
        ip.run_cell_magic("shard_trace", "", "z2 = torch.nn.functional.conv2d(x, w, padding=1)\nraise ValueError('boom')")
    failed = sharddbg.last_trace()
    assert failed is not trace and failed.meta["failed"].startswith("RankError: ranks [0, 1, 2, 3] raised ValueError: boom")
    assert "op calls on 4 ranks" in cap.stdout
    with capture_output() as cap:
        assert ip.run_line_magic("shard_cluster", "diagnose").unfinished == []
    assert cap.stdout.strip() == "every rank is idle"
    status = ip.run_line_magic("shard_cluster", "status")
    assert list(status.index) == [0, 1, 2, 3]
    assert set(status["patch_mode"]) == {"registered-by-sharddbg"}
    with pytest.raises(sharddbg.errors.RankTimeoutError, match="never joined by: rank"):
        ip.run_cell_magic("px", "--timeout 2", "if rank == 0:\n    dist.barrier()")
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "recover")
    assert "re-created" in cap.stdout
    pids = {p.pid for p in cl.processes()}
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "stop")
    assert "stopped 4 ranks" in cap.stdout
    import psutil

    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert sharddbg.active_cluster(required=False) is not cl  # a stopped cluster is never the active one
