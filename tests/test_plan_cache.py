"""DTensor's redistribution plan cache, watched while recording (real 4-rank CPU cluster, physicsnemo's
ShardTensor).

The real case: every training step of a sharded net whose loss is a Partial scalar calls ``loss.backward()``,
which redistributes the loss to Replicate through ``ShardTensor.redistribute``; physicsnemo fills in the
target spec's ``_sharding_shapes`` after DTensor cached the plan under that spec, so the next step misses
and adds an entry. The independent source for every count is the cache itself, read by the cell on each rank
(``cache_info().currsize``) and the number of steps the cell ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sharddbg import schema
from sharddbg.analysis.findings import plan_cache_finding
from sharddbg.analysis.plan_cache import CLEAR_CALL, plan_cache_frame, plan_cache_growth
from sharddbg.cluster import doctor as dr
from sharddbg.cluster.doctor import DoctorError
from sharddbg.magics import trace_summary
from sharddbg.trace import Trace, load_trace
from sharddbg.views import explorer

N = 4
STEPS = 3

SETUP = """
from torch.distributed.tensor._redistribute import _gen_transform_infos as _plan_cache
import torch.distributed.tensor._redistribute as _redistribute_module
_planner = _redistribute_module._gen_transform_infos_non_cached
_net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 2, 3, padding=1))
torch.manual_seed(0)
_x = sharddbg.engine.scatter(torch.randn(1, 4, 32, 16), dim=2, requires_grad=True)
def _step():
    _net.zero_grad(set_to_none=True)
    _net(_x).square().mean().backward()
