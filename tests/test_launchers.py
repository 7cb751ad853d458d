"""Engines started by ipyparallel's own launchers (``Cluster(launcher="mpi" | "ssh" | "slurm")``), on real
processes: MPICH's mpiexec from the ``mpich`` wheel, Debian's openssh-server started here on a private port,
and Debian's Slurm as a one-node cluster started here when it comes up."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import sharddbg
from sharddbg.cli import DEMO_CELL, SUMMARY, reference
from sharddbg.cluster import registry
from sharddbg.errors import ClusterError, RankTimeoutError

from test_lifecycle import assert_all_gone, processes_of

pytestmark = pytest.mark.cluster

HERE = socket.gethostname()


def listening_addresses(cl) -> set[str]:
    """The addresses the cluster's processes accept TCP connections on."""
    found = set()
    for proc in cl.processes():
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return found


def this_hosts_other_interface() -> tuple[str, str] | None:
    """(name, IPv4 address) of an interface of this machine besides loopback, if it has one."""
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return name, a.address
    return None


def test_mpi_launcher_runs_traces_recovers_and_stops_clean():
    """One 4-rank cluster whose engines mpiexec started: the demo net traced and checked against the unsharded
    reference, a skipped collective diagnosed and recovered, the host column, and nothing left after stop()."""
    cl = sharddbg.Cluster(n=4, mesh={"ddp": 1, "domain": 4}, launcher="mpi", timeout=120, start_timeout=300)
    cl.start()
    try:
        # mpiexec (MPICH's single-host process manager on one host) is the engines' parent, named in the record
        launchers = [p for p in cl.processes() if os.path.basename(p.cmdline()[0]).startswith("mpiexec")]
        assert len(launchers) == 1, [p.cmdline()[:3] for p in cl.processes()]
        assert set(cl.pids.values()) <= {c.pid for c in launchers[0].children(recursive=True)}
        status = cl.status()
        assert list(status.columns[:2]) == ["pid", "host"] and status["host"].tolist() == [HERE] * 4
        assert status["pid"].tolist() == [cl.pids[r] for r in range(4)] and set(status["state"]) == {"idle"}
        # the rank from mpiexec's PMI_RANK, LOCAL_RANK per host, the rendezvous on rank 0's host (loopback here)
        env = cl.eval("[__import__('os').environ[k] for k in ('PMI_RANK', 'LOCAL_RANK', 'MASTER_ADDR')]")
        assert env == [[str(r), str(r), "127.0.0.1"] for r in range(4)]
        # on one host everything listens on loopback only: controller, rendezvous store, gloo
        assert listening_addresses(cl) == {"127.0.0.1"}
        # the connection files, the launcher's output and the engines' logs: this user's only
        security = registry.profile_dir() / "security"
        private = list(security.glob(f"*{cl.cluster_id}*")) + list(Path(cl.log_dir).rglob("*"))
        assert len(private) >= 2 + 1 + 4 and {f.name: oct(f.stat().st_mode & 0o077) for f in private
                                               if f.stat().st_mode & 0o077} == {}
        # the demo net, traced, equal to the unsharded net
        trace = cl.trace(DEMO_CELL, display=False)
        assert len(trace.get_ops()) > 0 and sorted(trace.ranks) == [0, 1, 2, 3]
        summaries = cl.eval(SUMMARY)
        y_ref, grads_ref = reference()
        assert [s["x_local"][2] for s in summaries] == [17, 17, 16, 16]
        for s in summaries:
            np.testing.assert_allclose(s["y_full"], y_ref, rtol=1e-4, atol=1e-5)
            for name, grad in grads_ref.items():
                np.testing.assert_allclose(s["grads"][name], grad, rtol=1e-4, atol=1e-6)
        # a rank that enters a collective the others skip: the hang report names it, recover() brings the group
        # back on the same processes
        pids_before = dict(cl.pids)
        with pytest.raises(RankTimeoutError) as info:
            cl.run(textwrap.dedent("""
                def exchange(t):
                    dist.all_reduce(t)
                    return t
                if rank == 0:
                    exchange(torch.ones(4))
            """), timeout=10, display=False)
        report = info.value.report
        assert report.finished == [1, 2, 3] and report.unfinished == [0]
        assert [f["function"] for f in report.ranks[0].user_frames()][-1] == "exchange"
        assert report.ranks[0].pending[0].missing_ranks == [1, 2, 3]
        cl.recover()
        assert cl.pids == pids_before
        cl.run("t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)", display=False)
        assert cl.eval("t.tolist()") == [[10.0, 10.0, 10.0]] * 4
        pids = processes_of(cl)
        assert {p.pid for p in launchers} <= pids
        cluster_id = cl.cluster_id
    finally:
        cl.stop()
    assert_all_gone(pids)
    assert not (registry.clusters_dir() / f"{cluster_id}.json").exists()


