"""Shared real clusters: starting one costs ~7 s on 2 cores, so tests share them per session/module."""

from __future__ import annotations

import os

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
        check_comm_tables_add_up(_BUILT_TRACES.pop())


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


@pytest.fixture(scope="module")
def patient_cluster4():
    """A 4-rank cluster of the module's own whose collective timeout (300 s) no test may wait out: what
    ends a fault there is sharddbg noticing it."""
    cl = _start(n=4, mesh={"ddp": 1, "domain": 4}, timeout=60, collective_timeout=300)
    yield cl
    if cl.running:
        cl.stop()


@pytest.fixture(scope="module")
def cluster22():
    """A 4-rank cluster of the module's own on a ddp=2 x domain=2 mesh (what the module sets up stays there)."""
    cl = _start(n=4, mesh={"ddp": 2, "domain": 2}, timeout=120)
    yield cl
    if cl.running:
        cl.stop()


def pytest_collection_modifyitems(config, items):
    """Run the tests that start their own clusters (notebooks, browser, lifecycle, magics) first, before
    the shared cluster4 exists: never two clusters at once on a small machine, and the magics' "no
    cluster running" errors are tested while none runs."""
    own = ("test_browser.py", "test_notebooks.py", "test_lifecycle.py", "test_magics.py", "test_processes.py",
           "test_scatter_input.py", "test_faults.py", "test_bad_input.py", "test_analysis_real.py",
           "test_setup.py", "test_replicas.py", "test_doctor.py", "test_smoke.py")
    items.sort(key=lambda item: 0 if item.path.name in own else 1)
