"""Schema, Trace, file format, Perfetto export and op analyses, without a cluster.

The payloads are built by hand here (every field set explicitly) so that each expected number is
known independently of the recorder; real recorded traces are covered by test_recorder.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from sharddbg import schema
from sharddbg.analysis.comm import COLLECTIVE_COLUMNS, COLLECTIVE_EXTRA_COLUMNS
from sharddbg.analysis.ops import OPS_COLUMNS
from sharddbg.errors import ShardDbgWarning, TraceFileError
from sharddbg.trace import TRACE_VERSION, Trace, load_trace

SV = schema.SCHEMA_VERSION

CORE_COLUMNS = ("rank, seq, parent_seq, depth, op, path, handler, phase, autograd_node, module, user_frame, "
                 "in_local_shapes, in_global_shapes, out_local_shape, out_global_shape, placements, dtype, "
                 "sharding_shapes, in_bytes, out_bytes, t_start_ns, t_end_ns, host_ms, device_ms, "
                 "mem_delta_bytes, error").split(", ")

FB_FN = "physicsnemo.domain_parallel.shard_tensor._torch_function_fallback_via_dtensor"


def op(seq, name, path="function_handler", t0=1_000_000, dur=2_000_000, **kw):
    ev = {
        "kind": "op", "seq": seq, "parent_seq": None, "depth": 0, "op": name, "path": path,
        "handler": FB_FN if path.startswith("dtensor") else "pkg.handler", "phase": "forward",
        "autograd_node": None, "module": "conv1", "user_frame": "cell.py:3 in <module>",
        "in_local_shapes": [[1, 3, 17, 8]], "in_global_shapes": [[1, 3, 66, 8]],
        "out_local_shape": [1, 4, 17, 8], "out_global_shape": [1, 4, 66, 8], "placements": "(S(2),)",
        "dtype": "float32", "sharding_shapes": {"0": [[1, 4, 17, 8], [1, 4, 17, 8], [1, 4, 16, 8], [1, 4, 16, 8]]},
        "in_bytes": 1632, "out_bytes": 2176, "t_start_ns": t0, "t_end_ns": t0 + dur, "host_ms": dur / 1e6,
        "device_ms": None, "mem_delta_bytes": None, "error": None, "fwd_seq": None, "in_placements": ["(S(2),)"],
        "fallback": False, "promotions": [], "not_implemented": False, "in_flight": False, "thread": 0,
        "user_cell": 3, "user_code": "y = net(x)", "local_ms": None,
    }
    ev.update(kw)
    return ev


def err(origin, msg="boom", exc="TypeError", unmasked=False, handled=None):
    return {"exc_type": exc, "message": msg, "traceback": f"Traceback (most recent call last):\n  ...\n{exc}: {msg}\n",
            "origin_seq": origin, "unmasked": unmasked, "handled": handled}


def payload(rank, events, dropped=0, complete=True, world=2):
    return {"format": schema.PAYLOAD_FORMAT, "schema_version": schema.SCHEMA_VERSION, "rank": rank,
            "world_size": world, "complete": complete, "events": events, "dropped": dropped,
            "clock": {"source": "time.monotonic_ns", "injected_offset_ns": 0, "t_start_ns": 0, "t_stop_ns": 10**9},
            "meta": {"torch": "2.14.1", "physicsnemo": "2.2.2", "patch_mode": "registered"}}


OFFSET1 = 5_000_000  # rank 1's clock runs 5 ms ahead of the reference


def small_trace():
    w = {"param": "conv1.weight", "shape": [4, 3, 3, 3], "dtype": "float32"}
    r0 = [
        op(0, "torch.conv2d", promotions=[w, {"param": "conv1.bias", "shape": [4], "dtype": "float32"}]),
        op(1, "Tensor.abs", "dtensor_fallback_function", t0=4_000_000, dur=3_000_000, fallback=True),
        op(2, "Tensor.add", "function_handler", t0=8_000_000, error=err(3, "add handler exploded", unmasked=True)),
        op(3, "Tensor.ndim.__get__", "dtensor_fallback_function", t0=8_100_000, dur=100_000,
           parent_seq=2, depth=1, fallback=True, error=err(3, "add handler exploded", unmasked=True)),
        op(4, "torch.conv2d", phase="backward", autograd_node="_FromTorchTensorBackward", fwd_seq=0,
           t0=12_000_000, dur=500_000, device_ms=0.25, mem_delta_bytes=4096),
        op(5, "torch._C._nn.linear", "function_handler", t0=13_000_000, fallback=True,
           user_frame="cell.py:7 in <module>"),
    ]
    r1 = [
        op(0, "torch.conv2d", t0=1_000_000 + OFFSET1, in_local_shapes=[[1, 3, 16, 8]]),
        op(1, "Tensor.abs", "dtensor_fallback_function", t0=4_000_000 + OFFSET1, dur=1_000_000, fallback=True,
           user_frame="cell.py:4 in <module>"),
        op(2, "Tensor.cosh", t0=9_000_000 + OFFSET1, dur=0, t_end_ns=None, host_ms=None, in_flight=True),
    ]
    return Trace.from_payloads([payload(0, r0), payload(1, r1, complete=False)], {0: 0, 1: OFFSET1},
                               meta={"code": "y = net(x)"})


def test_get_ops_columns_and_clock_alignment():
    t = small_trace()
    ops = t.get_ops()
    assert list(ops.columns[: len(CORE_COLUMNS)]) == CORE_COLUMNS == OPS_COLUMNS
    assert len(ops) == 9 and t.ranks == [0, 1] and t.incomplete_ranks == [1]
    # rank 1's times shifted back by its offset: the two conv2d calls now start together
    c = ops[ops["op"] == "torch.conv2d"]
    assert c[c["phase"] == "forward"]["t_start_ns"].tolist() == [1_000_000, 1_000_000]
    assert ops["device_ms"].dtype == float
    assert math.isnan(ops.loc[0, "device_ms"]) and ops[ops["seq"] == 4]["device_ms"].iloc[0] == 0.25
    cosh = ops[ops["op"] == "Tensor.cosh"].iloc[0]
    assert bool(cosh["in_flight"]) and pd.isna(cosh["t_end_ns"]) and math.isnan(cosh["host_ms"])
    assert ops[ops["seq"] == 2]["error"].iloc[0] == "TypeError: add handler exploded"


def test_fallbacks():
    fb = small_trace().get_fallbacks()
    assert list(fb.columns[:6]) == ["op", "path", "calls", "ranks", "host_ms_total", "user_frames"]
    a = fb[fb["op"] == "Tensor.abs"].iloc[0]
    assert a["calls"] == 2 and a["ranks"] == [0, 1] and a["host_ms_total"] == pytest.approx(4.0)
    assert a["user_frames"] == ["cell.py:3 in <module>", "cell.py:4 in <module>"] and not a["via_handler"]
    lin = fb[fb["op"] == "torch._C._nn.linear"].iloc[0]  # a handler that fell back internally
    assert lin["via_handler"] and lin["path"] == "function_handler" and lin["calls"] == 1
    assert "torch.conv2d" not in set(fb["op"])
    assert fb["host_ms_total"].is_monotonic_decreasing


def test_errors_and_promotions():
    t = small_trace()
    e = t.get_errors()
    assert list(e.columns[:8]) == ["rank", "seq", "op", "path", "exc_type", "message", "traceback", "user_frame"]
    assert len(e) == 1  # the origin only; seq 2 is the same exception passing through
    row = e.iloc[0]
    assert (row["rank"], row["seq"], row["op"], row["exc_type"]) == (0, 3, "Tensor.ndim.__get__", "TypeError")
    assert row["message"] == "add handler exploded" and "Traceback" in row["traceback"]
    assert row["propagated_to"] == [2] and row["unmasked"]
    assert len(t.get_errors(include_propagated=True)) == 2
    p = t.get_promotions()
    assert list(p.columns[:6]) == ["rank", "seq", "op", "param", "shape", "dtype"]
    assert p["param"].tolist() == ["conv1.weight", "conv1.bias"] and p["shape"].iloc[0] == (4, 3, 3, 3)


def test_errors_built_once_per_trace_equal_the_analysis_and_never_another_traces():
    """get_errors is kept per trace (the findings and the report's error list both ask): each call equals
    analysis.ops.errors on that trace's tables, a caller changing its copy changes no later answer, and a trace
    whose errors differ gets its own."""
    from sharddbg.analysis.ops import errors

    t = small_trace()
    for propagated in (False, True):
        expected = errors(t.get_ops(), propagated, t.get_cell_errors())
        first = t.get_errors(include_propagated=propagated)
        pd.testing.assert_frame_equal(first, expected)
        first.loc[:, "message"] = "changed by the caller"
        pd.testing.assert_frame_equal(t.get_errors(include_propagated=propagated), expected)
    # another trace: rank 0's raising op left out, so it has no error of its own
    quiet = Trace.from_payloads([payload(0, [op(1, "torch.conv2d")]), payload(1, [op(1, "torch.conv2d")])])
    assert len(t.get_errors()) == 1 and quiet.get_errors().empty
    pd.testing.assert_frame_equal(quiet.get_errors(), errors(quiet.get_ops(), False, quiet.get_cell_errors()))


def test_save_load_round_trip(tmp_path):
    t = small_trace()
    path = t.save(tmp_path / "run.sdtrace.json")
    d = json.loads(open(path).read())
    assert d["format"] == "sharddbg.trace" and d["version"] == TRACE_VERSION
    t2 = load_trace(path)
    assert t2.to_dict() == t.to_dict()
    pd.testing.assert_frame_equal(t2.get_ops(), t.get_ops())
    assert t2.incomplete_ranks == [1] and t2.clock_offsets_ns == {0: 0, 1: OFFSET1}


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s[: len(s) // 2], "not valid JSON"),
    (lambda s: "\x00\xff garbage", "not valid JSON"),
    (lambda s: json.dumps([1, 2]), "not a sharddbg trace"),
    (lambda s: json.dumps({**json.loads(s), "format": "chrome.trace"}), "not a sharddbg trace"),
    (lambda s: json.dumps({**json.loads(s), "version": TRACE_VERSION + 1}), "newer sharddbg"),
    (lambda s: json.dumps({k: v for k, v in json.loads(s).items() if k != "version"}), "version"),
    (lambda s: s.replace('"host_ms"', '"hostms"', 1), "corrupt.*host_ms"),
    (lambda s: s.replace('"function_handler"', '"teleport"', 1), "corrupt.*unknown path"),
    (lambda s: s.replace(f'"schema_version":{SV}', '"schema_version":99', 1), "schema version 99.*upgrade"),
    (lambda s: s.replace(f'"schema_version":{SV}', '"schema_version":99').replace('"schema_version":99', f'"schema_version":{SV}', 1),
     "corrupt.*schema_version 99"),
])
def test_wrong_or_corrupt_files_rejected(tmp_path, mutate, match):
    good = small_trace().save(tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(mutate(open(good).read()).encode("utf-8", "surrogateescape"))
    with pytest.raises(TraceFileError, match=match):
        load_trace(bad)


def test_perfetto_export(tmp_path):
    t = small_trace()
    d = json.loads(open(t.to_perfetto(tmp_path / "p.json")).read())
    evs = d["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1 (incomplete)"}
    slices = [e for e in evs if e["ph"] == "X"]
    assert len(slices) == 8  # every op except the in-flight one, which is an instant marker
    for e in slices:  # the trace-event format's required fields for complete events
        for k in ("name", "ph", "ts", "dur", "pid", "tid"):
            assert k in e, (k, e)
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
        for k in ("path", "in_local_shapes", "out_local_shape", "user_frame"):
            assert k in e["args"]
    inst = [e for e in evs if e["ph"] == "i"]
    assert [e["name"] for e in inst] == ["Tensor.cosh"]
    abs1 = next(e for e in slices if e["name"] == "Tensor.abs" and e["pid"] == 1)
    assert abs1["ts"] == pytest.approx(3000.0) and abs1["dur"] == pytest.approx(1000.0)  # us, aligned
    json.dumps(d, allow_nan=False)  # strict JSON


def test_dropped_is_reported():
    with pytest.warns(ShardDbgWarning, match="7 events were dropped"):
        t = Trace.from_payloads([payload(0, [op(0, "Tensor.abs")], dropped=7)])
    assert t.dropped == 7 and t.dropped_by_rank == {0: 7}


def test_missing_rank_and_schema_validation():
    t = Trace.from_payloads([payload(0, [op(0, "Tensor.abs")]), None])
    assert t.incomplete_ranks == [1] and t.get_ops()["rank"].tolist() == [0]
    with pytest.raises(schema.SchemaError, match="unknown kind"):
        schema.validate_event({"kind": "teleport", "seq": 0})
    with pytest.raises(schema.SchemaError, match="in_bytes"):
        schema.validate_event(op(0, "x", in_bytes=True))  # a bool is not an int here
    # since schema 2 collective records are validated field by field (test_comm.py builds full ones)
    with pytest.raises(schema.SchemaError, match="missing field"):
        schema.validate_event({"kind": "collective", "seq": 3, "coll": "all_reduce"})
    with pytest.raises(schema.SchemaError, match="two payloads claim rank 0"):
        Trace.from_payloads([payload(0, []), payload(0, [])])


def test_payloads_as_columns_build_the_same_trace_and_refuse_what_dicts_refuse():
    from sharddbg import columnar

    ops = [op(i, "Tensor.abs", error=err(i) if i == 3 else None) for i in range(6)]
    dicts = [payload(0, ops), payload(1, ops[:2])]
    t = Trace.from_payloads([columnar.payload_as_columns(dicts[0]), dicts[1]])  # a big rank and a small one
    assert all(isinstance(p["events"], columnar.LazyRecords) for p in t.payloads.values())
    assert [t.events(r) for r in t.ranks] == [p["events"] for p in dicts]
    pd.testing.assert_frame_equal(t.get_ops(), Trace.from_payloads(dicts).get_ops(), check_exact=True)
    # a record the column checks doubt is made as a dict and checked as one: the same error, word for word
    bad = payload(0, [op(0, "Tensor.abs", phase="sideways")])
    with pytest.raises(schema.SchemaError) as as_dicts:
        Trace.from_payloads([bad])
    with pytest.raises(schema.SchemaError) as as_columns:
        Trace.from_payloads([columnar.payload_as_columns(bad)])
    assert str(as_columns.value) == str(as_dicts.value)
    with pytest.raises(schema.SchemaError, match="two payloads claim rank 0"):
        Trace.from_payloads([columnar.payload_as_columns(payload(0, ops)), payload(0, [])])
    # the columns null in every row travel as Arrow's null type (no buffers) and are read back as the file's types
    import pyarrow as pa

    shipped = columnar.payload_as_columns(dicts[0])[columnar.EVENTS_AS_COLUMNS]
    sent = pa.ipc.open_stream(pa.BufferReader(shipped)).read_all()
    made = columnar.table_of_records(0, dicts[0]["events"])
    untyped = [name for name, field in zip(sent.column_names, sent.schema) if pa.types.is_null(field.type)]
    assert "wait_op_seq" in untyped and "op" not in untyped
    assert untyped == [name for name in made.column_names if made.column(name).null_count == made.num_rows]
    assert columnar.table_of_stream(shipped).equals(made)
    cut = dict(columnar.payload_as_columns(payload(0, ops)))
    cut[columnar.EVENTS_AS_COLUMNS] = cut[columnar.EVENTS_AS_COLUMNS][:100]
    with pytest.raises(schema.SchemaError, match="cannot be read: not a readable Arrow IPC stream"):
        Trace.from_payloads([cut])


def test_client_side_imports_no_torch_or_plotly():
    """The data layer (trace, schema, every analysis, the Perfetto exporter) loads without torch, plotting
    or widgets."""
    code = ("import sys, sharddbg.trace, sharddbg.schema, sharddbg.analysis, sharddbg.analysis.timeline, "
            "sharddbg.analysis.layout, sharddbg.analysis.formatting, sharddbg.exporters.perfetto;"
            "bad = [m for m in ('torch', 'plotly', 'ipywidgets', 'anywidget', 'sharddbg.views', "
            "'sharddbg.exporters.html_report') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_collectives_of_a_trace_without_them():
    """Every trace has get_collectives() with its columns, empty when nothing was recorded;
    collectives_recorded says whether the recorder looked for them."""
    t = small_trace()
    colls = t.get_collectives()
    assert colls.empty and list(colls.columns) == COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS
    assert t.collectives_recorded  # schema 2, collective capture on (the default)
    by_op = t.get_comm_by_op()  # every op with a forward call, none communicating
    assert set(by_op["op"]) == set(t.get_ops()["op"])
    assert (by_op["n_collectives"] == 0).all() and (by_op["comm_ms"] == 0).all()
    assert t.get_collective_mismatches().empty
    off = [payload(0, [op(0, "Tensor.abs")])]
    off[0]["meta"]["comm"] = False
    assert not Trace.from_payloads(off).collectives_recorded
    old = [payload(0, [op(0, "Tensor.abs")])]
    old[0]["schema_version"] = 1
    t1 = Trace.from_payloads(old)
    assert not t1.collectives_recorded and list(t1.get_collectives().columns) == list(colls.columns)
    assert not Trace.from_payloads([None]).collectives_recorded


# ---- the analysis layer on hand-made records: every number known in advance -------------------------------

def coll(seq, name, op_seq, t_issue, dur_ms, phase="forward", in_flight=False, **kw):
    ev = {
        "kind": "collective", "seq": seq, "group_seq": seq, "coll": name, "aten_op": f"_c10d_functional.{name}",
        "api": "functional", "group_name": "1", "group_ranks": [0, 1], "group_size": 2, "mesh_dim": "domain",
        "peer": None, "root": None, "bytes_sent": 100, "bytes_recv": 200, "splits_sent": None, "splits_recv": None,
        "dtype": "float32", "shape": [25], "async": True, "t_issue_ns": t_issue, "t_return_ns": t_issue + 10,
        "t_done_ns": None if in_flight else t_issue + int(dur_ms * 1e6), "wait_op_seq": None, "waited": not in_flight,
        "op": None, "op_seq": op_seq, "outer_op": None, "outer_op_seq": None, "phase": phase, "autograd_node": None,
        "param": None, "params": None, "bucket": None, "user_frame": None, "user_cell": None, "user_code": None,
        "device_ms": None, "error": None, "in_flight": in_flight, "thread": 0,
    }
    ev.update(kw)
    return ev


def test_op_summary_first_calls_steady_and_comm():
    ms = 1_000_000
    r0 = [
        # abs: shapes A three times (10, 1, 3 ms), then shape B once (5 ms): two first calls
        op(0, "Tensor.abs", "dtensor_fallback_function", t0=0, dur=10 * ms, fallback=True, local_ms=0.5),
        op(1, "Tensor.abs", "dtensor_fallback_function", t0=20 * ms, dur=1 * ms, fallback=True, local_ms=0.5),
        op(2, "Tensor.abs", "dtensor_fallback_function", t0=30 * ms, dur=3 * ms, fallback=True, local_ms=0.5),
        op(3, "Tensor.abs", "dtensor_fallback_function", t0=40 * ms, dur=5 * ms, fallback=True, local_ms=0.5,
           in_local_shapes=[[1, 3, 9, 8]]),
        # full_tensor (user call) -> redistribute (nested) -> its all_gather, 2 ms of the 4 ms call
        op(4, "ShardTensor.full_tensor", "python_method", t0=50 * ms, dur=4 * ms),
        op(5, "ShardTensor.redistribute", "python_method", t0=50 * ms, dur=3 * ms, parent_seq=4, depth=1),
        coll(6, "all_gather_into_tensor", 5, 51 * ms, 2.0, op="ShardTensor.redistribute",
             outer_op="ShardTensor.full_tensor", outer_op_seq=4),
        # conv: forward halo 1 ms of 8; backward event 0.5 ms, with two backward collectives (3 + 4 ms)
        op(7, "torch.conv2d", t0=60 * ms, dur=8 * ms),
        coll(8, "all_to_all_single", 7, 61 * ms, 1.0, op="torch.conv2d"),
        op(9, "torch.conv2d", phase="backward", fwd_seq=7, t0=80 * ms, dur=ms // 2, autograd_node="ConvBackward"),
        coll(10, "all_reduce", 7, 81 * ms, 3.0, phase="backward", op="torch.conv2d"),
        coll(11, "all_reduce", 7, 85 * ms, 4.0, phase="backward", op="torch.conv2d"),
        # an all_reduce never waited: counted, not timed
        coll(12, "all_reduce", None, 90 * ms, 0.0, in_flight=True),
    ]
    r1 = [op(0, "Tensor.abs", "dtensor_fallback_function", t0=0, dur=8 * ms, fallback=True, local_ms=0.5),
          op(1, "Tensor.abs", "dtensor_fallback_function", t0=10 * ms, dur=2 * ms, fallback=True, local_ms=0.5)]
    t = Trace.from_payloads([payload(0, r0), payload(1, r1)])
    s = t.get_op_summary().set_index(["op", "phase"])
    a = s.loc[("Tensor.abs", "forward")]
    assert (a["calls"], a["first_calls"], a["steady_calls"]) == (6, 3, 3)
    assert a["first_ms_median"] == pytest.approx(8.0)  # median of 10 (r0 A), 5 (r0 B), 8 (r1)
    assert a["steady_ms_median"] == pytest.approx(2.0)  # 1, 3, 2
    assert a["steady_ms_p95"] == pytest.approx(float(pd.Series([1.0, 3.0, 2.0]).quantile(0.95)))
    assert a["host_ms_total"] == pytest.approx(29.0) and a["ranks"] == [0, 1]
    assert a["local_ms_median"] == 0.5 and a["dispatch_ms_median"] == pytest.approx(1.5)
    # flagged on the least steady dispatch (1 - 0.5 = 0.5 ms), which is not more than the local 0.5 ms: a slow
    # call or two on a busy host do not make an op dispatch-bound
    assert not a["dispatch_bound"]
    ft = s.loc[("ShardTensor.full_tensor", "forward")]
    assert (ft["n_collectives"], ft["n_collectives_inclusive"]) == (0, 1)
    assert ft["comm_ms_inclusive"] == pytest.approx(2.0) and ft["bytes_inclusive"] == 300
    assert ("ShardTensor.redistribute", "forward") not in s.index  # nested: not a user call
    nested = t.get_op_summary(nested=True).set_index(["op", "phase"])
    assert nested.loc[("ShardTensor.redistribute", "forward"), "n_collectives"] == 1
    cf, cb = s.loc[("torch.conv2d", "forward")], s.loc[("torch.conv2d", "backward")]
    assert (cf["n_collectives"], cf["comm_ms"]) == (1, pytest.approx(1.0))
    assert (cb["n_collectives"], cb["comm_ms"], cb["calls"]) == (2, pytest.approx(7.0), 1)
    assert s["n_in_flight"].sum() == 0  # the never-waited all_reduce belongs to no op
    # the table's comm adds up to the collectives' own rows: exclusive over every call, or inclusive over the
    # user's calls (each collective lies inside exactly one of them)
    colls = t.get_collectives()
    owned = colls[colls["op_seq"].notna()]["duration_ms"].sum()
    assert t.get_op_summary(nested=True)["comm_ms"].sum() == pytest.approx(owned) == pytest.approx(10.0)
    assert s["comm_ms_inclusive"].sum() == pytest.approx(owned)
    assert math.isnan(colls[colls["in_flight"]]["duration_ms"].iloc[0])  # never counted as done


def test_comm_by_op_like_with_like_inclusive_kind_rank_peer():
    ms = 1_000_000
    r0 = [
        op(0, "ShardTensor.full_tensor", "python_method", t0=0, dur=4 * ms),
        op(1, "ShardTensor.redistribute", "python_method", t0=0, dur=3 * ms, parent_seq=0, depth=1),
        coll(2, "all_gather_into_tensor", 1, 1 * ms, 2.0, op="ShardTensor.redistribute"),
        op(3, "torch.conv2d", t0=10 * ms, dur=8 * ms),
        coll(4, "all_to_all_single", 3, 11 * ms, 1.0, op="torch.conv2d", group_ranks=[0, 1],
             splits_sent=[0, 64], splits_recv=[0, 32], bytes_sent=64, bytes_recv=32),
        op(5, "torch.conv2d", phase="backward", fwd_seq=3, t0=30 * ms, dur=ms // 2),
        coll(6, "all_reduce", 3, 31 * ms, 6.0, phase="backward", op="torch.conv2d"),
        coll(7, "all_reduce", None, 40 * ms, 0.0, in_flight=True),
    ]
    r1 = [op(0, "torch.conv2d", t0=10 * ms, dur=2 * ms),
          coll(1, "all_to_all_single", 0, 10 * ms, 3.0, op="torch.conv2d", splits_sent=[32, 0],
               splits_recv=[64, 0], bytes_sent=32, bytes_recv=64)]
    t = Trace.from_payloads([payload(0, r0), payload(1, r1)])
    by = t.get_comm_by_op().set_index(["op", "rank"])
    conv = by.loc[("torch.conv2d", 0)]
    # forward against forward: 1 ms of the 8 ms call; backward apart (6 ms against a 0.5 ms node)
    assert conv["comm_ms"] == pytest.approx(1.0) and conv["op_ms"] == pytest.approx(8.0)
    assert conv["comm_share"] == pytest.approx(1 / 8)
    assert (conv["bwd_n_collectives"], conv["bwd_comm_ms"], conv["bwd_op_ms"]) == (1, pytest.approx(6.0),
                                                                                    pytest.approx(0.5))
    assert conv["n_collectives"] == 2
    assert by.loc[("ShardTensor.full_tensor", 0), "n_collectives"] == 0
    assert by.loc[("<outside recorded ops>", 0), "n_in_flight"] == 1
    assert by.loc[("<outside recorded ops>", 0), "comm_ms"] == 0.0
    inc = t.get_comm_by_op(inclusive=True).set_index(["op", "rank"])
    assert inc.loc[("ShardTensor.full_tensor", 0), "n_collectives"] == 1
    assert inc.loc[("ShardTensor.redistribute", 0), "n_collectives"] == 1
    calls = t.get_comm_by_op(by="call").set_index(["rank", "op_seq"])
    assert calls.loc[(0, 3), "op_ms"] == pytest.approx(8.0) and calls.loc[(0, 3), "bwd_op_ms"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="inclusive"):
        t.get_comm_by_op(inclusive="yes")
    # time summed over ranks beside the slowest rank and the mean per rank
    k = t.get_comm_by_kind().set_index(["op", "kind"]).loc[("torch.conv2d", "all_to_all_single")]
    assert k["comm_ms"] == pytest.approx(4.0) and k["comm_ms_rank_max"] == pytest.approx(3.0)
    assert k["comm_ms_rank_mean"] == pytest.approx(2.0)
    r = t.get_comm_by_rank().set_index("rank")
    assert (r.loc[0, "n_collectives"], r.loc[0, "n_in_flight"]) == (4, 1)
    assert r.loc[0, "comm_ms"] == pytest.approx(9.0) and r.loc[0, "comm_wall_ms"] == pytest.approx(9.0)
    assert r.loc[0, "span_ms"] == pytest.approx(40.0)  # first op start to the last collective issued
    peers = t.get_comm_by_peer().set_index(["rank", "peer"])
    assert (peers.loc[(0, 1), "bytes_sent"], peers.loc[(0, 1), "bytes_recv"]) == (64, 32)
    assert (peers.loc[(1, 0), "bytes_sent"], peers.loc[(1, 0), "bytes_recv"]) == (32, 64)
    assert bool(peers.loc[(0, 0), "local"]) and peers.loc[(0, 0), "bytes_sent"] == 0


def test_fallbacks_compute_metadata_and_autograd():
    r0 = [
        op(0, "Tensor.abs", "dtensor_fallback_function", fallback=True),
        op(1, "Tensor.shape.__get__", "dtensor_fallback_function", fallback=True),
        op(2, "Tensor.detach", "dtensor_fallback_function", fallback=True),
        op(3, "ShardTensor.backward", "python_method", dur=50_000_000),
        op(4, "Tensor.backward", "dtensor_fallback_function", fallback=True, parent_seq=3, depth=1,
           dur=49_000_000),
        op(5, "aten.detach.default", "dtensor_fallback_dispatch", phase="backward", fallback=True),
    ]
    t = Trace.from_payloads([payload(0, r0)])
    assert list(t.get_fallbacks()["op"]) == ["Tensor.abs"]
    every = t.get_fallbacks(include_metadata=True).set_index("op")
    assert set(every.index) == {"Tensor.abs", "Tensor.shape.__get__", "Tensor.detach"}
    assert every.loc["Tensor.shape.__get__", "category"] == "metadata" and every.loc["Tensor.abs", "category"] == "compute"
    assert every.loc["Tensor.abs", "locations"] == ["cell [3], line 3: `y = net(x)`"]
    s = t.get_op_summary().set_index("op")
    assert "Tensor.backward" not in s.index and s.loc["ShardTensor.backward", "category"] == "autograd"


def test_errors_keep_the_whole_message_and_say_where():
    long = "local size 17: must be divisible by 2\n4 were expected: ranks 0-3 disagree (" + "x" * 200 + ")"
    r0 = [op(0, "Tensor.add", error=err(0, long, exc="UndeterminedShardingError"))]
    e = Trace.from_payloads([payload(0, r0)]).get_errors().iloc[0]
    assert e["message"] == long and e["location"] == "cell [3], line 3: `y = net(x)`"
    from sharddbg.analysis.formatting import format_location

    assert format_location("/m/model.py:12 in forward", None, "return self.conv(x)") == \
        "/m/model.py:12 in forward: `return self.conv(x)`"
    assert format_location(None) is None


def test_locations_and_rank_tracebacks_name_the_notebooks_cell_and_fold_library_frames(monkeypatch):
    from sharddbg.analysis.formatting import format_location
    from sharddbg.cluster.execution import _user_traceback
    from sharddbg.errors import RankFailure

    # the recorder names a cell by the notebook's count, or as sent by cl.run from a script: never a temp file
    assert format_location("cell [7], line 5 in <module>", 7, "y = x + x") == "cell [7], line 5: `y = x + x`"
    assert format_location("cell sent by cl.run, line 5 in <module>", None, "y = x + x") == \
        "cell sent by cl.run, line 5: `y = x + x`"
    torch_file = __import__("torch").nn.modules.module.__file__
    rank_tb = (f"---------\nIndexError    Traceback (most recent call last)\nCell In[7], line 2\n      1 m = M()\n"
               f"----> 2 y = m(x)\n\nFile {torch_file}:1773, in Module._wrapped_call_impl(self, *args, **kwargs)\n"
               f"   1772 else:\n-> 1773     return self._call_impl(*args, **kwargs)\n\n"
               f"Cell In[5], line 4, in M.forward(self, x)\n      3 def forward(self, x):\n----> 4     return x[9]\n\n"
               f"IndexError: index 9 is out of bounds")
    shown = _user_traceback(rank_tb)
    assert f"File {torch_file}:1773, in Module._wrapped_call_impl\nCell In[5], line 4" in shown, shown
    assert "return self._call_impl" not in shown and "----> 4     return x[9]" in shown
    assert shown.endswith("IndexError: index 9 is out of bounds") and "----> 2 y = m(x)" in shown
    failure = RankFailure("IndexError", "index 9 is out of bounds", shown)
    assert (failure.cell_line, failure.cell_code) == (2, "y = m(x)")
    sent = RankFailure("IndexError", "boom", "Cell sent by cl.run, line 3\n----> 3 x[9]\n\nIndexError: boom")
    assert sent.headline(1) == "rank 1 raised IndexError: boom (line 3 of the cell: `x[9]`)"
    # a library frame whose source was the last thing before the exception keeps the exception
    last = _user_traceback(f"File {torch_file}:1773, in f(x)\n-> 1773     y\n\nValueError: v")
    assert last == f"File {torch_file}:1773, in f\n\nValueError: v"
    monkeypatch.setenv("SHARDDBG_DEBUG", "1")  # everything as IPython showed it
    assert _user_traceback(rank_tb) == rank_tb


def test_older_payloads_load_newer_fields_are_required():
    """A schema 3 payload (no user_cell / local_ms / params) reads, its new columns empty; a schema 4 record
    without them is refused. The golden trace of schema 3 in tests/data loads and every table reads it."""
    old = payload(0, [{k: v for k, v in op(0, "Tensor.abs").items() if k not in ("user_cell", "user_code", "local_ms")}])
    old["schema_version"] = 3
    ops = Trace.from_payloads([old]).get_ops()
    assert pd.isna(ops["user_cell"].iloc[0]) and math.isnan(ops["local_ms"].iloc[0])
    assert ops["location"].iloc[0] == "cell.py:3 in <module>"
    new = payload(0, [{k: v for k, v in op(0, "Tensor.abs").items() if k != "user_cell"}])
    with pytest.raises(schema.SchemaError, match="user_cell"):
        Trace.from_payloads([new])
    from pathlib import Path

    for name in ("conv4.sdtrace.json", "conv4_schema3.sdtrace.json"):
        t = load_trace(Path(__file__).parent / "data" / name)
        s = t.get_op_summary()
        assert len(s) and (s["calls"] > 0).all()
        assert "Tensor.backward" not in set(t.get_fallbacks(include_metadata=True)["op"])
        by = t.get_comm_by_op()
        assert (by["comm_share"].dropna() <= 1).all()


def cell_error(seq, origin, exc="TypeError", msg="boom"):
    return {"kind": "error", "seq": seq, "t_ns": 9_000_000, "exc_type": exc, "message": msg,
            "traceback": f"{exc}: {msg}\n", "origin_seq": origin, "cell_line": 2, "cell_code": "y = x + x", "cell": 3,
            "thread": 0}


def test_schema_7_payloads_read_with_the_defaults_of_schema_8():
    """Before schema 8 a record says nothing of handled errors or failed collectives: an op error that an error
    record names ended the cell (handled False), any other is not known (missing, still a failure); a
    collective has no error (a failed one reads in flight, as it was recorded). The payload stays as written."""
    def old_error(origin, msg):
        return {k: v for k, v in err(origin, msg).items() if k != "handled"}

    events = [op(0, "Tensor.add", error=old_error(0, "escaped")), op(1, "Tensor.mul", error=old_error(1, "caught")),
              cell_error(2, 0, msg="escaped"),
              {k: v for k, v in coll(3, "all_reduce", None, 10_000_000, 0, in_flight=True).items() if k != "error"}]
    old = payload(0, events)
    old["schema_version"] = 7
    with pytest.raises(schema.SchemaError, match="handled"):  # a record of schema 8 must say it
        Trace.from_payloads([dict(old, schema_version=8)])
    t = Trace.from_payloads([old])
    errs = t.get_errors().set_index("message")
    escaped = errs.loc["escaped", "handled"]
    assert not pd.isna(escaped) and not escaped
    assert pd.isna(errs.loc["caught", "handled"])
    assert t.overview.errors == 2 and t.overview.handled_errors == 0
    c = t.get_collectives().iloc[0]
    assert (c["state"], c["in_flight"], c["error"]) == ("in_flight", True, None)
    assert "handled" not in events[0]["error"] and "error" not in events[3]  # the payload is left as written
    assert t.events(0)[0]["error"] == events[0]["error"]


def test_a_rank_that_never_issued_a_collective_is_named_first():
    """The rank that never issued the collective another waited in is the first finding: before what the waiting
    rank raised when it failed, or before its hang."""
    failed = coll(0, "all_reduce", None, 10_000_000, 0, t_done_ns=None, waited=False, error="RuntimeError: Timed out")
    t = Trace.from_payloads([payload(0, [failed]), payload(1, [])])
    # (and, since these hand-made records hold no op, the info finding that says why the op tables are empty)
    first, why_no_ops = t.findings
    assert (first.kind, first.severity, first.ranks) == ("collective_missing", "fail", (1,))
    assert why_no_ops.kind == "no_recorded_ops"
    assert first.sentence == "rank 1 never issued the all_reduce rank 0 waited in until it failed (group_seq 0 on " \
                             "'domain')" and first.fix.startswith("what rank 0 raised follows from it")
    hung = coll(0, "all_reduce", None, 10_000_000, 0, in_flight=True)
    t = Trace.from_payloads([payload(0, [hung], complete=False), payload(1, [])])
    assert [f.kind for f in t.findings] == ["collective_missing", "collective_unfinished", "incomplete_ranks"]
    assert t.findings[0].sentence.startswith("rank 1 never issued the all_reduce rank 0 waited in (group_seq 0")
    assert t.findings[0].fix.startswith("the hang follows from it")


def test_numpy_huge_page_advice_is_off_inside_the_big_table_blocks_and_put_back_after_the_last():
    """Blocks on two threads that overlap without nesting: the advice stays off until the last one ends, then is put
    back as it was (on, then off), never left changed."""
    import threading

    from sharddbg import columnar

    switch = columnar._madvise_hugepage_switch()
    assert switch is not None  # the numpy this project pins has it

    def advised() -> bool:
        was = switch(True)
        switch(was)
        return bool(was)

    original = advised()
    for before in (True, False):
        switch(before)
        first_in, second_in, first_may_leave = threading.Event(), threading.Event(), threading.Event()
        seen = {}

        def first():
            with columnar.numpy_huge_pages_unadvised():
                seen["first"] = advised()
                first_in.set()
                second_in.wait(10)
            seen["after first"] = advised()
            first_may_leave.set()

        thread = threading.Thread(target=first)
        thread.start()
        first_in.wait(10)
        with columnar.numpy_huge_pages_unadvised():
            second_in.set()
            first_may_leave.wait(10)  # the first block ended while this one runs
            seen["second"] = advised()
        thread.join(10)
        assert seen == {"first": False, "after first": False, "second": False}
        assert advised() is before
    switch(original)
