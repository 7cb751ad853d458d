"""Start/stop/restart, hangs and recovery, orphans: checked by pid, on real processes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import sharddbg
from sharddbg.cluster import registry
from sharddbg.errors import ClusterError, RankTimeoutError

pytestmark = pytest.mark.cluster


def processes_of(cl) -> set[int]:
    """Every process of the cluster: fork server, controller, engines, and their children."""
    return {p.pid for p in cl.processes()}


def assert_all_gone(pids, within_s=5.0):
    deadline = time.monotonic() + within_s
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.05)
    assert not alive, f"processes left behind: {[(p, psutil.Process(p).cmdline()) for p in alive]}"


def test_2x2_mesh_scatters_per_domain_group_and_stops_clean():
    cl = sharddbg.Cluster(n=4, mesh="ddp=2,domain=2", timeout=60)
    cl.start()
    try:
        pids = processes_of(cl)
        assert pids >= set(cl.pids.values()) | {cl.fork_server_pid} and len(pids) >= 6  # + the controller
        cl.run("x = sharddbg.engine.scatter(torch.full((1, 1, 66, 4), float(rank)), dim=2)", display=False)
        assert [s[2] for s in cl.eval("tuple(x._local_tensor.shape)")] == [33, 33, 33, 33]
        # each domain group broadcasts from its own first rank: ranks 0,1 hold 0.0; ranks 2,3 hold 2.0
        assert cl.eval("x._local_tensor.mean().item()") == [0.0, 0.0, 2.0, 2.0]
        status = cl.status()
        assert list(status["ddp"]) == [0, 0, 1, 1] and list(status["domain"]) == [0, 1, 0, 1]
        assert cl.eval("tuple(mesh.mesh_dim_names), tuple(mesh.shape)") == [(("ddp", "domain"), (2, 2))] * 4
    finally:
        cl.stop()
    assert_all_gone(pids)
    assert not cl.running
    # start -> stop -> start works
    cl.start()
    try:
        assert cl.eval("dist.get_world_size()") == [4] * 4
        pids = processes_of(cl)
    finally:
        cl.stop()
    assert_all_gone(pids)


OWNER = """
import json, sys, time
import sharddbg
cl = sharddbg.Cluster(n=2)
cl.start()
print(json.dumps({"cluster_id": cl.cluster_id, "forkserver": cl.fork_server_pid,
                  "pids": sorted(p.pid for p in cl.processes())}), flush=True)
time.sleep(600)
"""


def start_owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    import json

    return proc, json.loads(line)


def test_killed_owner_leaves_nothing_behind_and_the_next_start_reaps_its_record():
    """A kernel killed with SIGKILL: its fork server notices and takes engines and controller down."""
    proc, info = start_owner()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert_all_gone(info["pids"], within_s=10)
    assert any(r.cluster_id == info["cluster_id"] for r in registry.all_records())
    with sharddbg.Cluster(n=1) as cl:  # the next start reaps what a dead owner left
        assert not any(r.cluster_id == info["cluster_id"] for r in registry.all_records())
        assert cl.eval("dist.get_world_size()") == [1]


RELATIVE_HOME_OWNER = """
import json, os, sys, time
import sharddbg
cl = sharddbg.Cluster(n=2)
os.chdir(sys.argv[1])  # a relative SHARDDBG_HOME still names the folder it named at import
cl.start()
print(json.dumps({"cluster_id": cl.cluster_id, "forkserver": cl.fork_server_pid, "engines": cl.pids,
                  "pids": sorted(p.pid for p in cl.processes())}), flush=True)
time.sleep(600)
"""


def test_owner_and_fork_server_killed_together_leave_nothing_running_and_stop_all_forgets_the_record(tmp_path):
    """Worst case: owner and fork server both SIGKILLed. The engines notice that the owner is gone and end the
    cluster (controller and its child included) without anyone reaping; the record stays for the next start or
    ``%shard_cluster stop --all``. The owner ran with a relative SHARDDBG_HOME and changed its working folder
    before the start; a temporary file a killed write left in the records' folder is pruned at the start."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    home = registry.sharddbg_home()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stale = registry.clusters_dir() / "sdbg-20000101-000000-stale0.json.tmp"
    stale.write_text('{"cluster_id": ')
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    env = dict(os.environ, SHARDDBG_HOME=os.path.relpath(home, home.parent))
    proc = subprocess.Popen([sys.executable, "-c", RELATIVE_HOME_OWNER, str(elsewhere)], stdout=subprocess.PIPE,
                            text=True, cwd=home.parent, env=env)
    try:
        info = json.loads(proc.stdout.readline())
        assert not stale.exists(), "a stale temporary record file is pruned at the start"
        assert not (elsewhere / env["SHARDDBG_HOME"]).exists(), "a second state folder after os.chdir"
        assert any(r.cluster_id == info["cluster_id"] for r in registry.all_records())
        os.kill(info["forkserver"], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert_all_gone(info["pids"], within_s=20)
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "stop --all")
    assert f"reaped cluster {info['cluster_id']} (0 processes)" in cap.stdout
    assert not any(r.cluster_id == info["cluster_id"] for r in registry.all_records())


