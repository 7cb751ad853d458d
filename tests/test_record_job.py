"""``sharddbg record -- torchrun ...``: a job recorded unchanged, on 4 CPU gloo ranks started by torchrun itself,
read back with ``load_trace(folder)``, ``sharddbg summary`` and ``sharddbg report``; compared with the same code
traced in the notebook cluster; a rank killed, a rank that skips an all_reduce, a window of steps; plain
DTensor ops against CommDebugMode; bad input refused before anything starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

import sharddbg
from sharddbg import columnar, job_files
from sharddbg.errors import TraceFileError

REPO = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).parent / "data" / "jobs"
CONV_JOB = JOBS / "conv_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

pytestmark = pytest.mark.cluster


@dataclass
class RecordedRun:
    returncode: int
    output: str
    folder: Path


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def sharddbg_cli(*args, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sharddbg.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(JOBS), **kwargs)


def sharddbg_cli_all(*commands: tuple, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """``sharddbg_cli`` of each command (its arguments, then a dict of keyword arguments for ``Popen``), all started
    at once and waited for: each one's result, in order. Each job's time is mostly its own process start, which
    runs on the core the others leave idle."""
    started = [subprocess.Popen([sys.executable, "-m", "sharddbg.cli", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(JOBS), **kwargs)
               for *args, kwargs in commands]
    done = []
    try:
        for process in started:
            out, err = process.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return done


# a script's own free port for its one-process group (a fixed one could be taken by anything else on the host)
PICK_A_FREE_PORT = ("import socket\n"
                    "with socket.socket() as _s:\n"
                    "    _s.bind(('127.0.0.1', 0))\n"
                    "    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(_s.getsockname()[1]))\n")


def record_torchrun(folder: Path, record_args: list, job_args: list, timeout: float = 400) -> RecordedRun:
    return RecordingStarted.start(folder, record_args, job_args, timeout).finish()


@dataclass
class RecordingStarted:
    """``sharddbg record -- torchrun ...`` started and not waited for: its output goes to files beside the folder
    (a pipe nobody reads could fill and stop it)."""

    process: subprocess.Popen
    folder: Path
    output: Path
    deadline: float  # time.monotonic() by which it must have ended

    @classmethod
    def start(cls, folder: Path, record_args: list, job_args: list, timeout: float = 400) -> "RecordingStarted":
        output = folder.with_name(folder.name + ".output")
        with open(output, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "sharddbg.cli", "record", "--out", str(folder), *map(str, record_args), "--",
                 TORCHRUN, "--standalone", "--nproc-per-node", "4", str(CONV_JOB), *map(str, job_args)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(), cwd=str(JOBS),
                start_new_session=True)
        return cls(process, folder, output, time.monotonic() + timeout)

    def finish(self) -> RecordedRun:
        """Wait for it (until its deadline: then it is killed and ``subprocess.TimeoutExpired`` raised)."""
        try:
            returncode = self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return RecordedRun(returncode, self.output.read_text(), self.folder)

    def kill(self) -> None:
        """It and everything it started (its own process group) killed, where it still runs."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# the fault launches (test name -> what the test's launch records), started at once when the module starts: most of
# their time is waiting (a rank that sleeps before it is killed, a hang watched for seconds, ranks that linger), which
# the window's launch and the other tests use
KILLED = "test_a_killed_rank_keeps_what_it_flushed_and_the_others_all"
SKIPPED = "test_a_rank_that_skips_an_all_reduce_is_named_with_the_collective"


@pytest.fixture(scope="module", autouse=True)
def fault_launches(request, tmp_path_factory) -> dict[str, RecordingStarted]:
    """The fault launches of the module's selected tests, started when the module starts: test name -> its launch.
    Anything of them still running when the module ends is killed."""
    selected = {item.originalname for item in request.session.items if item.path == request.node.path}
    started: dict[str, RecordingStarted] = {}
    if KILLED in selected:
        where = tmp_path_factory.mktemp("killed")
        started[KILLED] = RecordingStarted.start(
            where / "killed", [], ["--steps", "4", "--kill-rank", "2", "--kill-step", "3",
                                   "--kill-note", where / "killed_at_ns", "--timeout", "20"])
    if SKIPPED in selected:
        started[SKIPPED] = RecordingStarted.start(
            tmp_path_factory.mktemp("skipped") / "skipped", ["--hang-after", "2"],
            ["--steps", "2", "--skip-rank", "1", "--skip-step", "2", "--linger", "8", "--timeout", "30"])
    yield started
    for launch in started.values():
        launch.kill()