def test_an_engine_that_reads_another_clock_is_measured_and_its_events_lined_up(tmp_path):
    """mpiexec starts rank 1's engine in a time namespace of its own whose monotonic clock is 3 s ahead (util-linux's
    unshare, through the launcher's ``remote_python``): rank 0 reads the client's clock and its offset is known;
    rank 1 does not, and is measured by round trips: 3 s within their uncertainty. A traced cell's collectives, 3 s
    apart as stamped, line up once the offsets are taken off."""
    shift_s = 3
    probe = subprocess.run(["unshare", "--time", "--monotonic", "1", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine cannot make a time namespace (unshare: {probe.stderr.strip()})")
    python = tmp_path / "python_in_its_clock"
    python.write_text(f"""#!/bin/sh
if [ "$PMI_RANK" = "1" ]; then exec unshare --time --monotonic {shift_s} --fork --kill-child {sys.executable} "$@"; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    cl = sharddbg.Cluster(n=2, mesh={"ddp": 1, "domain": 2}, launcher="mpi", timeout=120, start_timeout=300,
                          launcher_config={"remote_python": str(python)})
    cl.start()
    try:
        assert cl.eval("__import__('time').monotonic()")[1] - time.monotonic() > shift_s - 1
        offsets = cl.clock_offsets()
        assert offsets[0] == {"offset_ns": 0, "uncertainty_ns": 0}
        assert 0 < offsets[1]["uncertainty_ns"] < 50_000_000
        assert abs(offsets[1]["offset_ns"] - shift_s * 1_000_000_000) <= offsets[1]["uncertainty_ns"]
        t = cl.trace("x = torch.ones(4)\nfor _ in range(5):\n    dist.all_reduce(x)", display=False)
        assert t.meta["clock_uncertainty_ns"]["0"] == 0 and t.meta["clock_uncertainty_ns"]["1"] > 0
        raw = {r: [ev["t_done_ns"] for ev in t.events(r) if ev["kind"] == "collective"] for r in t.ranks}
        assert abs(raw[1][0] - raw[0][0] - shift_s * 1_000_000_000) < 1_000_000_000  # stamped 3 s apart
        done_ns = t.get_collectives().groupby("group_seq")["t_done_ns"]
        assert len(done_ns) == 5 and (done_ns.max() - done_ns.min()).max() < 200_000_000  # lined up
        pids = processes_of(cl)
    finally:
        cl.stop()
    assert_all_gone(pids)


# ------------------------------------------------------------------ ssh to this machine, through its own sshd
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@pytest.fixture(scope="module")
def sshd():
    """Debian's openssh-server on a free loopback port, with its own config, host key and a throwaway client
    key (nothing of the machine's own ssh set-up is used or changed); skipped when it cannot start."""
    if not os.access(SSHD, os.X_OK):
        pytest.skip(f"no sshd at {SSHD}: install Debian's openssh-server")
    folder = tempfile.mkdtemp(prefix="sharddbg-sshd-")
    os.chmod(folder, 0o700)
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(folder, key)], check=True)
    authorized = os.path.join(folder, "authorized_keys")
    shutil.copy(os.path.join(folder, "client_key.pub"), authorized)
    os.chmod(authorized, 0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = os.path.join(folder, "sshd_config")
    with open(config, "w") as f:
        f.write(textwrap.dedent(f"""\
            ListenAddress 127.0.0.1
            Port {port}
            HostKey {folder}/host_key
            AuthorizedKeysFile {authorized}
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PubkeyAuthentication yes
            PermitRootLogin prohibit-password
            StrictModes no
            UsePAM no
            PidFile {folder}/sshd.pid
            """))
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation folder
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", config], stderr=open(os.path.join(folder, "sshd.log"), "w"))
    ssh_args = ["-i", f"{folder}/client_key", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes"]
    deadline = time.monotonic() + 20
    while True:
        done = subprocess.run(["ssh", *ssh_args, "-o", "BatchMode=yes", "-p", str(port), "127.0.0.1", "true"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(os.path.join(folder, "sshd.log")) as log:
                pytest.skip(f"sshd did not start: {log.read()[-500:]} {done.stderr[-300:]}")
        time.sleep(0.2)
    yield {"host": f"127.0.0.1:{port}", "ssh_args": ssh_args, "scp_args": ["-i", f"{folder}/client_key",
           "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]}
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def test_ssh_launcher_starts_ranks_over_ssh_and_stops_clean(sshd):
    # ip= this machine's other interface where it has one: the way across hosts (the controller, the rendezvous
    # and gloo on that interface only), with both hosts this one
    other = this_hosts_other_interface()
    cl = sharddbg.Cluster(n=2, launcher="ssh", hosts={sshd["host"]: 2}, timeout=120, start_timeout=300,
                          ip=other[0] if other else None,
                          launcher_config={"ssh_args": sshd["ssh_args"], "scp_args": sshd["scp_args"]})
    cl.start()
    try:
        # the engines are sshd's grandchildren, not this process's
        status = cl.status()
        assert status["host"].tolist() == [HERE] * 2
        assert cl.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()) * (rank + 1))") == [3.0] * 2
        assert cl.eval("__import__('os').environ['LOCAL_RANK']") == ["0", "1"]
        address = other[1] if other else "127.0.0.1"
        assert cl.eval("__import__('os').environ['MASTER_ADDR']") == [address] * 2
        # the controller and rank 0's store on that address; besides it, loopback only
        assert address in listening_addresses(cl) <= {address, "127.0.0.1"}
        if other:
            assert cl.eval("__import__('os').environ['GLOO_SOCKET_IFNAME']") == [other[0]] * 2
        pids = processes_of(cl)
        assert set(cl.pids.values()) <= pids
    finally:
        cl.stop()
    assert_all_gone(pids)


# ------------------------------------------------------------------ Slurm: a one-node cluster of this machine
SLURM_UP_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def slurm():
    """Debian's slurm-wlm as a one-node cluster of this machine: munged, slurmctld and slurmd with their own
    key, config, state folders and ports (SLURM_CONF points sbatch and srun at it); skipped with the reason when
    it is not installed or not up within SLURM_UP_S."""
    tools = {name: shutil.which(name) or f"/usr/sbin/{name}" for name in ("munged", "slurmctld", "slurmd")}
    missing = [name for name, path in tools.items() if not os.access(path, os.X_OK)]
    missing += [name for name in ("sbatch", "srun", "sinfo", "scancel") if not shutil.which(name)]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}): apt-get install slurm-wlm munge")
    folder = tempfile.mkdtemp(prefix="sharddbg-slurm-")
    os.chmod(folder, 0o755)  # munged wants its socket's folder reachable by every user
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(folder, sub), mode=0o700)
    with open(os.path.join(folder, "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(folder, "munge.key"), 0o600)
    socket_path = os.path.join(folder, "munge.sock")
    subprocess.run([tools["munged"], "--force", f"--key-file={folder}/munge.key", f"--socket={socket_path}",
                    f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                    f"--seed-file={folder}/munged.seed"], check=True, capture_output=True)
    host = socket.gethostname()
    conf = os.path.join(folder, "slurm.conf")
    with open(conf, "w") as f:
        f.write(textwrap.dedent(f"""\
            ClusterName=sharddbgtest
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            AuthType=auth/munge
            AuthInfo=socket={socket_path}
            CredType=cred/munge
            SlurmUser=root
            SlurmdUser=root
            StateSaveLocation={folder}/state
            SlurmdSpoolDir={folder}/spool
            SlurmctldPidFile={folder}/slurmctld.pid
            SlurmdPidFile={folder}/slurmd.pid
            SlurmctldLogFile={folder}/slurmctld.log
            SlurmdLogFile={folder}/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            MpiDefault=none
            ReturnToService=2
            SchedulerType=sched/builtin
            SelectType=select/linear
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            JobAcctGatherType=jobacct_gather/none
            SlurmdParameters=config_overrides
            NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
            PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
            """))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf

    def pid_of(name):
        try:
            with open(os.path.join(folder, f"{name}.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def tear_down():
        subprocess.run(["scancel", "--full", "--user", str(os.getuid())], capture_output=True)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = pid_of(name)
            if pid:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)

    t0 = time.monotonic()
    subprocess.run([tools["slurmctld"], "-f", conf, "-i"], capture_output=True)
    subprocess.run([tools["slurmd"], "-f", conf], capture_output=True)
    while True:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if state == "idle":
            break
        if time.monotonic() - t0 > SLURM_UP_S:
            logs = {n: open(os.path.join(folder, f"{n}.log"), errors="replace").read()[-300:]
                    for n in ("slurmctld", "slurmd") if os.path.exists(os.path.join(folder, f"{n}.log"))}
            tear_down()
            pytest.skip(f"the one-node Slurm cluster was not up within {SLURM_UP_S:g} s (node state {state!r}): {logs}")
        time.sleep(0.2)
    yield conf
    tear_down()


def test_slurm_launcher_starts_ranks_as_a_job_and_stops_clean(slurm):
    cl = sharddbg.Cluster(n=2, launcher="slurm", timeout=120, start_timeout=300)
    cl.start()
    try:
        assert cl.status()["host"].tolist() == [HERE] * 2
        # the rank from srun's SLURM_PROCID
        assert cl.eval("__import__('os').environ['SLURM_PROCID']") == ["0", "1"]
        assert cl.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()) * (rank + 1))") == [3.0] * 2
        # restart(): the job is cancelled and a new one submitted (new engines, new processes)
        first_job = cl.eval("__import__('os').environ['SLURM_JOB_ID']")
        old_pids = processes_of(cl)
        cl.restart()
        assert_all_gone(old_pids - processes_of(cl))
        second_job = cl.eval("__import__('os').environ['SLURM_JOB_ID']")
        assert len(set(second_job)) == 1 and second_job != first_job
        assert cl.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()) * (rank + 1))") == [3.0] * 2
        pids = processes_of(cl)
        assert set(cl.pids.values()) <= pids
    finally:
        cl.stop()
    assert_all_gone(pids)
    # its processes are gone; Slurm lists the cancelled job as COMPLETING until slurmd has reported it done
    deadline = time.monotonic() + 60
    while (jobs := subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True).stdout.strip()) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs == "", f"the engines' job is still queued or running 60 s after the stop: {jobs}"
