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
    }
    ev.update(kw)
    return ev


def err(origin, msg="boom", exc="TypeError", unmasked=False):
    return {"exc_type": exc, "message": msg, "traceback": f"Traceback (most recent call last):\n  ...\n{exc}: {msg}\n",
            "origin_seq": origin, "unmasked": unmasked}


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