def _op_counts(t) -> pd.Series:
    ops = t.get_ops()
    return ops.groupby(["rank", "op", "path", "phase"]).size().sort_index()


def _collective_counts(t) -> pd.DataFrame:
    colls = t.get_collectives().copy()
    colls["op"] = colls["op"].fillna("<outside every op>")
    return (colls.groupby(["rank", "kind", "op"]).agg(calls=("seq", "size"), bytes_sent=("bytes_sent", "sum"),
                                                      bytes_recv=("bytes_recv", "sum"))
            .sort_index())


# ---- a rank whose clock is another: measured ------------------------------------------------------------
CLOCK_JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(4)
for _ in range(5):
    dist.all_reduce(x)
dist.destroy_process_group()
"""
# rank 1 in a time namespace of its own whose monotonic clock is 3 s ahead (util-linux's unshare; needs the right
# to make namespaces); the others run as they are
CLOCK_SHIFT_S = 3
IN_ANOTHER_CLOCK = f"""#!/bin/sh
if [ "$LOCAL_RANK" = "1" ]; then exec unshare --time --monotonic {CLOCK_SHIFT_S} --fork --kill-child "$@"; fi
exec "$@"
"""


def test_a_rank_that_reads_another_clock_is_measured_and_lined_up(tmp_path):
    """Rank 1 runs in another time namespace, its monotonic clock 3 s ahead of the others': it does not read rank 0's
    clock, so it is measured through the store (the others' offsets are known); its offset is the shift within the
    measurement's uncertainty, and its collectives line up with the others' once the offsets are taken off."""
    probe = subprocess.run(["unshare", "--time", "--monotonic", "1", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine cannot make a time namespace (unshare: {probe.stderr.strip()})")
    (tmp_path / "clock_job.py").write_text(CLOCK_JOB)
    wrapper = tmp_path / "in_another_clock.sh"
    wrapper.write_text(IN_ANOTHER_CLOCK)
    wrapper.chmod(0o755)
    folder = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "sharddbg.cli", "record", "--out", str(folder), "--", TORCHRUN, "--standalone",
         "--nproc-per-node", "3", "--no-python", str(wrapper), sys.executable, str(tmp_path / "clock_job.py")],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_files.read_job(str(folder))
    clocks = {rank: (s.clock_offset_ns, s.clock_uncertainty_ns) for rank, s in job.ranks.items()}
    assert clocks[0] == clocks[2] == (0, 0), clocks
    offset, uncertainty = clocks[1]
    assert 0 < uncertainty < 50_000_000, clocks
    assert abs(offset - CLOCK_SHIFT_S * 1_000_000_000) <= uncertainty, clocks
    t = sharddbg.load_trace(folder)
    raw = {r: [ev["t_done_ns"] for ev in t.events(r) if ev["kind"] == "collective"] for r in t.ranks}
    assert abs(raw[1][0] - raw[0][0] - CLOCK_SHIFT_S * 1_000_000_000) < 1_000_000_000  # the stamps are 3 s apart
    done_ns = t.get_collectives().groupby("group_seq")["t_done_ns"]
    assert len(done_ns) == 5 and (done_ns.max() - done_ns.min()).max() < 200_000_000  # and line up once moved


# ---- a window of steps, the same as the notebook ------------------------------------------------------

@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    return record_torchrun(tmp_path_factory.mktemp("jobs") / "window", ["--steps", "2:3"], ["--steps", "3"])


def test_a_window_of_steps_records_what_the_notebook_records_of_the_same_code(window_run, cluster4):
    assert window_run.returncode == 0, window_run.output
    t = sharddbg.load_trace(window_run.folder)
    assert t.ranks == [0, 1, 2, 3] and t.incomplete_ranks == []
    # only steps 2 and 3: their markers, and no event before the first one
    for rank in t.ranks:
        events = t.events(rank)
        markers = [ev for ev in events if ev["kind"] == "meta" and ev.get("name") == "step"]
        assert [m["data"]["step"] for m in markers] == [2, 3], markers
        assert events[0] is markers[0]
    job = job_files.read_job(str(window_run.folder))
    assert {s.header["steps"][0] for s in job.ranks.values()} == {2}
    # the clock: every rank reads rank 0's own monotonic clock (one host), so its offset is known, not measured
    for rank, s in job.ranks.items():
        assert (s.clock_offset_ns, s.clock_uncertainty_ns) == (0, 0), (rank, s.clock_offset_ns, s.clock_uncertainty_ns)
    # plain DTensor ops were recorded with their own paths, their collectives attributed to them
    ops = t.get_ops()
    assert {"dtensor_propagation", "dtensor_redistribute"} <= set(ops["path"])
    assert t.meta["job"]["returncode"] == 0

    # the same steps of the same code, traced in the notebook cluster (2 x 2 mesh, like the job's)
    cl = cluster4
    cl.remesh({"ddp": 2, "domain": 2})
    try:
        cl.run(f"import sys; sys.path.insert(0, {str(JOBS)!r}); import conv_job\n"
               "model = conv_job.build_model(); opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
               "conv_job.train_step(model, opt, mesh, 1)", timeout=120)
        notebook = cl.trace("for s in (2, 3):\n    conv_job.train_step(model, opt, mesh, s)", timeout=120)
    finally:
        cl.remesh({"ddp": 1, "domain": 4})
    assert notebook.incomplete_ranks == []
    pd.testing.assert_series_equal(_op_counts(t), _op_counts(notebook))
    pd.testing.assert_frame_equal(_collective_counts(t), _collective_counts(notebook))


def test_summary_and_report_read_the_folder(window_run, tmp_path):
    assert window_run.returncode == 0, window_run.output
    html = tmp_path / "report.html"
    done, report_done = sharddbg_cli_all(("summary", window_run.folder, {}),
                                         ("report", window_run.folder, "-o", html, {}), timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("  4 ranks;") and "exit status 0" in lines[1]
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    t = sharddbg.load_trace(window_run.folder)
    # the same findings as the notebook, in the same order, each starting its line
    starts = [line for line in lines if line[:5].strip() in ("FAIL", "WARN", "INFO", "OK")]
    assert [s[6:40] for s in starts] == [f.text()[:34] for f in t.findings]
    done = report_done
    assert done.returncode == 0, done.stderr
    assert html.stat().st_size > 10_000 and "Tensor.matmul" in html.read_text()


# ---- faults ----------------------------------------------------------------------------------------------

def test_a_killed_rank_keeps_what_it_flushed_and_the_others_all(fault_launches):
    run = fault_launches[KILLED].finish()
    note = run.folder.parent / "killed_at_ns"
    assert run.returncode != 0
    t = sharddbg.load_trace(run.folder)
    assert 2 in t.incomplete_ranks
    reason = t.incomplete_reasons[2]
    assert "killed by SIGKILL" in reason and "in step 3" in reason, reason
    # the streams are Arrow record batches, read as columns up to the killed rank's last flush
    assert (run.folder / "rank-00002.arrows").exists() and not list(run.folder.glob("*.jsonl"))
    assert all(isinstance(p["events"], columnar.LazyRecords) for p in t.payloads.values())
    job = job_files.read_job(str(run.folder))
    killed_at = int(note.read_text())
    # its stream was flushed within the last second before the kill: everything it recorded before is there,
    # the start of step 3 (1.5 s before the kill) too
    assert killed_at - job.ranks[2].last_t_ns <= 1_000_000_000, (killed_at - job.ranks[2].last_t_ns) / 1e9
    markers = [ev["data"]["step"] for ev in job.ranks[2].payload["events"] if ev.get("name") == "step"]
    assert markers == [1, 2, 3], markers
    # every other rank ended its stream: all it recorded is there, its last step too
    for rank in (0, 1, 3):
        assert job.ranks[rank].ended, rank
    first = t.findings[0]
    assert first.kind in ("collective_missing", "incomplete_ranks", "error") and 2 in first.ranks, first
    done = sharddbg_cli("summary", run.folder)
    assert "rank 2" in done.stdout and "killed by SIGKILL" in done.stdout


def test_a_rank_that_skips_an_all_reduce_is_named_with_the_collective(fault_launches):
    run = fault_launches[SKIPPED].finish()
    t = sharddbg.load_trace(run.folder)
    report = t.meta.get("hang_report")
    assert report, run.output
    head = report.splitlines()[0]
    assert head.startswith("rank 3 after 1 optimizer step waited more than 2 s in a collective that rank 1 never "
                           "joined"), head
    assert "waiting in all_reduce on 'ddp'" in report and "never joined by: rank 1" in report
    assert "conv_job.py:" in report and "dist.all_reduce(g, group=ddp_group)" in report
    missing = [f for f in t.findings if f.kind == "collective_missing"]
    assert missing and missing[0].ranks == (1,) and "all_reduce" in missing[0].sentence
    done = sharddbg_cli("summary", run.folder)
    assert "hang report:" in done.stdout


# ---- plain DTensor, in the notebook, against CommDebugMode ---------------------------------------------

DTENSOR_SETUP = """
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
from torch.distributed.tensor.debug import CommDebugMode
dmesh = mesh["domain"]
def dtensor_inputs():
    torch.manual_seed(0)
    return dict(a=distribute_tensor(torch.randn(8, 6), dmesh, [Shard(0)]),
                w=distribute_tensor(torch.randn(6, 4), dmesh, [Shard(0)]),
                w1=distribute_tensor(torch.randn(6, 8), dmesh, [Shard(1)]),
                w2=distribute_tensor(torch.randn(8, 3), dmesh, [Shard(0)]),
                img=distribute_tensor(torch.randn(1, 2, 8, 8), dmesh, [Shard(3)]),
                k=distribute_tensor(torch.randn(3, 2, 3, 3), dmesh, [Replicate()]))
"""
DTENSOR_LINES = ["h = a @ w", "s = h.sum()", "f = s.full_tensor()", "r = h.redistribute(dmesh, [Replicate()])",
                 "y = torch.relu(a @ w1) @ w2", "z = y.full_tensor()",
                 "c = torch.nn.functional.conv2d(img, k, padding=1)"]


def _kind(comm_debug_op: str) -> str:
    """CommDebugMode's op name ('c10d_functional.all_gather_into_tensor') as the recorder names the kind."""
    return comm_debug_op.rsplit(".", 1)[-1].rstrip("_")


def test_plain_dtensor_ops_carry_the_collectives_comm_debug_mode_counts(cluster4):
    cl = cluster4
    cl.run(DTENSOR_SETUP + "globals().update(dtensor_inputs())\ncounted = {}\n"
           + "".join(f"with CommDebugMode() as m:\n    {line}\n"
                     f"counted[{line!r}] = {{str(k): v for k, v in m.get_comm_counts().items()}}\n"
                     for line in DTENSOR_LINES), timeout=120)
    cl.run("globals().update(dtensor_inputs())", timeout=60)
    t = cl.trace("\n".join(DTENSOR_LINES), timeout=120)
    counted = cl.pull("counted")
    ops = t.get_ops()
    colls = t.get_collectives()
    top = ops[ops["depth"] == 0]
    assert set(top["path"]) <= {"dtensor_propagation", "dtensor_redistribute"}, set(top["path"])
    for rank in t.ranks:
        for line in DTENSOR_LINES:
            here = top[(top["rank"] == rank) & (top["user_code"] == line)]
            assert len(here), (rank, line)
            mine = colls[(colls["rank"] == rank) & colls["op_seq"].isin(here["seq"])]
            got = mine["kind"].value_counts().to_dict()
            want = {_kind(k): v for k, v in counted[rank][line].items()}
            assert got == want, (rank, line, got, want)
    # nothing ran outside the recorded ops but the setup's collectives, which ran before the trace
    assert colls["op_seq"].notna().all()
    assert set(ops.loc[ops["user_code"] == "r = h.redistribute(dmesh, [Replicate()])", "path"]) == {"dtensor_redistribute"}


# ---- one process, a full disk ----------------------------------------------------------------------------

def test_a_plain_python_job_records_one_rank_and_a_full_disk_stops_only_the_recording(tmp_path):
    script = tmp_path / "one.py"  # a DTensor on a world of one process: its calls are recorded
    # entries drawn from [0, 1) stay there under relu(x @ x.T) / 4, so the printed sum is never NaN (a randn
    # start can overflow to inf, and inf * 0 in the next matmul makes it NaN: "done False")
    script.write_text("import os, time, torch, torch.distributed as dist\n"
                      "from torch.distributed.tensor import distribute_tensor, init_device_mesh, Replicate\n"
                      + PICK_A_FREE_PORT +
                      "dist.init_process_group('gloo', rank=0, world_size=1)\n"
                      "x = distribute_tensor(torch.rand(4, 4), init_device_mesh('cpu', (1,)), [Replicate()])\n"
                      "for i in range(20):\n    x = torch.relu(x @ x.T) / 4\n"
                      "time.sleep(1.5)\nprint('done', float(x.full_tensor().sum()) >= 0)\n"
                      "dist.destroy_process_group()\n")
    # the job's own blocks: --steps 2:2 records the second block only, from its start to its end
    blocks = tmp_path / "blocks.py"
    blocks.write_text(script.read_text().replace(
        "for i in range(20):\n    x = torch.relu(x @ x.T) / 4\n",
        "import sharddbg\nfor block in range(3):\n    with sharddbg.recording():\n"
        "        for i in range(block + 1):\n            x = torch.relu(x @ x.T) / 4\n    x = x * 1.0\n"))
    import resource

    def small_files():  # a "full disk" for the job's processes: no file may grow past 6 KB
        resource.setrlimit(resource.RLIMIT_FSIZE, (6144, 6144))

    # the three recordings at once; each checked below as it was when they ran one after the other
    done, done_blocks, done_full = sharddbg_cli_all(
        ("record", "--out", tmp_path / "one", "--", sys.executable, script, {}),
        ("record", "--out", tmp_path / "blocks", "--steps", "2:2", "--", sys.executable, blocks, {}),
        ("record", "--out", tmp_path / "full", "--", sys.executable, script, {"preexec_fn": small_files}))
    assert done.returncode == 0 and "done True" in done.stdout, done.stderr
    t = sharddbg.load_trace(tmp_path / "one")
    assert t.ranks == [0] and t.incomplete_ranks == [] and t.world_size == 1
    assert (t.get_ops()["op"] == "Tensor.matmul").sum() == 20
    # sharddbg's own CPU time in the process, for the bench: some, and far less than the process's life
    lines = job_files.stream_lines(str(tmp_path / "one" / "rank-00000.arrows"))
    end, head = lines[-1]["end"], lines[0]["header"]
    own = end["sharddbg_cpu_ms"]
    assert 0 < own["background"] < 0.5 * (end["t_ns"] - head["clock"]["t_start_ns"]) / 1e6, own
    assert own["step_hook"] == 0  # the job has no optimizer

    # steps marked by the job's own blocks
    done = done_blocks
    assert done.returncode == 0 and "done True" in done.stdout, done.stderr
    t = sharddbg.load_trace(tmp_path / "blocks")
    assert list(t.get_ops()["op"]) == ["Tensor.T.__get__", "Tensor.matmul", "torch.relu", "Tensor.div"] * 2  # two rounds
    assert [ev["data"]["step"] for ev in t.events(0) if ev.get("name") == "step"] == [2]

    # a full disk: the launcher's job.json stays small; the rank's stream outgrows the limit at its first flush of
    # the matmuls (Python ignores SIGXFSZ: a write past the limit fails with EFBIG)
    done = done_full
    assert done.returncode == 0, done.stderr
    assert "done True" in done.stdout  # the job ran to its end
    assert "sharddbg: recording stopped on rank 0: writing" in done.stderr and "File too large" in done.stderr
    assert "the job goes on unrecorded" in done.stderr


def test_sigterm_while_the_job_runs_python_ends_the_stream_before_the_process_dies(tmp_path):
    # SIGTERM reaches both the main thread's handler and the background thread's wakeup fd: whichever comes
    # second must wait for the first one's last flush instead of killing the process under it
    script = tmp_path / "term.py"
    script.write_text("import os, signal, torch, torch.distributed as dist\n"
                      "from torch.distributed.tensor import distribute_tensor, init_device_mesh, Replicate\n"
                      + PICK_A_FREE_PORT +
                      "dist.init_process_group('gloo', rank=0, world_size=1)\n"
                      "x = distribute_tensor(torch.ones(8), init_device_mesh('cpu', (1,)), [Replicate()])\n"
                      "for i in range(1500):\n    x = torch.relu(x)\n"
                      "import threading\n"
                      "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
                      "a = torch.randn(700, 700)\n"
                      "while True:\n    a = torch.tanh(a @ a)\n")  # mostly inside C: the wakeup fd is first
    # three attempts at once (the race goes either way), each checked as when they ran one after the other
    runs = sharddbg_cli_all(*[("record", "--out", tmp_path / f"term{attempt}", "--", sys.executable, script, {})
                              for attempt in range(3)])
    for attempt, done in enumerate(runs):
        out = tmp_path / f"term{attempt}"
        assert done.returncode != 0, done.stdout
        job = job_files.read_job(str(out))
        assert job.ranks[0].ended, (attempt, done.stderr)
        ends = [line["end"] for line in job_files.stream_lines(str(out / "rank-00000.arrows")) if "end" in line]
        assert [e["exit"] for e in ends] == ["SIGTERM"]
        t = sharddbg.load_trace(out)
        assert (t.get_ops()["op"] == "torch.relu").sum() == 1500


# ---- bad input --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["record", "echo"], "put the command after --"),
    (["record", "--"], "nothing after --"),
    (["record", "--steps", "5:2", "--", "echo"], "--steps 5:2: the window ends before it begins; did you mean --steps 2:5?"),
    (["record", "--steps", "x", "--", "echo"], "--steps x: give a window of optimizer steps as A:B"),
    (["record", "--steps", "0:2", "--", "echo"], "steps count from 1"),
    (["record", "--hang-after", "0", "--", "echo"], "--hang-after 0: give a number of seconds above 0"),
    (["record", "--out", "/proc/sharddbg-run", "--", "echo"], "/proc/sharddbg-run"),
    (["record", "--", "no-such-program-sharddbg"], "no-such-program-sharddbg: no such program"),
])
def test_bad_arguments_are_refused_before_anything_starts(args, words, tmp_path):
    if "--out" not in args and args[1:2] != ["--"] and "echo" in args:
        args = args[:1] + ["--out", str(tmp_path / "run")] + args[1:]
    done = sharddbg_cli(*args)
    assert done.returncode == 2, done
    assert words in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # nothing was started, nothing written