def test_untested_versions_warn_once_and_clearly():
    import warnings

    from sharddbg.cluster import check_versions, tested_version
    from sharddbg.errors import ShardDbgWarning

    statuses = [{"torch": "2.14.1+cu130", "physicsnemo": "2.2.2"}, {"torch": "2.9.0", "physicsnemo": "2.3.0"}]
    warned = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        issued = check_versions(statuses, warned)
        assert check_versions(statuses, warned) == []  # a second cluster: no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, ShardDbgWarning)]
    assert messages == issued and len(messages) == 2
    assert "torch 2.9.0" in messages[0] and "still run" in messages[0] and "tested with torch 2.14.1 / 2.11" in messages[0]
    assert "physicsnemo 2.3.0" in messages[1]
    assert warned == {("torch", "2.9.0"), ("physicsnemo", "2.3.0")}
    assert tested_version("torch", "2.11.0+cu130") and tested_version("torch", "2.14.1")
    assert not tested_version("torch", "2.1") and not tested_version("torch", "2.110")


def interrupt_after(seconds: float) -> threading.Timer:
    """Ctrl-C for this process after ``seconds``, as a terminal or a kernel interrupt delivers it (SIGINT: the
    main thread, waiting for the ranks, raises KeyboardInterrupt)."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def wait_idle(cl, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while cl.busy_ranks():
        assert time.monotonic() < deadline, "the ranks did not finish the interrupted cell"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two_ranks():
    """A 2-rank cluster on a mesh whose domain axis has one rank, for the tests below, in this order: the skipped
    collective's test leaves it recovered (sound), the Ctrl-C test goes on with it and ends by stopping it (one
    start for the two). Yields a dict: "cluster", and "recovered_pids" (its processes after the recovery, which
    the Ctrl-C test checks are gone when it ends)."""
    cl = sharddbg.Cluster(n=2, mesh={"ddp": 2, "domain": 1}, timeout=60)
    cl.start()
    shared = {"cluster": cl, "recovered_pids": set()}
    try:
        yield shared
    finally:
        if cl.running:
            cl.stop()


def test_a_rank_that_skips_a_collective_is_diagnosed_and_recovered(two_ranks):
    # on a mesh whose domain axis has one rank (the all_reduce below is on the world group): that axis is still
    # named, and it stays so after recover()
    cl = two_ranks["cluster"]
    assert cl.eval("(tuple(mesh.mesh_dim_names), tuple(mesh.shape))") == [(("ddp", "domain"), (2, 1))] * 2
    pids_before = dict(cl.pids)
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        cl.run(textwrap.dedent("""
            def exchange(t):
                dist.all_reduce(t)
                return t
            if rank == 0:
                exchange(torch.ones(4))
        """), timeout=3, display=False)
    assert time.monotonic() - t0 < 3 + 5  # bounded: the timeout plus the diagnosis
    report = info.value.report
    assert report.finished == [1] and report.unfinished == [0]
    # every rank's control thread answered, the blocked one included
    assert sorted(report.diagnoses) == [0, 1]
    assert [report.diagnoses[r]["rank"] for r in (0, 1)] == [0, 1]
    assert report.diagnoses[0]["pid"] == pids_before[0]
    stuck = report.ranks[0]
    assert [f["function"] for f in stuck.user_frames()][-1] == "exchange"
    assert stuck.innermost_function() in ("all_reduce", "wait", "wrapper")
    [pending] = stuck.pending
    assert pending.kind == "all_reduce" and pending.input_sizes == [[4]]
    assert pending.missing_ranks == [1]
    text = str(info.value)
    assert "ranks [0] still running" in text and "never joined by: rank 1" in text and "exchange" in text
    # the kernel is usable; the group is desynchronised, so a new cell is refused with why, instead of
    # queueing forever behind the blocked rank
    with pytest.raises(ClusterError, match="The process group broke at the cell: ranks \\[0\\] were left waiting"):
        cl.run("1", display=False)
    cl.recover()
    assert cl.pids == pids_before
    assert [p for p in cl.status()["pid"]] == [pids_before[0], pids_before[1]]
    cl.run("t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)", display=False)
    assert cl.eval("t.tolist()") == [[3.0, 3.0, 3.0]] * 2
    assert cl.eval("(tuple(mesh.mesh_dim_names), tuple(mesh.shape))") == [(("ddp", "domain"), (2, 1))] * 2
    # left running for the next test, which stops it and checks then that these are gone
    two_ranks["recovered_pids"] = processes_of(cl)


def test_ctrl_c_a_dying_rank_a_dead_controller_and_a_stop_from_another_thread_are_said_at_once(two_ranks):
    from sharddbg.engine import api
    from sharddbg.errors import TraceInterrupted

    cl = two_ranks["cluster"]
    if not cl.running or cl.broken or cl.dead_ranks() or cl.busy_ranks():  # left unsound before: a fresh one
        if cl.running:
            cl.stop()
        cl.start()
    try:
        # Ctrl-C while cl.run waits: the ranks still run the cell, and the next call says so at once
        interrupt_after(2.0)
        with pytest.raises(KeyboardInterrupt):
            cl.run("import time; time.sleep(5)", display=False)
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=r"ranks \[0, 1\] are still running an earlier cell .*interrupted"):
            cl.run("print(rank)", timeout=30, display=False)
        assert time.monotonic() - t0 < 5, "the refusal must not wait for the earlier cell"
        wait_idle(cl)
        assert cl.eval("rank") == [0, 1]

        # Ctrl-C while cl.trace waits: what was recorded is kept, marked interrupted, and no recorder stays on
        interrupt_after(3.0)
        with pytest.raises(TraceInterrupted, match=r"interrupted \(Ctrl-C\).*cl\.last_trace\(\)") as info:
            cl.trace("dist.all_reduce(torch.ones(2))\nimport time; time.sleep(5)", display=False)
        trace = info.value.trace
        assert trace is cl.last_trace()
        assert trace.meta["interrupted"].startswith("the wait for the cell was interrupted (Ctrl-C) after")
        assert "ranks [0, 1] still ran it" in trace.meta["interrupted"]
        assert set(trace.incomplete_reasons) == {0, 1}
        assert sorted(trace.get_collectives()["rank"]) == [0, 1], "the all_reduce recorded before Ctrl-C is kept"
        wait_idle(cl)
        assert cl.apply(api.is_recording) == [False, False]
        assert len(cl.trace("dist.all_reduce(torch.ones(2))", display=False).get_collectives()) == 2

        # a rank killed mid-trace while the other runs on: the wait ends at once, naming it; the survivor's
        # recorder stops when its cell ends
        victim = cl.pids[1]
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as died:
            cl.trace("import os, time\nif rank == 1: os.kill(os.getpid(), 9)\nelse: time.sleep(6)", display=False)
        assert time.monotonic() - t0 < 10, "a dead rank must not cost the whole timeout"
        assert "rank 1" in str(died.value) and "SIGKILL" in str(died.value) and str(victim) in str(died.value)
        assert cl.dead_ranks() == {1: "killed by signal 9 (SIGKILL)"}
        wait_idle(cl)
        assert cl._execution.call(api.is_recording, ranks=[0], what="a look at the recorder") == [False]

        # the controller killed: diagnose() says so, instead of answering None for every rank (also when it is
        # asked before the controller's end shows)
        os.kill(cl.controller_pid, signal.SIGKILL)
        with pytest.raises(ClusterError, match=r"the controller \(pid \d+\) died.*cl\.restart\(\)"):
            cl.diagnose(0, timeout=2)
        cl.restart()
        assert cl.pids[1] != victim and cl.dead_ranks() == {}
        assert cl.eval("dist.get_world_size()") == [2, 2]

        # cl.stop() from another thread while a cell runs: the cell's wait says the cluster was stopped, and
        # a process the cell started goes with the engines
        cl.run("import subprocess; child = subprocess.Popen(['sleep', '600'])", display=False)
        children = set(cl.eval("child.pid"))
        assert all(psutil.pid_exists(pid) for pid in children)
        pids = processes_of(cl)
        threading.Timer(2.0, cl.stop).start()
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as stopped:
            cl.run("import time; time.sleep(30)", display=False)
        assert time.monotonic() - t0 < 20
        assert str(stopped.value).startswith("the cluster was stopped (by cl.stop()) while the cell ran"), stopped.value
        deadline = time.monotonic() + 20
        while cl.running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_all_gone(children | pids | two_ranks["recovered_pids"])
    finally:
        if cl.running:
            cl.stop()
