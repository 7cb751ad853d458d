"""Shared real clusters: starting one costs ~7 s on 2 cores, so tests share them per session/module."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import in_background
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def check_comm_tables_add_up(trace) -> None:
    """The communication tables of ``trace`` count every collective once and agree with each other.

    - The self (exclusive) collectives of ``get_op_summary(nested=True)`` add up to the collectives issued inside
      recorded ops: the trace's collectives less those of no recorded op, which ``get_comm_by_op()`` lists
      under ``<outside recorded ops>`` (or as DDP buckets), and less any whose op record the trace lacks (a
      hand-made trace, or events dropped).
    - ``get_comm_by_op()`` counts each collective once; per op, its ``n_collectives`` over the ranks are the
      nested summary's (both phases), its ``own_calls`` the user's own forward calls (depth 0, what
      ``get_op_summary()`` counts), and ``own_calls + nested_calls == calls``.

    Called on every trace the test session builds (``_every_trace_is_checked``); cheap: the two tables, built in
    plain Python, and a few groupbys.
    """
    import pandas as pd

    from sharddbg.analysis.ops import NO_OP
    from sharddbg.schema import DDP_BUCKET_OP

    colls, ops = trace.get_collectives(), trace.get_ops()
    nested = trace.get_op_summary(nested=True)
    by_op = trace.get_comm_by_op()
    recorded = set(zip(ops["rank"].astype(int), ops["seq"].astype(int)))
    named = colls[colls["op_seq"].notna()]
    in_record = pd.Series([(int(r), int(s)) in recorded for r, s in zip(named["rank"], named["op_seq"])],
                          index=named.index, dtype=bool)
    inside, orphans = named[in_record], named[~in_record]
    no_call = by_op[by_op["op"].isin([NO_OP, DDP_BUCKET_OP]) & (by_op["calls"] == 0)]
    summed = int(nested["n_collectives"].sum())
    assert summed == len(inside) == len(colls) - int(no_call["n_collectives"].sum()) - len(orphans), (
        f"get_op_summary(nested=True) counts {summed} self collectives; of {len(colls)}, "
        f"{int(no_call['n_collectives'].sum())} are under {NO_OP!r} / DDP buckets, {len(orphans)} name an op "
        f"record the trace lacks, {len(inside)} were issued inside recorded ops")
    assert int(by_op["n_collectives"].sum()) == len(colls), "get_comm_by_op() must count every collective once"
    if len(by_op):
        assert (by_op["own_calls"] + by_op["nested_calls"] == by_op["calls"]).all()
        per_op = by_op.groupby("op")[["n_collectives", "own_calls"]].sum()
        orphans_per_op = orphans.groupby("op").size()
        for op, n in nested.groupby("op")["n_collectives"].sum().items():
            expected = int(n) + int(orphans_per_op.get(op, 0))
            assert int(per_op["n_collectives"].get(op, 0)) == expected, f"{op}: the tables disagree on its collectives"
        # the user's own forward calls (depth 0), what get_op_summary() counts, from the op records themselves
        own = ops[(ops["phase"] == "forward") & (ops["depth"] == 0)].groupby("op").size()
        fwd_ops = per_op[per_op["own_calls"] > 0]["own_calls"]
        assert {k: int(v) for k, v in own.items()} == {k: int(v) for k, v in fwd_ops.items()}, \
            "get_comm_by_op()'s own_calls are the forward calls get_op_summary() counts"


def check_tables_built_by_column_match_by_record(trace) -> None:
    """``get_ops()`` and ``get_collectives()`` (built a column at a time) are exactly the tables built a row at
    a time (the builders they replaced): values, dtypes, columns and order. Called on every trace the session builds, real recordings
    included (``_every_trace_is_checked``)."""
    import pandas as pd

    from sharddbg.analysis import comm as comm_analysis
    from sharddbg.analysis import ops as ops_analysis

    by_record = ops_analysis.ops_frame_by_record(trace._events_by_rank(), trace.clock_offsets_ns)
    pd.testing.assert_frame_equal(trace.get_ops(), by_record, check_exact=True)
    by_record = comm_analysis.collectives_frame_by_record(trace._events_by_rank(), trace.clock_offsets_ns)
    pd.testing.assert_frame_equal(trace.get_collectives(), by_record, check_exact=True)


_BUILT_TRACES: list = []  # every Trace built since the last check


@pytest.fixture(scope="session", autouse=True)
def _traces_are_remembered():
    """Every Trace the session builds (``Trace.__init__``: from payloads, from a file, from a cluster) is
    remembered for ``_every_trace_is_checked``."""
    from sharddbg.trace import Trace

    built = Trace.__init__

    def remembering_init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        _BUILT_TRACES.append(self)

    Trace.__init__ = remembering_init
    yield
    Trace.__init__ = built


@pytest.fixture(autouse=True)
def _every_trace_is_checked(_traces_are_remembered):
    """After each test: ``check_comm_tables_add_up`` on every trace built since the last check (the test's
    own, and those of the fixtures set up for it)."""
    yield
    while _BUILT_TRACES:
        trace = _BUILT_TRACES.pop()
        check_comm_tables_add_up(trace)
        check_tables_built_by_column_match_by_record(trace)


def _start(**kwargs):
    import sharddbg

    cl = sharddbg.Cluster(**kwargs)
    cl.start()
    return cl


@pytest.fixture(scope="session")
def cluster4():
    """4 CPU ranks, mesh ddp=1 x domain=4, physicsnemo patches registered."""
    cl = _start(n=4, mesh={"ddp": 1, "domain": 4}, timeout=120)
    yield cl
    if cl.running:
        cl.stop()


@dataclass
class _HandedOn:
    """A module cluster kept for the module that runs next and asks for the same one: the cluster, and the
    variables each rank's namespace held right after it started (what a module added is deleted before the next
    module gets it)."""

    cluster: object
    names_at_start: list[list[str]]


# fixture name -> the cluster the module that just ended left for the next one
_HANDED_ON: dict[str, _HandedOn] = {}
# the variables a namespace held right after the start, on each rank
_NAMES_NOW = "sorted(globals())"


def _forget_what_the_module_added(kept: _HandedOn) -> None:
    """Delete on every rank the variables the modules added since the start, then collect garbage: the next
    module sees the namespace of a fresh cluster (a check that looks at every variable finds only its own)."""
    for rank, names in enumerate(kept.names_at_start):
        kept.cluster.run(f"for _sd_name in set(globals()) - set({names!r}) - {{'_sd_name'}}:\n"
                         "    del globals()[_sd_name]\n"
                         "globals().pop('_sd_name', None)\n"
                         "__import__('gc').collect()", targets=[rank], timeout=60, display=False)


def _sound(cl, mesh_shape: tuple[int, ...]) -> bool:
    """Every rank alive and idle, the process group working (an all_reduce on the world gives the world size)
    and the mesh the fixture made: a cluster the previous module left so may be handed on."""
    try:
        if not cl.running or cl.dead_ranks() or cl.broken or cl.busy_ranks():
            return False
        world = cl.eval("(lambda t: (dist.all_reduce(t), int(t.item()))[1])(torch.ones(()))", timeout=30)
        return world == [cl.n] * cl.n and cl.eval("tuple(mesh.shape)", timeout=30) == [mesh_shape] * cl.n
    except Exception:  # noqa: BLE001 - any failure means: start a fresh one
        return False


def _next_module_asks_for(request, name: str) -> bool:
    """Whether the module that runs right after this one (in the session's order) uses fixture ``name``."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.path == request.node.path]
    if not mine or mine[-1] + 1 >= len(items):
        return False
    following = items[mine[-1] + 1]
    return any(name in item.fixturenames for item in items if item.path == following.path)


def _module_cluster(request, name: str, mesh_shape: tuple[int, ...], **kwargs):
    """A 4-rank cluster for one module: the one the previous module handed on when it is sound (its namespace
    cleared of what that module added), else a fresh one; handed on to the next module when that one asks for
    the same fixture (modules that do are run one after the other), else stopped. One cluster start for a run of
    modules instead of one each, and never two of these clusters at once."""
    kept = _HANDED_ON.pop(name, None)
    if kept is not None and not _sound(kept.cluster, mesh_shape):
        if kept.cluster.running:
            kept.cluster.stop()
        kept = None
    if kept is None:
        cl = _start(**kwargs)
        kept = _HandedOn(cl, [list(names) for names in cl.eval(_NAMES_NOW)])
    else:
        _forget_what_the_module_added(kept)
        # and on this side what the cluster keeps of the previous module's calls: a fresh cluster has no last
        # trace and no last check (the doctor reads both)
        kept.cluster._tracer.last = None
        kept.cluster._last_check = None
    yield kept.cluster
    if kept.cluster.running and _next_module_asks_for(request, name):
        _HANDED_ON[name] = kept
    elif kept.cluster.running:
        kept.cluster.stop()


@pytest.fixture(scope="session", autouse=True)
def _handed_on_clusters_are_stopped():
    """A cluster kept for a next module that never ran (a run stopped early) is stopped at the session's end."""
    yield
    while _HANDED_ON:
        _, kept = _HANDED_ON.popitem()
        if kept.cluster.running:
            kept.cluster.stop()


@pytest.fixture(scope="module")
def patient_cluster4(request):
    """A 4-rank cluster of the module's own (handed on to the next module that asks for it when sound, its
    namespace cleared) whose collective timeout (300 s) no test may wait out: what ends a fault there is
    sharddbg noticing it."""
    yield from _module_cluster(request, "patient_cluster4", (1, 4), n=4, mesh={"ddp": 1, "domain": 4}, timeout=60,
                               collective_timeout=300)


@pytest.fixture(scope="module")
def cluster22(request):
    """A 4-rank cluster on a ddp=2 x domain=2 mesh for the module (handed on to the next module that asks for it
    when sound, its namespace cleared: what the module sets up stays there for its own tests only)."""
    yield from _module_cluster(request, "cluster22", (2, 2), n=4, mesh={"ddp": 2, "domain": 2}, timeout=120)


# the module-scoped clusters that a run of modules shares (``_module_cluster``)
HANDED_ON_FIXTURES = ("cluster22", "patient_cluster4")


def pytest_collection_modifyitems(config, items):
    """Run the tests that start their own clusters (notebooks, browser, lifecycle, magics) first, before
    the shared cluster4 exists: never two clusters at once on a small machine, and the magics' "no
    cluster running" errors are tested while none runs. Among them, the modules that use the same handed-on
    fixture (``HANDED_ON_FIXTURES``) run one after the other, so that one cluster start serves them all, in the
    order below (test_scatter_input.py first: its first test starts a 2x2 cluster of its own, while no other
    runs; test_doctor.py first of cluster22's: the doctor reads everything the ranks hold). test_setup.py runs
    last of all: its clean install, started with the session (``pytest_collection_finish``), has had the whole
    session to finish beside the other tests."""
    own = ("test_browser.py", "test_notebooks.py", "test_lifecycle.py", "test_magics.py", "test_processes.py",
           "test_scatter_input.py", "test_faults.py", "test_bad_input.py", "test_doctor.py", "test_replicas.py",
           "test_analysis_real.py")
    very_last = "test_setup.py"
    # cl.smoke() rebuilds cluster4's mesh per configuration (restored at the end, but tensors built on the mesh
    # before are stale then): its module runs after every other that uses cluster4
    last = ("test_smoke.py",)
    # the engine launchers' and the recorded jobs' tests run in a second pytest process beside the session
    # (``in_background``), and their stand-ins, which wait for its results, come late
    handed_on: dict = {}  # module -> the handed-on fixture it uses ("" for none)
    for item in items:
        fixture = next((name for name in HANDED_ON_FIXTURES if name in item.fixturenames), "")
        handed_on[item.path] = max(handed_on.get(item.path, ""), fixture)

    def order(item):
        name = item.path.name
        if name == very_last:
            return 2, "", 1
        if name in in_background.BACKGROUND_MODULES:  # run beside the session: their results are read late
            return 2, "", 0
        if name in own:
            return 0, handed_on[item.path], own.index(name)
        return 1, handed_on[item.path], name in last

    items.sort(key=order)


def pytest_collection_finish(session):
    """The engine launchers' and recorded jobs' selected tests start in a second pytest process (``in_background``). When the
    session runs a test of tests/test_setup.py that needs its clean install: clone and start the install now,
    in a process of its own (``setup_in_background``), so that its minutes of pip, unzip and npm overlap with
    the other tests; test_setup.py's fixtures wait for its results."""
    if session.config.option.collectonly:
        return
    # after every plugin's selection (-k, -m, deselected): what is left of the background modules starts now
    in_background.hand_over(session.items, Path(__file__).resolve().parent.parent)
    needs_install = [item for item in session.items
                     if item.path.name == "test_setup.py" and "demo_installed" in item.fixturenames]
    if needs_install:
        import setup_in_background
        from test_setup import REPO, SETUP_FILES

        setup_in_background.start_for(REPO, SETUP_FILES)


def pytest_runtest_setup(item):
    """The engine launchers' and recorded jobs' tests start beside the session once it is past the browser and notebook tests."""
    in_background.start_when_due(item)


def pytest_sessionfinish(session):
    """Whatever ended the session (a failure with -x, Ctrl-C): the clean install's lifeline is closed, so nothing
    of it is left running or on disk (its helper also sees the lifeline close if this process is killed)."""
    import sys

    background = sys.modules.get("setup_in_background")
    if background is not None:
        background.end_for_good()
    in_background.end_for_good()