def test_an_out_folder_in_use_is_refused_and_force_moves_the_old_run_aside(tmp_path):
    out = tmp_path / "run"
    assert sharddbg_cli("record", "--out", out, "--", sys.executable, "-c", "print(1)").returncode == 0
    first = json.loads((out / "job.json").read_text())["run_id"]
    done = sharddbg_cli("record", "--out", out, "--", sys.executable, "-c", "print(2)")
    assert done.returncode == 2 and "exists and is not empty" in done.stderr and "--force" in done.stderr
    done = sharddbg_cli("record", "--out", out, "--force", "--", sys.executable, "-c", "print(3)")
    assert done.returncode == 0, done.stderr
    assert (out / f"replaced-{first}" / "rank-00000.arrows").exists()  # never overwritten
    assert json.loads((out / "job.json").read_text())["run_id"] != first


def _write_stream(path: Path, lines: list[dict]) -> None:
    """A rank's stream holding ``lines``, in the format its suffix names: Arrow batches (of 50 lines) or JSON lines
    (with the header of stream version 1)."""
    if path.suffix == job_files.JSON_LINES_SUFFIX:
        head = dict(lines[0]["header"], version=1)
        path.write_text("".join(json.dumps(line) + "\n" for line in [{"header": head}, *lines[1:]]))
        return
    encoder = job_files.StreamEncoder(lines[0]["header"]["rank"])
    path.write_bytes(b"".join(encoder.encode(lines[i:i + 50]) for i in range(0, len(lines), 50)))


