"""Shared real clusters: starting one costs ~7 s on 2 cores, so tests share them per session/module."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


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
