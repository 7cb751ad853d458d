"""A cluster that outlives the notebook kernel: started from a terminal (`sharddbg cluster start`), owned by its
keeper process, connected to from a real Jupyter kernel, reconnected after the kernel restarts, stopped from the
terminal; and the refusals of bad input, before anything starts."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

import sharddbg
from sharddbg.cluster import detached, registry
from sharddbg.errors import ClusterError

pytestmark = pytest.mark.cluster


def cli(*args, timeout=300):
    """``python -m sharddbg.cli ARGS`` in a terminal-like subprocess; its completed process."""
    return subprocess.run([sys.executable, "-m", "sharddbg.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def run_in_kernel(kc, code, timeout=120) -> str:
    """Execute ``code`` in the kernel; its printed output (an error fails the test with the kernel's traceback)."""
    out, errors = [], []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            errors.append("\n".join(content["traceback"]))
        elif kind in ("execute_result", "display_data"):
            out.append(content["data"].get("text/plain", ""))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out) + "\n".join(errors)
    return "".join(out)


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def test_detached_cluster_outlives_a_kernel_restart(cluster4, capsys):
    """One detached 2-rank cluster: started from a terminal, listed beside a process-owned cluster, left alone by
    `sharddbg reap`, connected to from a Jupyter kernel that defines a variable, traces and breaks the process
    group; the kernel is killed and restarted and reconnects: the variable, the trace, the broken group and the
    mesh are read back; then stopped from the terminal with no process left."""
    from jupyter_client import KernelManager

    from sharddbg.cli import main as cli_main

    name = f"t{os.getpid()}"
    started = cli("cluster", "start", "-n", "2", "--mesh", "ddp=1,domain=2", "--name", name, "--collective-timeout", "3",
                  "--idle-timeout", "600", "--force")
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"cluster '{name}' is up in" in started.stdout and "2 ranks, mesh ddp=1,domain=2, backend gloo" in started.stdout
    assert f"sharddbg.Cluster.connect('{name}')" in started.stdout
    record = detached.read_record(name)
    keeper = psutil.Process(record.keeper_pid)
    km = None
    try:
        assert keeper.ppid() != os.getpid() and os.getsid(keeper.pid) == keeper.pid  # its own session, not ours
        sock = detached.socket_path(name)
        for private in (sock, record.path, detached.keeper_log_path(name), detached.client_file(record.cluster_id)):
            assert oct(os.stat(private).st_mode & 0o777) == "0o600", private
        cluster_pids = {p.pid for p in detached.live_processes(record.cluster_id, keeper.pid, keeper.create_time())}
        assert len(cluster_pids) >= 5  # keeper, fork server, controller, 2 engines

        # the command line's entry point in this process from here on (a new Python costs seconds here)
        # a name in use is refused before anything starts
        assert cli_main(["cluster", "start", "-n", "2", "--name", name, "--force"]) == 1
        assert f"a cluster named '{name}' runs already (keeper pid {keeper.pid}" in capsys.readouterr().err
        # listed, with the cluster this test process owns
        assert cli_main(["cluster", "list"]) == 0
        listing = capsys.readouterr().out
        rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
        assert rows[name].split()[1] == "detached" and f"keeper pid {keeper.pid}" in rows[name], listing
        assert "ddp=1,domain=2" in rows[name] and "running, idle " in rows[name] and "/600 s" in rows[name], listing
        assert rows[cluster4.cluster_id].split()[1] == "notebook" and f"pid {os.getpid()}" in rows[cluster4.cluster_id]
        # reap leaves it alone: its keeper is its owner, and runs
        assert cli_main(["reap"]) == 0
        reaped = capsys.readouterr().out
        assert record.cluster_id not in reaped.split("left alone")[0] and record.cluster_id in reaped, reaped
        assert all(psutil.pid_exists(pid) for pid in cluster_pids)
        with pytest.raises(ClusterError, match=rf"^no detached cluster is named 'nope' \(running: .*{name}"):
            sharddbg.Cluster.connect("nope")

        km = KernelManager(kernel_name="python3")
        km.start_kernel(env=os.environ.copy())
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        first = last_json(run_in_kernel(kc, f"""
import json, sys, time, sharddbg
t0 = time.perf_counter()
cl = sharddbg.Cluster.connect({name!r})
took = time.perf_counter() - t0
cl.run("secret = 1234 + rank", display=False)
trace = cl.trace("z = sharddbg.engine.scatter(torch.ones(1, 4), dim=1) * 2", display=False)
try:
    cl.run("if rank == 0: dist.all_reduce(torch.ones(1))", display=False)
except Exception as exc:
    failed = type(exc).__name__
print(json.dumps(dict(took=took, events=sum(len(p["events"]) for p in trace.payloads.values() if p),
                      broken=cl.broken, failed=failed, pids=cl.pids, torch_imported="torch" in sys.modules)))
"""))
        assert first["broken"] and first["failed"] == "RankError" and first["events"] > 0, first
        # the kernel ran, traced and failed a cell without importing torch (seconds of import; a Ctrl-C meant for the
        # wait would land inside it)
        assert not first["torch_imported"], first

        km.restart_kernel(now=True)  # killed, as a crashed kernel is
        kc.wait_for_ready(timeout=120)
        again = last_json(run_in_kernel(kc, """
import json, time
t0 = time.perf_counter()
import sharddbg
%load_ext sharddbg
%shard_cluster connect """ + name + """
took = time.perf_counter() - t0
cl = sharddbg.cluster.active_cluster()
seen = dict(took=took, connect_s=cl.timings["connect_s"], broken=cl.broken, mesh=str(cl.mesh), backend=cl.backend,
            patch_mode=cl.patch_mode, n=cl.n, pids=cl.pids,
            events=sum(len(p["events"]) for p in cl.last_trace().payloads.values() if p))
cl.recover()
seen["secret"] = cl.eval("secret")
seen["broken_after_recover"] = cl.broken
cl.disconnect()
print(json.dumps(seen))
"""))
        with capsys.disabled():  # the figures the documentation quotes; shown with -s
            print(f"\nconnect: first {first['took']:.2f} s; after the kernel restart {again['connect_s']:.2f} s "
                  f"(with importing sharddbg: {again['took']:.2f} s)")
        assert again["secret"] == [1234, 1235] and again["pids"] == first["pids"]
        assert again["broken"] == first["broken"] and again["broken_after_recover"] is None
        assert (again["mesh"], again["backend"], again["n"]) == ("ddp=1,domain=2", "gloo", 2)
        assert again["patch_mode"] == cluster4.patch_mode and again["events"] == first["events"]
        assert again["connect_s"] < 10  # about 0.5 s here; a generous bound on a loaded machine
    finally:
        if km is not None:
            km.shutdown_kernel(now=True)
        stopped = cli("cluster", "stop", name)
    assert stopped.returncode == 0 and f"stopped cluster '{name}'" in stopped.stdout, stopped.stdout + stopped.stderr
    assert "no process of it is left" in stopped.stdout
    assert not [pid for pid in cluster_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not registry.cluster_processes(record.cluster_id) and not sock.exists()
    with pytest.raises(ClusterError, match=rf"^the cluster '{name}' stopped at .* \(stopped by `sharddbg cluster stop`\); "
                                           rf"start it again in a terminal: `sharddbg cluster start -n 2 --name {name}`"):
        sharddbg.Cluster.connect(name)
    gone = cli("cluster", "stop", name)
    assert gone.returncode == 1 and f"no running detached cluster is named '{name}'" in gone.stderr


def test_detached_bad_input_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Connect to a name that does not exist, to another user's cluster, to a stopped one, with no name among
    none or several; start with a name in use or a bad one; stop an unknown name: one sentence each, with the fix."""
    from sharddbg.cli import main as cli_main

    monkeypatch.setenv("SHARDDBG_HOME", str(tmp_path / "home"))
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}

    def record(name, **fields):
        rec = detached.DetachedRecord(name=name, keeper_pid=me.pid, keeper_create_time=me.create_time(),
                                      uid=os.getuid(), state="running", n=2, **fields)
        rec.save()
        return rec

    with pytest.raises(ClusterError, match=r"^no detached sharddbg cluster runs for this user; start one in a "
                                           r"terminal: `sharddbg cluster start -n 4 --name NAME`"):
        sharddbg.Cluster.connect()
    with pytest.raises(ClusterError, match=r"^no detached cluster is named 'dev' \(none runs \(start one"):
        sharddbg.Cluster.connect("dev")
    with pytest.raises(ClusterError, match=r"^'a b' cannot name a cluster: use letters, digits"):
        sharddbg.Cluster.connect("a b")
    detached.DetachedRecord(name="theirs", keeper_pid=1, keeper_create_time=0.0, uid=os.getuid() + 1,
                            state="running").save()
    with pytest.raises(ClusterError, match=rf"^the cluster 'theirs' belongs to another user \(uid {os.getuid() + 1}; "
                                           rf"you are uid {os.getuid()}\)"):
        sharddbg.Cluster.connect("theirs")
    record("old", stopped_at=time.time(), stop_reason="stopped after 60 s without work on any engine (--idle-timeout)")
    rec = detached.read_record("old")
    rec.state = "stopped"
    rec.save()
    with pytest.raises(ClusterError, match=r"^the cluster 'old' stopped at .* \(stopped after 60 s without work .*\); "
                                           r"start it again in a terminal: `sharddbg cluster start -n 2 --name old`"):
        sharddbg.Cluster.connect("old")
    # a record whose keeper is this (live) process stands for a running cluster
    record("busy")
    record("other")
    with pytest.raises(ClusterError, match=r"^2 detached clusters run \(busy, other\); name one: "
                                           r"Cluster.connect\('busy'\)"):
        sharddbg.Cluster.connect()
    for args, message in ((("cluster", "start", "-n", "2", "--name", "busy"),
                           f"a cluster named 'busy' runs already (keeper pid {me.pid}, 2 ranks): pick another --name"),
                          (("cluster", "start", "-n", "2", "--name", "../x"), "'../x' cannot name a cluster"),
                          (("cluster", "start", "-n", "3", "--mesh", "ddp=2"), "ddp"),
                          (("cluster", "stop", "ghost"), "no running detached cluster is named 'ghost' (running: busy, "
                                                         "other)"),
                          # the engine launchers: refused by the same checks as Cluster(launcher=...)
                          (("cluster", "start", "-n", "2", "--launcher", "torchrun"),
                           "launcher must be None (the local fork server), 'mpi', 'ssh' or 'slurm', got 'torchrun'"),
                          (("cluster", "start", "-n", "2", "--ip", "127.0.0.1"),
                           "ip only apply with launcher='mpi', 'ssh' or 'slurm'"),
                          (("cluster", "start", "-n", "2", "--launcher", "ssh", "--hosts", "localhost:3"),
                           "hosts= gives 3 engines ({'localhost': 3}) but the cluster has 2 ranks"),
                          (("cluster", "start", "-n", "2", "--launcher", "ssh", "--hosts", "localhost:0"),
                           "--hosts: 'localhost:0' gives 0 engines; give each host at least 1 (HOST:K)")):
        assert cli_main(list(args)) == 1  # the command line's own entry point, in this process (no start-up cost)
        err = capsys.readouterr().err
        assert message in err, (args, err)
    assert not list((tmp_path / "home" / "detached").glob("*.log"))  # no keeper was started
    assert {p.pid for p in me.children(recursive=True)} <= children

    # a detached cluster's owner is its keeper: `sharddbg reap` leaves its processes alone while the keeper runs,
    # and reaps them (and marks its record stopped) once the keeper died
    keeper, engine = (subprocess.Popen(["sleep", "120"]) for _ in range(2))
    try:
        owner = registry.ProcessRef.of(keeper.pid, "owner")
        kept = registry.ClusterRecord(cluster_id="sdbg-20260101-000000-abcdef", owner=owner, log_dir="")
        kept.save()
        kept.track(engine.pid, "engine")
        detached.DetachedRecord(name="lost", keeper_pid=keeper.pid, keeper_create_time=owner.create_time,
                                uid=os.getuid(), state="running", cluster_id=kept.cluster_id, n=1).save()
        assert cli_main(["reap"]) == 0 and engine.poll() is None
        assert "left alone 1 cluster(s)" in capsys.readouterr().out
        keeper.kill()
        keeper.wait()
        assert cli_main(["reap"]) == 0
        out = capsys.readouterr().out
        assert f"{kept.cluster_id}: 1 process(es) killed: {engine.pid}" in out
        assert "detached cluster 'lost': its keeper had died; its record is marked stopped" in out
        engine.wait(10)  # ended (reaped by the reap already: its status is not ours to read)
        assert detached.read_record("lost").state == "stopped"
    finally:
        for proc in (keeper, engine):
            proc.kill()
            proc.wait()
