"""The bad-input sweep: every case of ``tests/fault_cases.py`` BAD_INPUT gives its clear error before anything
runs on a rank (a cell that would have set a marker did not run), the same error on every rank where the
ranks decide (scatter), on a real 4-rank cluster. Also: a rank named twice is refused by every call that
takes ranks, a variable name is looked up as Python stores it, and a start that fails says to start again."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import sharddbg
from sharddbg.cluster.group import DistributedGroup
from sharddbg.cluster.verify import CheckError
from sharddbg.errors import ClusterError, MeshError, RankDiedError, RankError, TraceFileError

from fault_cases import BAD_INPUT, starts_with

pytestmark = pytest.mark.cluster

CASES = {c.name: c for c in BAD_INPUT}
MARK = "BAD_INPUT_MARK = 1"


@pytest.fixture(scope="module")
def cl(patient_cluster4):
    return patient_cluster4


@pytest.fixture(scope="module")
def ip(cl):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sharddbg")
    return shell


def _no_code_ran(cl) -> None:
    assert cl.eval("'BAD_INPUT_MARK' in globals()") == [False] * 4


GOLDEN = Path(__file__).parent / "data" / "conv4.sdtrace.json"


def _start_with_home(home: str) -> None:
    """``Cluster(n=2).start()`` with SHARDDBG_HOME set to ``home`` (put back after)."""
    before = os.environ.get("SHARDDBG_HOME")
    os.environ["SHARDDBG_HOME"] = home
    try:
        sharddbg.Cluster(n=2).start()
    finally:
        if before is None:
            del os.environ["SHARDDBG_HOME"]
        else:
            os.environ["SHARDDBG_HOME"] = before


def _save_to_cwd_folder() -> None:
    """``t.save(".")``, in an empty folder of its own (put back after)."""
    trace = sharddbg.load_trace(GOLDEN)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            trace.save(".")
        finally:
            os.chdir(cwd)
            assert os.listdir(folder) == [], "nothing was written in the folder"


# ---- a start that fails ----------------------------------------------------------------------------------
def test_failed_start_says_start_again_not_recover(monkeypatch):
    """The ranks die as torch.distributed comes up (SIGKILL; every rank, so nothing waits for a survivor): the
    start fails and everything it started is shut down, so the error must not advise recover() (nothing is
    left to recover). First in the module: no other cluster starts meanwhile (the module's cluster, when the
    module before handed it on, is up but idle: only this start is changed)."""
    bring_up = DistributedGroup.bring_up

    def a_rank_dies_meanwhile(self, execution, backend, timeout, mesh=None):
        for pid in execution.processes.pids.values():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(execution.processes.dead_ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # both known dead before the call: it ends at once, with no survivor to release
        return bring_up(self, execution, backend, timeout, mesh)

    monkeypatch.setattr(DistributedGroup, "bring_up", a_rank_dies_meanwhile)
    cluster = sharddbg.Cluster(n=2, timeout=60, collective_timeout=60)
    with pytest.raises(ClusterError) as info:
        cluster.start()
    message = str(info.value)
    assert isinstance(info.value, RankDiedError) and message.startswith("rank 0 (pid "), message
    assert "rank 1 (pid " in message, message
    assert "cl.recover()" not in message and "%shard_cluster recover" not in message, message
    assert message.rstrip().endswith("The cluster's start failed and everything it had started was shut down: there "
                                     "is no process group to recover(). Fix the cause above and start() the cluster "
                                     "again (%shard_cluster start)."), message
    assert not cluster.running and cluster.processes() == []


# name -> what the user does (a function of the cluster and the shell)
ACTIONS = {
    "timeout_nan": lambda cl, ip: sharddbg.Cluster(n=2, timeout=float("nan")),
    "collective_timeout_inf": lambda cl, ip: sharddbg.Cluster(n=2, collective_timeout=float("inf")),
    "collective_timeout_tiny": lambda cl, ip: sharddbg.Cluster(n=2, collective_timeout=1e-9),
    "mesh_both_inferred": lambda cl, ip: sharddbg.Cluster(mesh={"ddp": -1, "domain": -1}),
    "mesh_axis_twice": lambda cl, ip: sharddbg.Cluster(mesh="ddp=1,domain=4,ddp=2"),
    "threads_word": lambda cl, ip: sharddbg.Cluster(n=2, threads_per_rank="x"),
    "home_not_a_folder": lambda cl, ip: _start_with_home("/dev/null"),
    "too_many_ranks": lambda cl, ip: sharddbg.Cluster(n=1000),
    "run_timeout_word": lambda cl, ip: cl.run(MARK, timeout="abc"),
    "run_no_targets": lambda cl, ip: cl.run(MARK, targets=[]),
    "run_bad_target": lambda cl, ip: cl.run(MARK, targets=[7]),
    "run_target_twice": lambda cl, ip: cl.run(MARK, targets=[0, 0]),
    "px_target_twice": lambda cl, ip: ip.run_line_magic("px", "-t 0,0 " + MARK),
    "load_device": lambda cl, ip: sharddbg.load_trace("/dev/zero"),
    "save_to_folder": lambda cl, ip: _save_to_cwd_folder(),
    "px_empty_slice": lambda cl, ip: ip.run_line_magic("px", "-t 1:0 " + MARK),
    "px_bad_slice": lambda cl, ip: ip.run_line_magic("px", "-t a:b " + MARK),
    "px_timeout_nan": lambda cl, ip: ip.run_line_magic("px", "--timeout nan " + MARK),
    "magic_unbalanced_quote": lambda cl, ip: ip.run_line_magic("shard_cluster", "start --mesh 'ddp=1"),
    "trace_max_events": lambda cl, ip: cl.trace(MARK, max_events=0),
    "trace_option_not_bool": lambda cl, ip: cl.trace(MARK, memory="yes"),
    "scatter_dim_str": lambda cl, ip: cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 8, 8), dim='2')"),
    "scatter_dim_float": lambda cl, ip: cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 8, 8), dim=2.0)"),
    "scatter_batch_dim_str": lambda cl, ip: cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 8, 8), 2, batch_dim='0')"),
    "scatter_empty_shards": lambda cl, ip: cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 3, 8), dim=2)"),
}
ERRORS = {"ClusterError": ClusterError, "UsageError": UsageError, "RankError": RankError, "MeshError": MeshError,
          "TraceFileError": TraceFileError, "IsADirectoryError": IsADirectoryError}


def test_every_case_has_an_action():
    assert set(ACTIONS) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_refused_before_anything_runs(cl, ip, name):
    case = CASES[name]
    with pytest.raises(ERRORS[case.error]) as info:
        ACTIONS[name](cl, ip)
    first = str(info.value).splitlines()[0]
    assert starts_with(case).match(first), (case.sees, first)
    if name.startswith("scatter_"):
        errors = info.value.errors
        assert sorted(errors) == [0, 1, 2, 3], "every rank raises, none is left waiting"
        assert len({(e.type_name, e.message) for e in errors.values()}) == 1, "the same error on every rank"
        assert {e.type_name for e in errors.values()} == {"ScatterError"}
        assert cl.broken is None  # decided before any collective could desynchronise the group
    _no_code_ran(cl)
    assert cl.busy_ranks() == []


# ---- a rank named twice, by every call that takes ranks -------------------------------------------------
TWICE = {
    "eval": lambda cl, ip: cl.eval("BAD_INPUT_MARK", targets=[1, 2, 1]),
    "pull": lambda cl, ip: cl.pull("BAD_INPUT_MARK", targets=(1, 2, 1)),
    "apply": lambda cl, ip: cl.apply(exec, MARK, targets=[1, 2, 1]),
    "submit": lambda cl, ip: cl.submit(MARK, targets=[1, 2, 1]),
    "diagnose": lambda cl, ip: cl.diagnose([1, 2, 1]),
    "px_negative": lambda cl, ip: ip.run_line_magic("px", "-t 1,2,-3 " + MARK),
    "pxconfig": lambda cl, ip: ip.run_line_magic("pxconfig", "-t [1,2,1]"),
}


@pytest.mark.parametrize("call", list(TWICE))
def test_a_rank_named_twice_is_refused_by_every_call(cl, ip, call):
    with pytest.raises((ClusterError, UsageError)) as info:
        TWICE[call](cl, ip)
    first = str(info.value).splitlines()[0]
    which = {"diagnose": "ranks [1, 2, 1]", "pull": "targets (1, 2, 1)", "px_negative": "-t 1,2,-3",
             "pxconfig": "-t [1,2,1]"}.get(call, "targets [1, 2, 1]")
    assert first.startswith(f"{which} name") and "rank 1 more than once" in first, first
    assert "give each rank once" in first and "[1,2]" in first.split("give each rank once")[1].replace(" ", "") \
        or "-t1,2)" in first.split("give each rank once")[1].replace(" ", ""), first
    _no_code_ran(cl)


# ---- names as Python stores them --------------------------------------------------------------------------
def test_a_name_with_a_micro_sign_is_found_as_python_stored_it(cl, ip):
    """``µ = ...`` (MICRO SIGN) binds ``μ`` (GREEK SMALL LETTER MU): Python NFKC-normalises identifiers. Every
    call that takes the name of a variable looks it up as Python stored it."""
    micro = "\N{MICRO SIGN}"
    cl.run(f"{micro} = sharddbg.engine.scatter(torch.arange(48.).reshape(1, 3, 4, 4), dim=2); {micro}_rank = rank",
           display=False)
    try:
        assert cl.eval(f"sorted(n for n in globals() if n in ('{micro}', '\N{GREEK SMALL LETTER MU}'))") \
            == [["\N{GREEK SMALL LETTER MU}"]] * 4
        widget = ip.run_line_magic("shard_inspect", micro)
        assert widget.get_ranks()["local_shape"].tolist() == [(1, 3, 1, 4)] * 4
        assert cl.inspect(micro).get_ranks()["local_shape"].tolist() == [(1, 3, 1, 4)] * 4
        assert cl.pull(f"{micro}_rank") == [0, 1, 2, 3]
        assert cl.doctor(micro).ok
        # found (then refused as no module: quicker than a whole check), not "no variable"
        with pytest.raises(CheckError, match="^cl.check: \N{GREEK SMALL LETTER MU} is a ShardTensor, not a torch.nn.Module"):
            cl.check(f"y = {micro} * 2", model=micro, display=False)
    finally:
        cl.run("del \N{GREEK SMALL LETTER MU}, \N{GREEK SMALL LETTER MU}_rank; "
               "globals().pop('y\N{GREEK SMALL LETTER MU}', None)", display=False)


# ---- SHARDDBG_HOME that cannot be a folder -----------------------------------------------------------------
def test_home_under_a_file_is_named_before_anything_starts(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ClusterError) as info:
        _start_with_home(str(a_file / "home"))
    assert str(info.value).startswith(
        f"SHARDDBG_HOME={str(a_file / 'home')!r} cannot hold sharddbg's state (cluster records, logs, connection "
        f"files): {a_file} is not a folder, so {a_file / 'home'} cannot be one. Set SHARDDBG_HOME to a folder")
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= children, "nothing was started"


# ---- engine launchers: refused at Cluster(...), before anything starts ------------------------------------------
def test_a_launcher_that_does_not_exist_is_refused_with_the_valid_ones():
    with pytest.raises(ClusterError, match=r"^launcher must be None \(the local fork server\), 'mpi', 'ssh' or "
                                           r"'slurm', got 'torchrun'$"):
        sharddbg.Cluster(n=2, launcher="torchrun")
    with pytest.raises(ClusterError, match="only apply with launcher='mpi', 'ssh' or 'slurm'"):
        sharddbg.Cluster(n=2, ip="lo")


def test_mpi_without_mpiexec_says_how_to_get_one(monkeypatch, tmp_path):
    # a PATH without mpiexec, and a Python whose folder has none (the venv's bin has the mpich wheel's)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    with pytest.raises(ClusterError, match=r"^launcher='mpi' needs mpiexec, and none is on PATH or beside .*: pip "
                                           r"install mpich==4\.3\.2 \(into this environment\), or load your MPI module"):
        sharddbg.Cluster(n=2, launcher="mpi")


def test_ssh_without_hosts_or_with_an_unreachable_one_is_refused(tmp_path):
    with pytest.raises(ClusterError, match=r"^launcher='ssh' needs hosts=: the ssh hosts and how many engines each "
                                           r"runs"):
        sharddbg.Cluster(n=2, launcher="ssh")
    with pytest.raises(ClusterError, match=r"hosts= gives 1 engines .* but the cluster has 2 ranks"):
        sharddbg.Cluster(n=2, launcher="ssh", hosts={"localhost": 1})
    with pytest.raises(ClusterError, match=r"cannot reach a controller on loopback: give ip="):
        sharddbg.Cluster(n=2, launcher="ssh", hosts={"node-elsewhere.invalid": 2})
    # a host nobody answers for: refused at start(), before any process of the cluster starts
    cl = sharddbg.Cluster(n=2, launcher="ssh", hosts={"127.0.0.1:9": 2},
                          launcher_config={"ssh_args": ["-o", "StrictHostKeyChecking=no"]})
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ClusterError, match=r"^ssh host '127.0.0.1:9' is unreachable \(.*\): check that `ssh .*` "
                                           r"works without a password"):
        cl.start()
    assert not cl.running and not cl.processes()
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= children, "nothing was left running"


def test_slurm_without_sbatch_says_where_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterError, match=r"^launcher='slurm' needs Slurm's sbatch and srun, not found on PATH: run "
                                           r"on a Slurm login node"):
        sharddbg.Cluster(n=2, launcher="slurm")


def test_an_ip_that_is_not_this_hosts_is_refused():
    with pytest.raises(ClusterError, match=r"^ip='no-such-if0' is neither an interface nor an IPv4 address of this "
                                           r"host; its interfaces: .*lo \(127\.0\.0\.1\)"):
        sharddbg.Cluster(n=2, launcher="mpi", ip="no-such-if0")
    with pytest.raises(ClusterError, match=r"^ip='192\.0\.2\.1' is not an address of this host"):
        sharddbg.Cluster(n=2, launcher="mpi", ip="192.0.2.1")