def test_load_trace_refuses_broken_folders_and_reads_a_cut_file_up_to_its_last_line(window_run, tmp_path):
    assert window_run.returncode == 0, window_run.output
    recorded = sharddbg.load_trace(window_run.folder)
    assert recorded._columns is not None  # the events of Arrow streams, kept as columns

    def copy(name: str, suffix: str) -> Path:
        dst = tmp_path / (name + suffix)
        shutil.copytree(window_run.folder, dst)
        if suffix == job_files.JSON_LINES_SUFFIX:  # the folder as the sharddbg before wrote it: JSON lines
            for stream in sorted(dst.glob("rank-*.arrows")):
                _write_stream(stream.with_suffix(suffix), job_files.stream_lines(str(stream)))
                stream.unlink()
        return dst

    for suffix in (job_files.STREAM_SUFFIX, job_files.JSON_LINES_SUFFIX):
        same = sharddbg.load_trace(copy("same", suffix))  # every rank's records as recorded, either format
        pd.testing.assert_frame_equal(same.get_ops(), recorded.get_ops(), check_exact=True)
        assert [same.events(r) for r in same.ranks] == [recorded.events(r) for r in recorded.ranks]

        missing = copy("missing", suffix)
        (missing / f"rank-00002{suffix}").unlink()
        with pytest.raises(TraceFileError, match=rf"rank 2 of 4 is missing \(no rank-00002{suffix}\).*allow_missing_ranks"):
            sharddbg.load_trace(missing)
        t = sharddbg.load_trace(missing, allow_missing_ranks=True)
        assert t.incomplete_ranks == [2] and "no stream in the folder" in t.incomplete_reasons[2]

        foreign = copy("foreign", suffix)
        (foreign / f"rank-00001{suffix}").write_text("step,loss\n1,0.5\n")
        with pytest.raises(TraceFileError, match=rf"rank-00001{suffix}" + (
                " line 1: not a JSON object" if suffix == ".jsonl" else ": not a sharddbg rank stream")):
            sharddbg.load_trace(foreign)

        mixed = copy("mixed", suffix)
        lines = job_files.stream_lines(str(mixed / f"rank-00003{suffix}"))
        lines[0]["header"]["run_id"] = "another-run"
        _write_stream(mixed / f"rank-00003{suffix}", lines)
        with pytest.raises(TraceFileError, match=r"two recorded runs are mixed in this folder: .* another-run"):
            sharddbg.load_trace(mixed)

        second = copy("second", suffix)  # a line the reader refuses, named by its place
        lines = job_files.stream_lines(str(second / f"rank-00003{suffix}"))
        _write_stream(second / f"rank-00003{suffix}", lines[:3] + [lines[0]] + lines[3:])
        with pytest.raises(TraceFileError, match=rf"rank-00003{suffix} (line|row) 4: a second header"):
            sharddbg.load_trace(second)

        cut = copy("cut", suffix)
        stream = cut / f"rank-00001{suffix}"
        lines = job_files.stream_lines(str(stream))
        _write_stream(stream, lines)
        data = stream.read_bytes()
        if suffix == ".jsonl":
            keep = data.rstrip(b"\n").rfind(b"\n") + 1 + 40  # the last line cut after 40 bytes
        else:  # the last batch cut after 40 bytes
            encoder = job_files.StreamEncoder(1)
            keep = len(b"".join(encoder.encode(batch) for batch in _batches(lines)[:-1])) + 40
        stream.write_bytes(data[:keep])
        t = sharddbg.load_trace(cut)
        assert 1 in t.incomplete_ranks
        reason = t.incomplete_reasons[1]
        assert "its file ends mid-record at byte" in reason and "cut after 40 bytes" in reason, reason
        flushed = {ev["seq"] for ev in t.events(1)}  # what the whole batches (lines) hold
        assert flushed and flushed <= {ev["seq"] for ev in recorded.events(1)}

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceFileError, match="is a folder, not a trace file or a recorded job"):
        sharddbg.load_trace(empty)


def _batches(lines: list[dict]) -> list[list[dict]]:
    """``lines`` in the batches ``_write_stream`` writes."""
    return [lines[i:i + 50] for i in range(0, len(lines), 50)]


@pytest.mark.parametrize("argv, agent", [
    (["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "4", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "4", "train.py"], True),
    (["python", "-m", "torch.distributed.launch", "train.py"], True),
    (["python", "train.py", "--torchrun"], False),
    (["bash", "run.sh"], False),
    (["python", "-m", "train"], False),
])
def test_each_process_tells_whether_it_is_torchruns_agent_from_its_own_command_line(argv, agent):
    """A job started through a script that calls torchrun: the agent is known by its own command, not by the
    command given to sharddbg record."""
    from sharddbg.engine.jobs.bootstrap import is_torchrun_agent

    assert is_torchrun_agent(argv) is agent
