"""Cluster.trace on a real cluster: a big cell's records gathered as columns; when a rank hangs: bounded, partial
events kept and marked."""

import time

import pandas as pd
import pytest

import sharddbg
from sharddbg import columnar
from sharddbg.cluster import recording
from sharddbg.errors import RankTimeoutError
from sharddbg.trace import Trace

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


BIG_CELL = """
for _ in range(30):  # 60 op records on every rank, sent as columns where a rank's records are "many" from 50 on
    y = xs + 1
    y = y * 2
dist.all_reduce(torch.ones(4))
"""


def test_a_big_cell_is_gathered_as_columns_equal_to_its_records(cluster4, tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "COLUMNS_FROM", 50)  # what "big" means, lowered: the test stays quick
    cluster4.run("xs = sharddbg.engine.scatter(torch.arange(64.).reshape(1, 1, 16, 4), dim=2)", display=False)
    t = cluster4.trace(BIG_CELL, display=False)
    assert all(isinstance(p["events"], columnar.LazyRecords) and not p["events"].made for p in t.payloads.values())
    assert min(len(p["events"]) for p in t.payloads.values()) >= 60
    # the records the recorders made, as dicts (a stopped recorder's peek gives its last payload)
    recorded = cluster4.eval("sharddbg.engine.api.recording_peek()")
    as_dicts = Trace.from_payloads(recorded, t.clock_offsets_ns, meta=dict(t.meta))
    pd.testing.assert_frame_equal(t.get_ops(), as_dicts.get_ops(), check_exact=True)
    pd.testing.assert_frame_equal(t.get_collectives(), as_dicts.get_collectives(), check_exact=True)
    assert len(t.get_collectives()) == 4
    assert [t.events(r) for r in t.ranks] == [p["events"] for p in recorded]
    # saved as columns, the table it holds is written as it is
    loaded = sharddbg.load_trace(t.save(tmp_path / "big.sdtrace.arrow"))
    pd.testing.assert_frame_equal(loaded.get_ops(), as_dicts.get_ops(), check_exact=True)
