"""The fault matrix: every case of ``tests/fault_cases.py`` FAULTS on a real 4-rank cluster (gloo), with the
collective timeout at 300 s so that nothing here ends by waiting it out. Each case asserts the first line
the user reads (cause first: which rank, what it raised, where in the cell), the time it took (bounded:
nothing hangs), that the recorded events were kept, and the state the cluster is left in. The faults that need
a short collective timeout or that stop or end a rank run last, on a 2-rank cluster of the module's own."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

import sharddbg
from sharddbg.analysis import hang
from sharddbg.analysis.hang import ordinal
from sharddbg.errors import ClusterError, RankDiedError, RankError, RankLostError, RankTimeoutError

from fault_cases import FAULTS, TABLE_END, TABLE_START, starts_with, table

pytestmark = pytest.mark.cluster

CASES = {c.name: c for c in FAULTS}
# the ranks left waiting are released by sharddbg, not by the cell's 60 s time limit or the 300 s collective
# timeout: far below both, with room for a loaded host (the release itself takes a second or two)
RELEASED_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def cl(patient_cluster4):
    return patient_cluster4


@pytest.fixture
def healthy(cl):
    """The cluster with every rank alive and a working process group (restored after each case)."""
    if cl.dead_ranks() or not _controller_alive(cl):
        cl.restart()
    elif cl.broken or cl.busy_ranks():
        cl.recover()
    yield cl
    if cl.dead_ranks() or not _controller_alive(cl):
        cl.restart()
    elif cl.broken or cl.busy_ranks():
        cl.recover()


def _controller_alive(cl) -> bool:
    return cl.controller_failure() is None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0]


def _expect(case_name: str, exc: BaseException) -> None:
    case = CASES[case_name]
    assert type(exc).__name__ == case.error, (type(exc).__name__, str(exc)[:500])
    assert starts_with(case).match(_first_line(exc)), (case.sees, _first_line(exc))


def _works(cl) -> None:
    """A collective on every rank gives the right sum."""
    assert cl.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()))") == [4.0] * 4


def test_raise_while_peers_wait(healthy):
    cl = healthy
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cl.run("x = 1\nif rank == 3:\n    raise IndexError('boom')\nt = torch.ones(3)\ndist.all_reduce(t)\n")
    elapsed = time.monotonic() - t0
    _expect("raise_while_peers_wait", info.value)
    err = info.value
    assert elapsed < RELEASED_WITHIN_S, elapsed
    assert err.causes == [3] and err.released == [0, 1, 2]
    assert err.errors[3].type_name == "IndexError" and err.errors[3].cell_line == 3
    assert all("Connection closed by peer" in err.errors[r].message for r in (0, 1, 2))
    text = str(err)
    # then who waited, and where: the collective, named as the Flight Recorder counts it outside a trace
    assert "Ranks [0, 1, 2] were waiting for rank 3 in a collective" in text
    assert re.search(r"rank 0 in all_reduce, the \d+(st|nd|rd|th) collective on process group 'domain'", text)
    assert cl.broken and "rank 3 raised IndexError: boom" in cl.broken
    cl.recover()
    assert cl.broken is None
    _works(cl)


def test_raise_inside_collective_traced(healthy):
    cl = healthy
    # ranks 0-2 enter conv2d's halo exchange; rank 3 holds no rows and fails inside the op
    code = ("from torch.distributed.tensor import Shard\n"
            "rows = [2, 2, 1, 0]\n"
            "x = ShardTensor.from_local(torch.randn(1, 3, rows[rank], 8), sharddbg.engine.domain_mesh(), (Shard(2),),\n"
            "                           sharding_shapes={0: [(1, 3, r, 8) for r in rows]})\n"
            "y = torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3), padding=1)\n")
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cl.trace(code)
    assert time.monotonic() - t0 < RELEASED_WITHIN_S + 5  # the recorder's start and stop included
    err = info.value
    _expect("raise_inside_collective", err)
    assert err.causes == [3] and err.released == [0, 1, 2]
    # nothing lost: every rank's events are in the trace, the failing op on each
    t = cl.last_trace()
    assert t.incomplete_ranks == []
    errors = t.get_errors()
    assert sorted(errors["rank"]) == [0, 1, 2, 3] and set(errors["op"]) == {"torch.conv2d"}
    assert "index_select" in errors[errors["rank"] == 3]["message"].iloc[0]
    # the collective ranks 0-2 waited in never completed: it failed when they were released (not a hang in
    # flight), and rank 3 never issued it
    colls = t.get_collectives()
    failed = colls[colls["state"] == "failed"]
    assert sorted(failed["rank"]) == [0, 1, 2] and set(failed["kind"]) == {"all_to_all_single"}
    assert not colls["in_flight"].any() and failed["error"].map(lambda e: e.startswith("RuntimeError: ")).all()
    # rank 3 skipped it because it raised: its exception is the cause, no finding says it never issued it
    assert "collective_missing" not in {f.kind for f in t.findings}
    missing = t.get_collective_mismatches()
    missing = missing[missing["problem"] == "missing"]
    assert len(missing) == 1 and "rank 3 never issued group_seq" in missing["detail"].iloc[0]


def test_raise_while_peer_computes_leads_the_timeout(healthy):
    cl = healthy
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        cl.run("import time\nif rank == 3:\n    raise IndexError('boom')\nif rank == 0:\n    time.sleep(120)\n", timeout=4)
    assert time.monotonic() - t0 < 10
    _expect("raise_while_peer_computes", info.value)
    report = info.value.report
    assert list(report.failures) == [3] and report.unfinished == [0]
    assert "ranks [0] still running; ranks [3] raised; ranks [1, 2] finished." in str(info.value)
    # recover() interrupts a rank busy in the user's own code (it waits in no collective)
    cl.recover()
    assert cl.busy_ranks() == []
    _works(cl)


def test_skip_collective_names_the_missing_rank(healthy):
    cl = healthy
    with pytest.raises(RankTimeoutError) as info:
        cl.run("t = torch.ones(3)\nif rank != 3:\n    dist.all_reduce(t)\n", timeout=3)
    _expect("skip_collective", info.value)
    text = str(info.value)
    [pending] = info.value.report.ranks[0].pending
    assert pending.missing_ranks == [3] and pending.last_seq_of[3] == pending.seq - 1
    assert f"never joined by: rank 3 (it issued {pending.seq - 1} on this group)" in text
    assert f"all_reduce, the {ordinal(pending.seq)} collective on process group 'domain'" in text
    # the group is desynchronised: the next cell is refused with why, until recover()
    with pytest.raises(ClusterError) as refused:
        cl.run("print(1)")
    assert _first_line(refused.value).startswith("The process group broke at the cell: ranks [0, 1, 2] were left "
                                                 "waiting in a collective after 3 s")
    t0 = time.monotonic()
    cl.recover()
    assert time.monotonic() - t0 < 10
    _works(cl)


def test_sizes_that_disagree_are_named(healthy):
    cl = healthy
    with pytest.raises(RankTimeoutError) as info:
        cl.run("t = torch.ones(3 if rank == 1 else 4)\ndist.all_reduce(t)\n", timeout=3)
    _expect("sizes_disagree", info.value)
    assert "issued differently by: rank 1: all_reduce, input [3]" in str(info.value)


def test_broken_group_refused_and_status_says_why(healthy):
    cl = healthy
    with pytest.raises(RankError):
        cl.run("if rank == 1:\n    raise ValueError('stop')\nt = torch.ones(2)\ndist.all_reduce(t)\n")
    with pytest.raises(ClusterError) as info:
        cl.run("print(1)")
    _expect("broken_group_refused", info.value)
    assert "rank 1 raised ValueError: stop" in _first_line(info.value) and "cl.recover()" in str(info.value)
    status = cl.status()
    assert set(status["state"]) == {"idle"}
    assert all(s.startswith("broken at the cell: rank 1 raised ValueError: stop") for s in status["process_group"])
    # inspecting variables still works on a broken group
    assert cl.eval("rank") == [0, 1, 2, 3]


def test_rank_killed_then_calls(healthy):
    cl = healthy
    t0 = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        cl.run("import os, signal\nif rank == 2:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
               "t = torch.ones(2)\ndist.all_reduce(t)\n")
    assert time.monotonic() - t0 < 15
    _expect("rank_killed", info.value)
    assert info.value.dead == {2: "killed by signal 9 (SIGKILL)"}
    assert "rank 2 (pid " in str(info.value) and "killed by signal 9 (SIGKILL)" in str(info.value)
    # the advice is restart(), not recover(): a dead rank cannot join a re-created group
    assert "cl.recover() cannot re-create the group: run cl.restart()" in str(info.value)
    # the survivors were released from the collective with the dead rank, not left waiting
    assert cl.busy_ranks() == []
    status = cl.status()
    assert status.loc[2, "state"] == "dead: killed by signal 9 (SIGKILL)"
    assert list(status.loc[[0, 1, 3], "state"]) == ["idle"] * 3
    # a call that needs the dead rank: one ClusterError naming it; healthy ranks still answer
    for call in (lambda: cl.run("print(1)"), lambda: cl.eval("rank"), lambda: cl.recover()):
        with pytest.raises(ClusterError) as dead:
            call()
        _expect("call_needs_dead_rank", dead.value)
        assert "killed by signal 9 (SIGKILL)" in str(dead.value) and "restart()" in str(dead.value)
    assert cl.eval("rank", targets=[0, 1, 3]) == [0, 1, 3]
    with pytest.raises(ClusterError, match=r"(?s)The process group broke at .*Rank 2 cannot take part any more "
                                           r"\(rank 2: dead, killed by signal 9 \(SIGKILL\)\), so cl.recover\(\) "
                                           r"cannot re-create the group: run cl.restart\(\)"):
        cl.run("print(1)", targets=[0, 1, 3])
    cl.restart()
    _works(cl)


def test_rank_segfault(healthy):
    cl = healthy
    with pytest.raises(RankDiedError) as info:
        cl.run("import ctypes\nif rank == 1:\n    ctypes.string_at(0)\n")
    _expect("rank_segfault", info.value)
    assert info.value.dead == {1: "killed by signal 11 (SIGSEGV)"}
    cl.restart()


def test_rank_died_during_a_trace_keeps_the_others_events(healthy):
    cl = healthy
    code = ("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)\ny = x * 2\n"
            "if rank == 1:\n    import os\n    os._exit(3)\nz = y.full_tensor()\n")
    with pytest.raises(RankDiedError) as info:
        cl.trace(code)
    _expect("rank_died_traced", info.value)
    t = cl.last_trace()
    assert t.meta["code"] == code  # this cell's trace, not the previous one
    assert t.incomplete_ranks == [1]
    assert t.incomplete_reasons[1] == "its process died (exited with status 3); its events are lost"
    ops = t.get_ops()
    assert sorted(set(ops["rank"])) == [0, 2, 3]
    for r in (0, 2, 3):  # every survivor's multiply and its failed full_tensor are there
        mine = ops[ops["rank"] == r]
        assert "Tensor.mul" in set(mine["op"]) or "torch.mul" in set(mine["op"])
        assert "ShardTensor.full_tensor" in set(mine["op"])
    cl.restart()


def test_controller_killed(healthy):
    cl = healthy
    pid = cl.controller_pid
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None
    for call in (cl.busy_ranks, cl.status, lambda: cl.run("print(1)"), cl.recover):
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as info:
            call()
        assert time.monotonic() - t0 < 15
        _expect("controller_killed", info.value)
        assert f"the controller (pid {pid}) died: killed by signal 9 (SIGKILL)" in str(info.value)
    cl.restart()
    _works(cl)


def test_docs_table_is_generated_from_the_cases():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "faults.md")).read()
    m = re.search(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), page, re.DOTALL)
    assert m, "docs/faults.md lacks the generated fault table"
    assert m.group(0) == table(), ("the fault table of docs/faults.md is stale: paste the output of "
                                   "`python tests/fault_cases.py`")


def test_tracebacks_show_the_users_code(healthy, monkeypatch):
    """In IPython a sharddbg error shows the user's cell and the message, not sharddbg's frames; on the rank,
    the recorder's wrapper frames are left out of the user's traceback. SHARDDBG_DEBUG=1 shows them all."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "sharddbg")
    # a conv whose weight has the wrong channel count fails inside physicsnemo's handler, under the
    # recorder's __torch_function__ wrapper
    cell = ("%%shard_trace --quiet\nx = sharddbg.engine.scatter(torch.randn(1, 3, 8, 8), dim=2)\n"
            "y = torch.nn.functional.conv2d(x, torch.randn(4, 5, 3, 3), padding=1)\n")
    with capture_output() as cap:
        ip.run_cell(cell)
    shown = cap.stdout + cap.stderr
    assert "RankError" in shown and "ranks [0, 1, 2, 3] raised RuntimeError" in shown
    assert "(line 2 of the cell: `y = torch.nn.functional.conv2d(x, torch.randn(4, 5, 3, 3), padding=1)`)" in shown
    assert "sharddbg/cluster" not in shown and "sharddbg/magics.py" not in shown
    assert "sharddbg/engine/recorder" not in shown  # the ranks' tracebacks inside the message, too
    assert "skipping hidden" in shown  # IPython on the rank says that it left frames out
    monkeypatch.setenv("SHARDDBG_DEBUG", "1")
    with capture_output() as cap:
        ip.run_cell(cell)
    shown = cap.stdout + cap.stderr
    assert "sharddbg/cluster/execution.py" in shown and "sharddbg/magics.py" in shown


