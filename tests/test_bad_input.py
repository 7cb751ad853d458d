"""The bad-input sweep: every case of ``tests/fault_cases.py`` BAD_INPUT gives its clear error before anything
runs on a rank (a cell that would have set a marker did not run), the same error on every rank where the
ranks decide (scatter), on a real 4-rank cluster."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import sharddbg
from sharddbg.errors import ClusterError, RankError

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


# name -> what the user does (a function of the cluster and the shell)
ACTIONS = {
    "timeout_nan": lambda cl, ip: sharddbg.Cluster(n=2, timeout=float("nan")),
    "collective_timeout_inf": lambda cl, ip: sharddbg.Cluster(n=2, collective_timeout=float("inf")),
    "threads_word": lambda cl, ip: sharddbg.Cluster(n=2, threads_per_rank="x"),
    "too_many_ranks": lambda cl, ip: sharddbg.Cluster(n=1000),
    "run_timeout_word": lambda cl, ip: cl.run(MARK, timeout="abc"),
    "run_no_targets": lambda cl, ip: cl.run(MARK, targets=[]),
    "run_bad_target": lambda cl, ip: cl.run(MARK, targets=[7]),
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
ERRORS = {"ClusterError": ClusterError, "UsageError": UsageError, "RankError": RankError}


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
