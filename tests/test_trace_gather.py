"""Cluster.trace on a real cluster when a rank hangs: bounded, partial events kept and marked."""

import time

import pytest

import sharddbg
from sharddbg.errors import RankTimeoutError

pytestmark = pytest.mark.cluster

HANGING_CELL = """
y = F.conv2d(x, torch.ones(2, 1, 3, 3), padding=1)
if rank == 0:
    dist.all_reduce(torch.ones(8))   # the others never join
"""


def test_a_rank_that_times_out_keeps_its_events(cluster4):
    cluster4.run("x = sharddbg.engine.scatter(torch.randn(1, 1, 66, 8), dim=2)", display=False)
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        cluster4.trace(HANGING_CELL, timeout=3, display=False)
    assert time.monotonic() - t0 < 3 + 15
    assert info.value.report.unfinished == [0]
    # the hung rank's events came with its diagnosis, answered by its control thread
    recording = info.value.report.diagnoses[0]["recording"]
    assert recording["rank"] == 0 and recording["complete"] is False
    trace = sharddbg.last_trace()
    assert trace is cluster4.last_trace()
    assert trace.incomplete_ranks == [0]
    assert trace.meta["failed"].startswith("RankTimeoutError")
    ops = trace.get_ops()
    conv = ops[ops["op"].str.contains("conv2d") & (ops["phase"] == "forward")]
    # every rank, the hung one included, recorded the conv before the hang, with its own local rows
    assert sorted(conv["rank"]) == [0, 1, 2, 3]
    assert [s[0][2] for s in conv.sort_values("rank")["in_local_shapes"]] == [17, 17, 16, 16]
    cluster4.recover()
    assert cluster4.eval("dist.get_world_size()") == [4] * 4
    # after recovery the recorder is off again on every rank, and a new trace works
    assert cluster4.eval("sharddbg.engine.api.is_recording()") == [False] * 4