def test_an_error_outside_every_op_is_in_the_trace(healthy):
    cl = healthy
    with pytest.raises(RankError) as info:
        cl.trace("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)\ny = x + x\nif rank == 2:\n"
                 "    [][1]\nz = y.full_tensor()\n")
    assert _first_line(info.value) == "rank 2 raised IndexError: list index out of range (line 4 of the cell: `[][1]`)"
    t = cl.last_trace()
    errors = t.get_errors()
    mine = errors[errors["rank"] == 2].iloc[0]
    assert (mine["op"], mine["exc_type"], mine["message"], mine["user_frame"], mine["cell_line"], mine["cell_code"]) == (
        "<outside recorded ops>", "IndexError", "list index out of range", "line 4 of the cell", 4, "[][1]")
    assert "IndexError: list index out of range" in mine["traceback"]
    # the others failed in full_tensor's gather, released: their rows name the op and the same cell line
    others = errors[errors["rank"] != 2]
    assert sorted(others["rank"]) == [0, 1, 3] and set(others["op"]) == {"ShardTensor.redistribute"}
    assert set(others["cell_line"]) == {5}
    cells = t.get_cell_errors()
    assert sorted(cells["rank"]) == [0, 1, 2, 3] and cells.loc[cells["rank"] == 2, "origin_seq"].isna().all()
    # survives saving
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        again = sharddbg.load_trace(t.save(os.path.join(d, "t.sdtrace.json")))
    assert again.get_errors().equals(errors)