_step()  # first-call plans are in the cache before any recording
"""


def _trace(cl, code):
    t = cl.trace(code, timeout=120, display=False)
    for p in t.payloads.values():
        schema.validate_payload(p)
        assert p["meta"]["internal_errors"] == []
    return t


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=120)
    return cluster4


def test_stale_entries_are_named_at_the_op_that_made_them(cl, tmp_path):
    t = _trace(cl, f"_before = _plan_cache.cache_info().currsize\nfor _i in range({STEPS}):\n    _step()\n"
                   "_after = _plan_cache.cache_info().currsize")
    before, after = cl.eval("_before"), cl.eval("_after")
    # the planner the recorder watched through is torch's own again
    assert cl.eval("_redistribute_module._gen_transform_infos_non_cached is _planner") == [True] * N
    growth = t.get_plan_cache_growth().set_index("rank")
    frame = t.get_plan_cache()
    for r in range(N):
        g = growth.loc[r]
        # the cache's own count, read by the cell: it grew by one entry per step, every one a miss we saw
        assert after[r] - before[r] == STEPS
        assert g["entries_end"] - g["entries_start"] == STEPS == g["misses"] == g["stale_misses"]
        assert g["clears"] == 0
        rows = frame[frame["rank"] == r]
        assert len(rows) == 1, rows
        row = rows.iloc[0]
        assert (row["op"], row["outer_op"]) == ("ShardTensor.redistribute", "ShardTensor.backward")
        assert (row["source"], row["target"], row["shape"]) == ("Partial(sum)", "Replicate()", [])
        assert row["changed"] == "target._sharding_shapes" and row["stale"]
        assert row["count"] == row["kept"] == STEPS and row["spec_type"] == "ShardTensorSpec"
        # the op it names is in the trace, on that rank
        ops = t.get_ops()
        assert ops[(ops["rank"] == r) & (ops["seq"] == row["first_op_seq"])]["op"].tolist() == ["ShardTensor.redistribute"]
    finding = t.plan_cache_finding
    assert finding.startswith("Ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward), Partial(sum) -> "
                              "Replicate(), changed its target spec's _sharding_shapes")
    # every count per rank, as each rank's own cache says (never summed over the ranks)
    assert f"stored it, {STEPS} times on each rank: those entries" in finding and CLEAR_CALL in finding
    entries_now = (f"{after[0]:,} entries in the cache on each rank" if len(set(after)) == 1 else
                   f"{min(after):,} to {max(after):,} entries in the cache per rank")
    assert finding.endswith(f"so each step gets slower ({entries_now} now); clear the cache now and then in the "
                            f"training loop (every 100 steps, say): {CLEAR_CALL}")
    assert f"{N * STEPS} times" not in finding
    # where users read it: the explorer (text, static HTML, the widget's data), the summary line, the report
    assert f"⚠ performance: {finding}" in explorer.explorer_text(t)
    (found,) = [f for f in t.findings if f.kind == "plan_cache"]
    assert found.as_dict() in explorer.explorer_summary(t)["findings"]
    assert found.as_dict() in explorer.explorer_data(t)["findings"]
    assert 'class="sd-finding sd-finding-warn sd-category-performance"' in explorer.explorer_html(t)
    assert found.text() == finding and found.severity == "warn" and found.ranks == tuple(range(N))
    assert found.sentence in trace_summary(t)
    report = t.to_html(tmp_path / "r.html")
    assert "never hit again" in Path(report).read_text(encoding="utf-8")
    # a saved trace keeps it
    again = load_trace(t.save(tmp_path / "t.sdtrace.json"))
    assert again.plan_cache_finding == finding


def test_clearing_the_cache_in_the_loop_leaves_no_finding(cl):
    t = _trace(cl, f"for _i in range({STEPS}):\n    _step()\n    _plan_cache.cache_clear()")
    growth = t.get_plan_cache_growth()
    assert (growth["clears"] == STEPS).all() and (growth["stale_misses"] == STEPS).all()
    assert (t.get_plan_cache()["kept"] == 0).all()
    assert t.plan_cache_finding is None
    assert not [f for f in explorer.explorer_summary(t)["findings"] if f["kind"] == "plan_cache"]
    assert "plan cache" not in trace_summary(t)


def test_a_repeated_redistribution_that_hits_is_not_a_finding(cl):
    cl.run("""
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
_d = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh["domain"], [Shard(0)])
_d.redistribute(placements=[Replicate()])
""", timeout=60)
    t = _trace(cl, "_n0 = _plan_cache.cache_info().currsize\nfor _i in range(4):\n    _r = _d.redistribute(placements=[Replicate()])\n"
                   "_n1 = _plan_cache.cache_info().currsize")
    assert cl.eval("_n1 - _n0") == [0] * N
    growth = t.get_plan_cache_growth()
    assert (growth["misses"] == 0).all() and len(t.get_plan_cache()) == 0
    assert t.plan_cache_finding is None


def test_older_payloads_have_no_plan_cache():
    """A payload written before the cache was watched (no meta plan_cache) reads as nothing found."""
    p = {"format": schema.PAYLOAD_FORMAT, "schema_version": 5, "rank": 0, "world_size": 1, "complete": True,
         "events": [], "dropped": 0, "clock": {}, "meta": {}}
    schema.validate_payload(p)
    t = Trace.from_payloads([p])
    assert len(t.get_plan_cache()) == 0 and len(t.get_plan_cache_growth()) == 0
    assert t.plan_cache_finding is None


def test_a_malformed_plan_cache_record_is_refused():
    base = {"entries_start": 1, "entries_end": 2, "misses": 1, "stale_misses": 1, "clears": 0,
            "groups": [{"op": None, "outer_op": None, "source": "Partial(sum)", "target": "Replicate()", "shape": [],
                        "spec_type": "ShardTensorSpec", "changed": ["target._sharding_shapes"], "first_op_seq": None,
                        "count": 1, "kept": 1}]}
    p = {"format": schema.PAYLOAD_FORMAT, "schema_version": schema.SCHEMA_VERSION, "rank": 0, "world_size": 1,
         "complete": True, "events": [], "dropped": 0, "clock": {}, "meta": {"plan_cache": base}}
    schema.validate_payload(p)
    frame, growth = plan_cache_frame({0: p}), plan_cache_growth({0: p})
    assert plan_cache_finding(frame, growth).text().startswith("Rank 0: outside every recorded op, Partial(sum) -> "
                                                               "Replicate()")
    bad = dict(base, groups=[dict(base["groups"][0], count="1")])
    with pytest.raises(schema.SchemaError, match=r"rank 0 meta plan_cache group #0: field 'count'"):
        schema.validate_payload(dict(p, meta={"plan_cache": bad}))
    with pytest.raises(schema.SchemaError, match=r"rank 0 meta plan_cache: missing field\(s\) \['clears'\]"):
        schema.validate_payload(dict(p, meta={"plan_cache": {k: v for k, v in base.items() if k != "clears"}}))


def test_the_doctor_reads_the_last_trace_and_the_ranks_cache(cl):
    t = _trace(cl, f"for _i in range({STEPS}):\n    _step()")
    entries = cl.eval("_plan_cache.cache_info().currsize")
    ends = sorted(int(e) for e in t.get_plan_cache_growth()["entries_end"])
    entries_now = (f"{ends[0]:,} entries in the cache on each rank" if ends[0] == ends[-1] else
                   f"{ends[0]:,} to {ends[-1]:,} entries in the cache per rank")
    f = cl.doctor("_net").finding(dr.PLAN_CACHE)  # the cluster's last trace
    assert f.severity == "warn" and f.ranks == tuple(range(N))
    # the trace's own plan cache finding, then what each rank's cache holds now
    assert f.sentence == (f"in the last trace, ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward), "
                          f"Partial(sum) -> Replicate(), changed its target spec's _sharding_shapes after DTensor's "
                          f"redistribution plan cache had stored it, {STEPS} times on each rank: those entries are "
                          f"never hit again, each call adds one and every lookup compares against all of them (they "
                          f"share one hash), so each step gets slower ({entries_now} now); the cache holds "
                          f"{max(entries):,} entries now on rank {entries.index(max(entries))}")
    assert CLEAR_CALL in f.fix
    # a trace of the same loop clearing the cache after each step: nothing stale left
    cleared = _trace(cl, f"for _i in range({STEPS}):\n    _step()\n    _plan_cache.cache_clear()")
    ok = cl.doctor("_net", trace=cleared).finding(dr.PLAN_CACHE)
    # every plan of each step, once cleared; each rank's own cache, counted per rank (never summed over ranks)
    misses = sorted(int(m) for m in cleared.get_plan_cache_growth()["misses"])
    assert len(misses) == N and misses[0] >= STEPS
    counted = (f"{misses[0]} misses on each rank" if misses[0] == misses[-1]
               else f"{misses[0]} to {misses[-1]} misses per rank")
    assert ok.severity == "ok" and ok.sentence == (f"the last trace left no stale entry ({counted} while recording); "
                                              "the cache holds 0 entries now on rank 0")
    assert cl.doctor("_net", trace=t).status(dr.PLAN_CACHE) == "warn"  # the trace given, not the last one
    with pytest.raises(DoctorError, match="trace= takes a Trace"):
        cl.doctor("_net", trace="last")


def test_which_stale_entries_are_still_cached_follows_the_cache_sizes():
    """The rule behind ``kept``, on the recorder's own records: the cache only grows, so a size below the
    previous miss's plus its entry means it was cleared in between; entries before the last clear are gone."""
    from types import SimpleNamespace

    from sharddbg.engine.recorder.plan_cache import (
        PlanCacheMiss,
        PlanCacheWatch,
        export,
    )

    def spec():
        return SimpleNamespace(placements=("R",), tensor_meta=None, shard_order=(), _sharding_shapes=None)

    def watch(sizes_at_misses, end):
        w = PlanCacheWatch()
        w.entries_start = sizes_at_misses[0]
        targets = []
        for n in sizes_at_misses:
            t = spec()
            w.misses.append(PlanCacheMiss(spec(), t, None, None, n))
            targets.append(t)
        for t in targets:
            t._sharding_shapes = {}  # changed after its call, as ShardTensor.redistribute does
        w.entries_end = end
        return w

    grown = export(watch([10, 11, 12], 13))  # no clear: all three still there
    assert (grown["stale_misses"], grown["clears"], grown["groups"][0]["kept"]) == (3, 0, 3)
    middle = export(watch([10, 11, 0, 1], 2))  # cleared after the second: the last two are left
    assert (middle["clears"], middle["groups"][0]["count"], middle["groups"][0]["kept"]) == (1, 4, 2)
    at_end = export(watch([10, 11], 0))  # cleared after the last one: nothing left
    assert (at_end["clears"], at_end["groups"][0]["kept"]) == (1, 0)
    assert at_end["groups"][0]["changed"] == ["target._sharding_shapes"]
    unchanged = PlanCacheWatch()
    unchanged.misses.append(PlanCacheMiss(spec(), spec(), None, None, 5))
    unchanged.entries_end = 6
    first_plan = export(unchanged)  # a first call whose specs never changed: a miss, not stale
    assert (first_plan["misses"], first_plan["stale_misses"], first_plan["groups"][0]["changed"]) == (1, 0, [])
