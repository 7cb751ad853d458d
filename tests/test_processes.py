"""The processes behind a cluster never outlive their owner, a dead controller is named, the state folder is
private, old logs are pruned, and the fork server leaves CUDA uninitialised: on real processes, by pid."""

import glob
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import sharddbg
from sharddbg.cluster import registry
from sharddbg.cluster.processes import ClusterProcesses
from sharddbg.errors import RankError

START_TIMEOUT = 180.0


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def named_by_cmdline(cluster_id: str) -> set[int]:
    """Running processes whose command line names the cluster id (found without sharddbg's own scan)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if any(cluster_id in arg for arg in proc.info["cmdline"] or []) and running(proc.pid):
            found.add(proc.pid)
    return found


def in_group(group: int) -> set[int]:
    found = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == group and running(proc.pid):
                found.add(proc.pid)
        except OSError:
            continue
    return found


def assert_all_gone(pids, cluster_id: str | None = None, within_s: float = 5.0) -> None:
    """None of ``pids`` runs, nor any process naming ``cluster_id``, within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        alive = {pid for pid in pids if running(pid)} | (named_by_cmdline(cluster_id) if cluster_id else set())
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"processes left behind: {[(p, psutil.Process(p).cmdline()) for p in alive if running(p)]}"


def wait_for(condition, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def record_of(cluster_id: str) -> registry.ClusterRecord:
    return registry.ClusterRecord.load(registry.clusters_dir() / f"{cluster_id}.json")


def refs(record: registry.ClusterRecord, role: str) -> list[registry.ProcessRef]:
    return [ref for ref in record.processes if ref.role == role]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def fresh_home(tmp_path, monkeypatch) -> Path:
    """A state folder of this test's own: records, logs and reaping see nothing of other clusters."""
    home = tmp_path / "sharddbg-home"
    monkeypatch.setenv("SHARDDBG_HOME", str(home))
    return home


OWNER = """
import sharddbg, time
cl = sharddbg.Cluster(n=2)
cl.start()
print("started", flush=True)
time.sleep(600)
"""


def owner_records(owner_pid: int) -> list[registry.ClusterRecord]:
    return [r for r in registry.all_records() if r.owner.pid == owner_pid]


@pytest.mark.cluster
def test_an_owner_killed_during_the_start_leaves_no_controller_behind(fresh_home):
    t0 = time.monotonic()
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        # The record names the controller (and its process group) long before start() returns.
        [record] = wait_for(lambda: [r for r in owner_records(owner.pid) if refs(r, "controller")], 30,
                            "the record to name the controller")
        [controller] = refs(record, "controller")
        assert controller.process_group == controller.pid
        # ~1 s into the start, once the controller has its child (the heart monitor)
        wait_for(lambda: running(controller.pid) and psutil.Process(controller.pid).children(), 10,
                 "the controller's child")
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
        children = {c.pid for c in psutil.Process(controller.pid).children(recursive=True)}
        record = record_of(record.cluster_id)
        assert not refs(record, "engine"), "the start should still be importing (no engine forked yet)"
        assert owner.poll() is None
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert children
    recorded = {ref.pid for ref in record.processes}
    assert {controller.pid} | {ref.pid for ref in refs(record, "zygote")} <= recorded
    assert_all_gone(recorded | children, record.cluster_id, within_s=5)
    assert not in_group(controller.process_group)
    # the record is left for the next start's reaping, which finds nothing to kill
    assert registry.reap_orphans() == {record.cluster_id: []}


@pytest.mark.cluster
def test_a_killed_controller_is_named_the_engines_restart_and_stop_leaves_nothing(fresh_home):
    procs = ClusterProcesses(threads_per_rank=1, requested_backend=None, extra_env={}, timings={})
    seen: set[int] = set()
    client = None
    try:
        procs.start(START_TIMEOUT)
        client = procs.launch_engines(2, START_TIMEOUT)
        assert len(client.ids) == 2
        controller = procs.controller_pid
        children = {c.pid for c in psutil.Process(controller).children(recursive=True)}
        assert children, "the controller's heart monitor"
        seen = {p.pid for p in procs.live()}
        assert {controller, procs.fork_server_pid, *procs.pids.values(), *children} <= seen
        record = record_of(procs.cluster_id)
        assert children <= {ref.pid for ref in refs(record, "controller-child")}
        assert [ref.process_group for ref in refs(record, "controller")] == [controller]

        # cheap while it runs: no message to anyone (100 calls well under 0.5 s; the best of three rounds, so
        # that a round this process spent waiting for a core on a loaded host does not count)
        def hundred_calls_s() -> float:
            t0 = time.perf_counter()
            assert all(procs.controller_failure() is None for _ in range(100))
            return time.perf_counter() - t0

        assert min(hundred_calls_s() for _ in range(3)) < 0.5

        os.kill(controller, signal.SIGKILL)
        failure = wait_for(procs.controller_failure, 5, "the controller's death to be noticed")
        assert failure == f"the controller (pid {controller}) died: killed by signal 9 (SIGKILL)"
        assert_all_gone(children, within_s=5)  # its process group went with it

        # rebuilt from that state: new controller (same fork server), new engines
        client.close()
        client = None
        fork_server = procs.fork_server_pid
        procs.replace_engines()
        assert procs.controller_failure() is None and procs.controller_pid not in (None, controller)
        client = procs.launch_engines(2, START_TIMEOUT)
        assert len(client.ids) == 2 and procs.fork_server_pid == fork_server
        assert not procs.dead_ranks()
        seen |= {p.pid for p in procs.live()}

        # killed again, then stopped: nothing of the cluster is left, the controller's children included
        second = procs.controller_pid
        second_children = {c.pid for c in psutil.Process(second).children(recursive=True)}
        seen |= second_children
        os.kill(second, signal.SIGKILL)
        wait_for(procs.controller_failure, 5, "the second controller's death")
    finally:
        if client is not None:
            client.close()
        procs.stop()
    assert_all_gone(seen, procs.cluster_id)
    assert not (registry.clusters_dir() / f"{procs.cluster_id}.json").exists()
    assert not list((registry.profile_dir() / "security").glob(f"*{procs.cluster_id}*"))


@pytest.mark.cluster
def test_reap_all_stops_an_orphan_whose_fork_server_and_controller_were_killed(fresh_home):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "started"
        [record] = owner_records(owner.pid)
        [zygote] = refs(record, "zygote")
        [controller] = refs(record, "controller")
        engines = {ref.pid for ref in refs(record, "engine")}
        children = {c.pid for c in psutil.Process(controller.pid).children(recursive=True)}
        assert len(engines) == 2 and children
        # Worst case: fork server, then controller, then the engines (which would end the rest once the owner
        # is gone), then owner SIGKILLed; nothing ended the controller's child.
        os.kill(zygote.pid, signal.SIGKILL)
        wait_for(lambda: not running(zygote.pid), 5, "the fork server to die")
        os.kill(controller.pid, signal.SIGKILL)
        wait_for(lambda: not running(controller.pid), 5, "the controller to die")
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    time.sleep(0.5)
    survivors = {pid for pid in engines | children if running(pid)}
    assert children <= survivors, "the controller's child outlives it until reaped"
    out = subprocess.run([sys.executable, "-m", "sharddbg.cli", "reap", "--all"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert f"reaped 1 cluster(s): ['{record.cluster_id}']" in out.stdout
    [killed] = [line for line in out.stdout.splitlines() if line.strip().startswith(f"{record.cluster_id}:")]
    assert int(killed.split(":")[1].split()[0]) >= len(children)
    assert_all_gone(survivors, record.cluster_id)
    assert not registry.all_records()


def make_log_folder(home: Path, cluster_id: str, age_s: float, file_mode: int = 0o644) -> Path:
    folder = home / "logs" / cluster_id
    folder.mkdir(parents=True)
    log = folder / "engine-rank0.log"
    log.write_text("old\n")
    os.chmod(log, file_mode)
    os.chmod(folder, 0o755)
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_log_pruning_keeps_the_newest_ten_and_never_a_running_clusters(fresh_home):
    ids = [f"sdbg-20000101-0000{i:02d}-old{i:03d}" for i in range(15)]
    for age, cluster_id in enumerate(ids):  # ids[0] is the newest
        make_log_folder(fresh_home, cluster_id, age_s=3600 + 60 * age)
    (fresh_home / "logs" / "not-a-cluster").mkdir()
    # the oldest folder belongs to a cluster that still runs: its owner (this process) is alive
    running_record = registry.ClusterRecord(cluster_id=ids[-1], owner=registry.ProcessRef.of(os.getpid(), "owner"),
                                            log_dir=str(fresh_home / "logs" / ids[-1]))
    running_record.save()
    try:
        removed = registry.prune_logs()
        assert sorted(p.name for p in removed) == sorted(ids[10:14])
        left = sorted(p.name for p in (fresh_home / "logs").iterdir())
        assert left == sorted(ids[:10] + [ids[-1], "not-a-cluster"])
        assert registry.prune_logs() == []
    finally:
        running_record.remove()


@pytest.mark.cluster
@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a CPU host's CUDA answer")
def test_private_state_pruned_logs_untouched_cuda_and_a_restart_after_the_controller_died(fresh_home):
    # An existing state folder with the modes an older sharddbg left, and twelve old clusters' logs.
    old = [make_log_folder(fresh_home, f"sdbg-20000101-0000{i:02d}-old{i:03d}", age_s=3600 + 60 * i)
           for i in range(12)]
    (fresh_home / "clusters").mkdir()
    for path in (fresh_home, fresh_home / "clusters", fresh_home / "logs"):
        os.chmod(path, 0o755)
    cl = sharddbg.Cluster(n=2, mesh={"ddp": 1, "domain": 2})
    cl.start()
    seen: set[int] = set()
    try:
        seen = {p.pid for p in cl.processes()}
        # logs of the last 10 clusters: this one and the 9 newest old ones
        logs = sorted(p.name for p in (fresh_home / "logs").iterdir())
        assert logs == sorted([cl.cluster_id] + [p.name for p in old[:9]])
        # private: folders 0700, files 0600 (records, fork server's, controller's and engines' logs, dumps)
        assert Path(cl.log_dir) == fresh_home / "logs" / cl.cluster_id
        folders = [fresh_home, fresh_home / "clusters", fresh_home / "logs", Path(cl.log_dir),
                   fresh_home / "profile_sharddbg", fresh_home / "profile_sharddbg" / "security"]
        assert {str(p): oct(mode(p)) for p in folders} == {str(p): oct(0o700) for p in folders}
        names = {p.name for p in Path(cl.log_dir).iterdir()}
        assert {"forkserver.log", "controller.log", "engine-rank0.log", "engine-rank1.log", "stack-rank0.txt",
                "stack-rank1.txt"} <= names
        files = [p for p in fresh_home.rglob("*") if p.is_file()]
        assert f"{cl.cluster_id}.json" in {p.name for p in files}
        assert {str(p): oct(mode(p)) for p in files} == {str(p): oct(0o600) for p in files}
        assert mode(old[0] / "engine-rank0.log") == 0o600  # an existing file's mode fixed too

        # CUDA: never initialised in the fork server, so an engine gets torch's own answer on this host
        assert cl.facts["cuda_initialized"] is False and cl.facts["cuda_initialized_at_fork"] is False
        assert cl.eval("torch._C._cuda_isInBadFork()") == [False, False]
        with pytest.raises(RankError, match="Found no NVIDIA driver on your system"):
            cl.run("torch.zeros(1, device='cuda')", display=False)

        # restart() rebuilds after the controller died: new controller and engines, same fork server
        [controller] = [ref for ref in refs(record_of(cl.cluster_id), "controller") if ref.alive()]
        fork_server, engines = cl.fork_server_pid, dict(cl.pids)
        os.kill(controller.pid, signal.SIGKILL)
        wait_for(lambda: not running(controller.pid), 5, "the controller to die")
        cl.restart()
        assert cl.fork_server_pid == fork_server and set(cl.pids.values()).isdisjoint(engines.values())
        assert cl.eval("dist.get_world_size()") == [2, 2]
        assert cl.facts["cuda_initialized_at_fork"] is False
        now = {p.pid for p in cl.processes()}
        assert controller.pid not in now and fork_server in now
        seen |= now
    finally:
        cl.stop()
    assert_all_gone(seen, cl.cluster_id)
    assert not (fresh_home / "clusters" / f"{cl.cluster_id}.json").exists()


def test_the_gpu_count_probe_runs_beside_the_imports_and_never_blocks_past_its_time():
    """On a GPU host the fork server asks a fresh process for the GPU count while it imports torch itself:
    the answer is read after the imports; a probe that fails answers 0, one that hangs is killed at its limit."""
    from sharddbg.cluster._zygote import GpuCountProbe

    slow = GpuCountProbe("import time; time.sleep(1.0); print(2)")
    also = GpuCountProbe("import time; time.sleep(1.0); print(3)")
    # started, not waited for: both still run while this process goes on with its own imports
    assert slow.proc.poll() is None and also.proc.poll() is None
    assert (slow.result(), also.result()) == (2, 3)
    assert slow.seconds >= 1.0
    # its own time, not the time it was read: one that answered at once and was read a second later
    quick = GpuCountProbe("print(1)")
    time.sleep(1.5)
    assert quick.result() == 1 and quick.seconds < 1.0
    assert GpuCountProbe("raise SystemExit(1)").result() == 0
    assert GpuCountProbe("print('no number')").result() == 0
    hung = GpuCountProbe("import time; time.sleep(60)", timeout=0.5)
    t1 = time.perf_counter()
    assert hung.result() == 0 and time.perf_counter() - t1 < 5
    assert hung.proc.poll() is not None  # killed and reaped


FULL_DISK_WRITE = """
import os, resource, signal
from sharddbg.cluster import registry
record = registry.ClusterRecord(cluster_id="sdbg-20000101-000000-full00",
                                owner=registry.ProcessRef.of(os.getpid(), "owner"), log_dir="")
record.processes = [registry.ProcessRef(1, 0.0, "engine")] * 500
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    record.save()
except OSError as exc:
    print("failed", exc.errno)
"""


def test_a_record_write_that_fails_for_want_of_space_leaves_no_temporary_file(fresh_home):
    out = subprocess.run([sys.executable, "-c", FULL_DISK_WRITE], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.stdout.split() == ["failed", "27"], out.stderr  # EFBIG
    assert os.listdir(registry.clusters_dir()) == []