@pytest.fixture(scope="module")
def short_cluster2():
    """2 ranks of the module's own, with a short collective timeout (3 s): for the faults that break ranks, one
    after the other, each leaving the cluster sound (recover() or restart()). Its tests come last: once it has
    started, it is the active cluster (the magics' one)."""
    cl2 = sharddbg.Cluster(n=2, timeout=60, collective_timeout=3)
    cl2.start()
    yield cl2
    if cl2.running:
        cl2.stop()


@pytest.fixture
def healthy2(short_cluster2):
    """The 2-rank cluster with both ranks alive and a working process group (restored after each case)."""
    _restore(short_cluster2)
    yield short_cluster2
    _restore(short_cluster2)


def _restore(cl) -> None:
    unregistered = set(cl.engine_ids) - set(cl.client.ids)  # engines ipyparallel let go
    if cl.dead_ranks() or unregistered or not _controller_alive(cl):
        cl.restart()
    elif cl.broken or cl.busy_ranks():
        cl.recover()


def test_collective_timeout_inside_gloo(healthy2):
    """gloo's own collective timeout fails the waiting rank: the error leads with the rank that never issued the
    collective (the ranks' Flight Recorders say so), then the timeout; the group is broken and said so."""
    cl2 = healthy2
    code = "t = torch.ones(3)\nif rank == 0:\n    out = [torch.zeros(3) for _ in range(2)]\n    dist.all_gather(out, t)\n"
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cl2.run("for _ in range(3):\n    dist.all_reduce(torch.ones(3))\n" + code)
    assert time.monotonic() - t0 < 30
    _expect("collective_timeout", info.value)
    text = str(info.value)
    found = re.match(r"rank 1 never issued the all_gather rank 0 waited in \(the (\d+)(st|nd|rd|th) collective on "
                     r"process group 'domain' since it was created\)\.\n\nThen rank 0 raised RuntimeError: Timed out "
                     r"waiting 3000ms", text)
    assert found, text[:400]
    assert cl2.broken is not None and "rank 1 never issued the all_gather" in cl2.broken
    with pytest.raises(ClusterError, match="The process group broke at"):
        cl2.run("print(1)")
    cl2.recover()
    # in a trace, the collective is named by the trace's own group_seq, as get_collective_mismatches() names it
    with pytest.raises(RankError) as info:
        cl2.trace(code, display=False)
    t = cl2.last_trace()
    missing = t.get_collective_mismatches()
    [seq] = missing.loc[missing["problem"] == "missing", "group_seq"]
    assert _first_line(info.value) == f"rank 1 never issued the all_gather rank 0 waited in (group_seq {seq} of this trace on 'domain')."
    # the trace says the same, cause first, and counts the timed-out collective as failed, not in flight
    (coll,) = t.get_collectives().itertuples(index=False)
    assert (coll.rank, coll.kind, coll.state, coll.in_flight) == (0, "all_gather", "failed", False)
    assert "Timed out" in coll.error
    first, second = t.findings[:2]
    assert (first.kind, first.severity, first.ranks) == ("collective_missing", "fail", (1,))
    assert first.sentence.startswith(f"rank 1 never issued the all_gather rank 0 waited in until it failed "
                                     f"(group_seq {seq} on 'domain')"), first.sentence
    assert "`dist.all_gather(out, t)`" in first.sentence and "what rank 0 raised follows from it" in first.fix
    assert (second.kind, second.ranks) == ("error", (0,)) and "raised RuntimeError: " in second.sentence
    assert "Timed out" in second.sentence
    assert "collective_unfinished" not in {f.kind for f in t.findings}
    # the Flight Recorder still holds the destroyed group's entries under the same name: only the new group's count
    [unissued] = hang.unissued_collectives(cl2.diagnose(), [0])
    assert unissued.seq == int(found.group(1)) - 3 and unissued.missing_ranks == [1]
    cl2.recover()
    assert cl2.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()))") == [2.0, 2.0]


def test_status_names_a_process_group_destroyed_on_one_rank(healthy2):
    cl2 = healthy2
    cl2.run("if rank == 1:\n    dist.destroy_process_group()\n")
    status = cl2.status(full=True)
    assert list(status["dist_initialized"]) == [True, False]
    assert set(status["process_group"]) == {"broken: torch.distributed is not initialized on rank 1 (its process "
                                            "group was destroyed there); cl.recover() brings it up again"}
    assert list(cl2.status()["state"]) == ["idle", "idle"]
    cl2.recover()
    assert set(cl2.status()["process_group"]) == {"ok"}


def test_exit_in_a_cell_ends_the_rank_and_says_so(healthy2):
    cl2 = healthy2
    # sys.exit() does not end an engine: IPython catches SystemExit, and the rank goes on
    with pytest.raises(RankError, match="rank 1 raised SystemExit: 3"):
        cl2.run("import sys\nsys.exit(3)", targets=[1])
    assert list(cl2.status()["state"]) == ["idle", "idle"]
    # exit() does: the cell that called it says so, and status() shows the rank dead at once
    pid = cl2.pids[1]
    with pytest.raises(RankDiedError) as info:
        cl2.run("print('bye')\nexit()", targets=[1])
    _expect("exit_in_cell", info.value)
    assert f"rank 1 (pid {pid}) ended its engine" in str(info.value) and "cl.restart()" in str(info.value)
    assert list(info.value.dead) == [1]
    assert cl2.status().loc[1, "state"].startswith("dead: exited with status")
    with pytest.raises(ClusterError, match=r"rank 1 \(pid \d+\) exited with status"):
        cl2.eval("rank")
    cl2.restart()
    assert cl2.eval("rank") == [0, 1]


def test_a_stalled_rank_is_named_and_restart_replaces_it(healthy2):
    """A rank stopped (SIGSTOP; in life a debugger, swapping) longer than ipyparallel's heartbeat allows is
    unregistered while its process lives: the cell names it, status() shows it, every call that needs it
    raises one RankLostError (not KeyError), also once its process goes on; restart() replaces it."""
    cl2 = healthy2
    pid = cl2.pids[1]
    t0 = time.monotonic()
    with pytest.raises(RankLostError) as info:
        cl2.trace("x = sharddbg.engine.scatter(torch.randn(1, 3, 8, 8), dim=2)\ny = x * 2\nimport os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n")
    try:
        assert time.monotonic() - t0 < 30
        _expect("rank_stalled", info.value)
        assert list(info.value.lost) == [1] and "cl.restart()" in str(info.value)
        assert cl2.lost_ranks() == {1: "stopped (SIGSTOP, or a debugger holds it)"}
        # the trace keeps the other rank's events
        t = cl2.last_trace()
        assert t.incomplete_ranks == [1] and "ipyparallel unregistered its engine" in t.incomplete_reasons[1]
        assert set(t.get_ops()["rank"]) == {0}
        status = cl2.status()
        assert status.loc[0, "state"] == "idle"
        assert status.loc[1, "state"].startswith("lost: it stopped answering ipyparallel's heartbeat")
        for call in (lambda: cl2.run("print(1)"), lambda: cl2.eval("rank"), cl2.recover):
            with pytest.raises(RankLostError) as lost:
                call()
            _expect("call_needs_lost_rank", lost.value)
        assert cl2.eval("rank", targets=[0]) == [0]
    finally:
        os.kill(pid, signal.SIGCONT)
    # going on does not bring it back: ipyparallel never re-registers an engine it unregistered
    time.sleep(2)
    with pytest.raises(RankLostError, match="its process is alive"):
        cl2.eval("rank")
    assert cl2.status().loc[1, "state"].startswith("lost:")
    cl2.restart()
    assert cl2.pids[1] != pid and not sharddbg.cluster.processes.pid_alive(pid)
    assert cl2.eval("(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(()))") == [2.0, 2.0]
