"""The data behind every view, on golden traces recorded from a real 4-rank run (tests/data, regenerate
with tests/data/make_golden.py). No cluster, no browser. Expected values are computed here from the
sample's shape (66 rows over 4 ranks) or from the raw per-rank payloads, not from the views.
"""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import sharddbg
from sharddbg.cluster.inspect import ShardLayout
from sharddbg.trace import Trace
from sharddbg.views import explorer as ex
from sharddbg.views import timeline as tl
from sharddbg.views.report import to_html

DATA = Path(__file__).parent / "data"
N = 4
ROWS = [66 // N + (1 if r < 66 % N else 0) for r in range(N)]  # 17, 17, 16, 16
OFFS = [sum(ROWS[:r]) for r in range(N)]
HTML_MSG = "<b>bold</b> & <script>alert('sharddbg')</script> in the add handler"


@pytest.fixture(scope="module")
def trace() -> Trace:
    return sharddbg.load_trace(DATA / "conv4.sdtrace.json")


def _raw(path=DATA / "conv4.sdtrace.json") -> dict:
    return json.loads(Path(path).read_text())


def _raw_ops(trace):
    """(rank, seq) -> raw op event, straight from the payloads."""
    return {(r, e["seq"]): e for r in trace.ranks for e in trace.events(r) if e["kind"] == "op"}


def _raw_colls(trace):
    """Collective records straight from the payloads, with their rank."""
    return [dict(e, rank=r) for r in trace.ranks for e in trace.events(r) if e["kind"] == "collective"]


def _neighbours(r: int) -> int:
    return (r > 0) + (r < N - 1)


class CollTrace(Trace):
    """The golden trace plus collectives derived from its own conv2d calls: one all_to_all_single per
    forward conv per rank, sending the bytes of one halo row each way. Only to exercise the views'
    collective paths until collective recording (issue 4) lands; the numbers are recomputed here."""

    def get_collectives(self):
        ops = self.get_ops()
        conv = ops[(ops["op"] == "torch.conv2d") & (ops["phase"] == "forward")]
        rows = []
        for o in conv.itertuples():
            c, w = o.in_local_shapes[0][1], o.in_local_shapes[0][3]
            halo = 2 * c * w * 4
            rows.append({"rank": o.rank, "seq": 1000 + o.seq, "kind": "all_to_all_single", "group_ranks": [0, 1, 2, 3],
                         "mesh_dim": "domain", "bytes_sent": halo, "bytes_recv": halo,
                         "t_issue_ns": int(o.t_start_ns) + 1000, "t_done_ns": int(o.t_start_ns) + 501000,
                         "duration_ms": 0.5, "async": False, "op": o.op, "op_seq": o.seq, "outer_op": o.op,
                         "outer_op_seq": o.seq, "phase": "forward", "autograd_node": None, "param": None})
        return pd.DataFrame(rows)


# ---- timeline -------------------------------------------------------------------------------------
def test_timeline_frame_matches_payloads(trace):
    df = tl.timeline_frame(trace)
    raw = _raw_ops(trace)
    assert len(df) == len(raw)
    t0 = min(e["t_start_ns"] - trace.clock_offsets_ns[r] for (r, _), e in raw.items())
    for row in df.itertuples():
        e = raw[(row.rank, row.seq)]
        off = trace.clock_offsets_ns[row.rank]
        assert row.start_ms == pytest.approx((e["t_start_ns"] - off - t0) / 1e6)
        assert row.end_ms == pytest.approx((e["t_end_ns"] - off - t0) / 1e6)
        assert row.category == ("error" if e["error"] else e["path"])
        assert row.rank - 0.5 < row.y < row.rank + 0.5  # inside its rank's band
    conv = df[(df["op"] == "torch.conv2d") & (df["phase"] == "forward")]
    for r in range(N):  # hover shows the real local shapes of the conv input
        assert all(f"(1, 3, {ROWS[r]}, 64)" in h or f"(1, 4, {ROWS[r]}, 64)" in h for h in conv[conv["rank"] == r]["hover"])


def test_plot_timeline_one_row_per_rank(trace):
    fig = tl.plot_timeline(trace)
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(N)]
    assert list(fig.layout.yaxis.tickvals) == list(range(N))
    assert fig.layout.yaxis.range[0] > fig.layout.yaxis.range[1]  # rank 0 on top
    ops = trace.get_ops()
    spans = {d.name: int(np.isnan(d.x).sum()) for d in fig.data if d.mode == "lines" and d.legendgroup.startswith("op:")}
    hovers = {d.name: len(d.hovertext) for d in fig.data if d.mode == "markers" and d.legendgroup.startswith("op:")}
    assert hovers == spans  # one hover label per span
    expected = ops.assign(cat=ops["path"].where(ops["exc_type"].isna(), "error"))["cat"].value_counts()
    assert spans == {k.replace("_", " "): int(v) for k, v in expected.items()}
    assert all(d.type == "scattergl" for d in fig.data)
    n_coll = len(_raw_colls(trace))
    assert n_coll and f"{n_coll} collectives" in fig.layout.title.text
    coll = {d.name: int(np.isnan(d.x).sum()) for d in fig.data if d.mode == "lines" and d.legendgroup.startswith("coll:")}
    raw_kinds = pd.Series([c["coll"] for c in _raw_colls(trace)]).value_counts().to_dict()
    assert coll == raw_kinds
    nocoll = tl.plot_timeline(OpsOnlyTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta))
    assert "no collectives recorded" in nocoll.layout.title.text


def test_timeline_with_collectives_and_aggregation(trace):
    ct = CollTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta)
    coll = tl.collective_spans(ct)
    assert len(coll) == 2 * N and set(coll["kind"]) == {"all_to_all_single"}
    assert (coll["end_ms"] - coll["start_ms"]).round(6).eq(0.5).all()
    fig = tl.plot_timeline(ct)
    kinds = [d for d in fig.data if d.name == "all_to_all_single"]
    assert len(kinds) == 2 and int(np.isnan(kinds[0].x).sum()) == 2 * N and len(kinds[1].hovertext) == 2 * N
    assert "8 collectives" in fig.layout.title.text
    # aggregation: only depth-0 ops are drawn
    agg = tl.timeline_frame(trace, aggregate=True)
    assert len(agg) == int((trace.get_ops()["depth"] == 0).sum()) < len(trace.get_ops())


def test_comm_by_op(trace):
    df = tl.comm_by_op_frame(trace)
    raw = _raw_colls(trace)
    expected = {}
    for c in raw:  # from the payloads: bytes and count per (op on the stack, kind)
        e = expected.setdefault((c["op"], c["coll"]), [0, 0])
        e[0] += 1
        e[1] += c["bytes_sent"] + c["bytes_recv"]
    assert {(r.op, r.kind): [r.calls, r.bytes] for r in df.itertuples()} == expected
    # the halo exchange of the two forward convs, from the shapes: one row of 3 (then 4) channels x 64
    # columns x 4 bytes to each neighbour
    a2a = [c for c in raw if c["op"] == "torch.conv2d" and c["phase"] == "forward" and c["coll"] == "all_to_all_single"]
    for r in range(N):
        sent = sorted(c["bytes_sent"] for c in a2a if c["rank"] == r)
        assert sent == [_neighbours(r) * 3 * 64 * 4, _neighbours(r) * 4 * 64 * 4]
    fig = tl.plot_comm_by_op(trace)
    kinds = sorted({c["coll"] for c in raw})
    assert sorted({d.name for d in fig.data}) == kinds
    bars = {(y, d.name): x for d in fig.data if d.xaxis == "x" for y, x in zip(d.y, d.x)}
    for (op, kind), (_, b) in expected.items():
        assert bars[(op, kind)] == b
    empty = tl.plot_comm_by_op(OpsOnlyTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta))
    assert "no collectives recorded" in empty.layout.annotations[0].text
    ct = CollTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta)
    df = tl.comm_by_op_frame(ct)
    assert list(df["op"]) == ["torch.conv2d"] and int(df["calls"].iloc[0]) == 2 * N
    assert int(df["bytes"].iloc[0]) == N * (2 * 3 * 64 * 4 + 2 * 4 * 64 * 4) * 2
    assert df["comm_ms"].iloc[0] == pytest.approx(0.5 * 2 * N)


class OpsOnlyTrace(Trace):
    """A Trace without collective analyses (as before issue 4): the views compute from the ops."""

    get_imbalance = None
    get_collectives = None


def test_imbalance_from_ops(trace):
    t = OpsOnlyTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta)
    df = tl.imbalance_frame(t)
    conv = df[df["op"] == "torch.conv2d"].set_index("rank")
    for r in range(N):  # conv1 reads (1, 3, rows, 64), conv2 (1, 4, rows, 64)
        assert conv.loc[r, "volume"] == (3 + 4) * ROWS[r] * 64
        assert conv.loc[r, "calls"] == 2
    ops = trace.get_ops()
    host = ops[(ops["op"] == "torch.conv2d") & (ops["phase"] == "forward")].groupby("rank")["host_ms"].sum()
    assert conv["host_ms"].to_dict() == pytest.approx(host.to_dict())
    fig = tl.plot_imbalance(t)
    vol = fig.data[0]
    assert list(vol.x) == [f"rank {r}" for r in range(N)] and vol.visible
    fwd0 = ops[(ops["phase"] == "forward") & (ops["depth"] == 0)]
    expected = [sum(math.prod(s[0]) for s in fwd0[fwd0["rank"] == r]["in_local_shapes"] if s) for r in range(N)]
    assert list(vol.y) == expected
    assert fig.layout.updatemenus[0].buttons[0].label == "(all ops)"


def test_imbalance_from_trace_get_imbalance(trace):
    """With the Trace's own get_imbalance (issue 4), the view shows exactly its numbers."""
    imb = trace.get_imbalance()
    df = tl.imbalance_frame(trace)
    vol = next(c for c in tl._VOLUME_CANDIDATES if c in imb.columns)
    assert list(df["volume"]) == list(imb[vol]) and list(df["op"]) == list(imb["op"])
    for c in ("host_ms", "comm_ms", "wait_ms"):
        if c in imb:
            assert df[c].fillna(-1).tolist() == imb[c].fillna(-1).tolist()
    fig = tl.plot_imbalance(trace, op="torch.conv2d")
    shown = [d for d in fig.data if d.visible]
    assert shown[0].name == "shard volume" and all(d.showlegend is not False for d in shown)
    menu = fig.layout.updatemenus[0]
    assert menu.buttons[menu.active].label == "torch.conv2d"
    conv = imb[imb["op"] == "torch.conv2d"].set_index("rank")
    assert list(shown[0].y) == [conv.loc[r, vol] for r in range(N)]


def test_imbalance_uses_get_imbalance_when_present(trace):
    class ImbTrace(Trace):
        def get_imbalance(self):
            return pd.DataFrame({"op": ["torch.conv2d"] * N, "rank": list(range(N)),
                                 "shard_bytes": [r * 4 for r in ROWS], "host_ms": [1.0] * N,
                                 "comm_ms": [0.5] * N, "wait_ms": [float(r) for r in range(N)]})

    it = ImbTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta)
    df = tl.imbalance_frame(it)
    assert list(df["volume"]) == [r * 4 for r in ROWS] and set(df["volume_unit"]) == {"bytes"}
    assert {"host_ms", "comm_ms", "wait_ms"} <= set(df.columns)
    fig = tl.plot_imbalance(it)
    assert {d.name for d in fig.data} == {"shard volume", "host ms", "comm ms", "wait ms"}


# ---- explorer -------------------------------------------------------------------------------------
def test_explorer_order_and_counts(trace):
    df = ex.explorer_frame(trace)
    assert len(df) == len(trace.get_ops())
    kinds = list(df["kind"])
    assert kinds == sorted(kinds, key=ex.KIND_ORDER.get)  # errors, then fallbacks, then the rest
    errs = trace.get_errors()
    assert (df["kind"] == "error").sum() == len(errs) == N
    fb = trace.get_fallbacks()
    n_fb_fwd = int(fb["calls"].sum())
    assert ((df["kind"] == "fallback") & (df["phase"] == "forward")).sum() == n_fb_fwd
    first = df.iloc[:N]
    assert list(first["rank"]) == list(range(N)) and set(first["op"]) == {"Tensor.add"}
    assert set(first["error"]) == {f"TypeError: {HTML_MSG}"}


def test_op_detail_same_call_every_rank(trace):
    df = ex.explorer_frame(trace)
    conv0 = df[(df["op"] == "torch.conv2d") & (df["phase"] == "forward") & (df["rank"] == 2)].sort_values("seq").iloc[0]
    d = ex.op_detail(trace, 2, int(conv0["seq"]))
    pr = d["per_rank"]
    assert list(pr["rank"]) == list(range(N))
    assert [s[0] for s in pr["in_local_shapes"]] == [[1, 3, r, 64] for r in ROWS]
    assert all(s[0] == [1, 3, 66, 64] for s in pr["in_global_shapes"])
    assert [s for s in pr["out_local_shape"]] == [[1, 4, r, 64] for r in ROWS]
    assert d["row"]["module"] == "0" and d["row"]["path"] == "function_handler"
    assert d["row"]["user_frame"]
    # its collectives, on every rank: the halo all_to_all (one row of 3 channels to each neighbour)
    c = d["collectives"]
    fwd = c[c["phase"] == "forward"]
    assert list(fwd["rank"]) == list(range(N)) and set(fwd["kind"]) == {"all_to_all_single"}
    assert list(fwd["bytes_sent"]) == [_neighbours(r) * 3 * 64 * 4 for r in range(N)]
    # and in backward the gradient all_reduce of its weight (4x3x3x3 floats) and bias (4), on every rank
    bwd = c[c["phase"] == "backward"]
    grads = {(int(r), p): b for r, p, b in zip(bwd["rank"], bwd["param"], bwd["bytes_sent"]) if p}
    assert grads == {**{(r, "0.weight"): 4 * 3 * 3 * 3 * 4 for r in range(N)}, **{(r, "0.bias"): 4 * 4 for r in range(N)}}
    nocoll = OpsOnlyTrace(trace.payloads, trace.clock_offsets_ns, trace.incomplete_ranks, trace.meta)
    assert ex.op_detail(nocoll, 2, int(conv0["seq"]))["collectives"].empty
    with pytest.raises(KeyError, match="no op with seq 9999 on rank 0"):
        ex.op_detail(trace, 0, 9999)


def test_explorer_data_json_and_row_cap(trace):
    data = ex.explorer_data(trace)
    json.dumps(data, allow_nan=False)  # strict JSON: what the widget and the report ship
    assert data["total"] == len(trace.get_ops()) and data["left_out"] == 0
    assert data["counts"] == {"error": N, "fallback": int((ex.explorer_frame(trace)["kind"] == "fallback").sum()),
                              "op": len(trace.get_ops()) - N - int((ex.explorer_frame(trace)["kind"] == "fallback").sum())}
    # the compact encoding decodes to exactly the explorer's rows
    frame = ex.explorer_frame(trace)
    decoded = ex.decode_rows(data)
    assert len(decoded) == len(frame)
    for got, (_, want) in zip(decoded, frame.iterrows()):
        for f in ex.ROW_FIELDS:
            assert got[f] == ex._plain(want[f]), (f, got[f], want[f])
    small = ex.explorer_data(trace, max_rows=10)
    assert len(small["rows"]) == 10 and small["left_out"] == data["total"] - 10
    kinds = [r["kind"] for r in ex.decode_rows(small)]
    assert kinds[:N] == ["error"] * N and "op" not in kinds  # errors and fallbacks survive the cap
    w = trace.show()
    assert w.data["total"] == data["total"] and w.selected == []
    w.selected = [0, 0]
    assert w.detail()["row"]["op"] == "torch.conv2d"


# ---- inspector from saved snapshots ---------------------------------------------------------------
def test_inspector_layout_from_saved_snapshots():
    snaps = json.loads((DATA / "x_snapshots.json").read_text())
    lay = ShardLayout(snaps)
    df = lay.get_ranks()
    assert [s[2] for s in df["local_shape"]] == ROWS and [o[2] for o in df["offsets"]] == OFFS
    assert lay.warnings == []
    data = lay.to_json()
    json.dumps(data, allow_nan=False)
    blocks = data["pairs"][data["default_pair"]]["blocks"]
    assert [(b["row0"], b["row1"]) for b in blocks] == [(o, o + r) for o, r in zip(OFFS, ROWS)]
    # the same snapshots with rank 2 holding one row more than every spec says
    bad = copy.deepcopy(snaps)
    bad[2]["local_shape"][2] += 1
    lay = ShardLayout(bad)
    assert not lay.get_ranks().loc[2, "ok"] and lay.get_ranks()["ok"].sum() == N - 1
    assert any(w.startswith("rank 2 holds a local tensor of shape (1, 3, 17, 64)") and "(1, 3, 16, 64)" in w for w in lay.warnings)
    assert any("adding up to 67, but the global shape says 66" in w for w in lay.warnings)


# ---- report and escaping --------------------------------------------------------------------------
def _hostile_trace(tmp_path) -> Trace:
    """The golden trace with an op name and a module path that contain HTML."""
    d = _raw()
    for p in d["payloads"]:
        for e in p["events"]:
            if e.get("op") == "Tensor.abs":
                e["op"] = "<img src=x onerror=alert(1)>"
                e["module"] = "<i>mod</i>"
    path = tmp_path / "hostile.sdtrace.json"
    path.write_text(json.dumps(d))
    return sharddbg.load_trace(path)


def test_report_standalone_and_escaped(trace, tmp_path):
    t = _hostile_trace(tmp_path)
    out = t.to_html(tmp_path / "report.html")
    html = Path(out).read_text()
    # offline: plotly.js inlined, nothing fetched from a CDN
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=", html)
    assert "plotly.js v" in html and len(html) > 3_000_000  # (its code mentions a topojson CDN, for maps only)
    # every string from the trace escaped: the raw markup never appears, its escaped form does
    for raw in ("<b>bold</b>", "<script>alert('sharddbg')", "<img src=x", "<i>mod</i>"):
        assert raw not in html, raw
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;script&gt;alert(&#x27;sharddbg&#x27;)&lt;/script&gt;" in html
    assert "\\u003cimg src=x onerror=alert(1)\\u003e" in html  # inside the explorer's JSON
    # the sections are all there, with the trace's own numbers
    for section in ("Errors", "DTensor fallbacks", "Timeline", "Communication per op", "Imbalance", "Explorer"):
        assert f"<h2>{section}</h2>" in html
    assert f"{len(trace.ranks)} ranks · {len(trace.get_ops())} op calls" in html


def test_plotly_text_escaped(tmp_path):
    t = _hostile_trace(tmp_path)
    fig = tl.plot_timeline(t)
    texts = [h for d in fig.data if d.hovertext is not None for h in list(d.hovertext) if h]
    assert any("&lt;img src=x onerror=alert(1)&gt;" in h for h in texts)
    assert any("&lt;b&gt;bold&lt;/b&gt;" in h for h in texts)
    assert not any("<img" in h or "<b>bold" in h or "<i>mod" in h for h in texts)
    imb = tl.plot_imbalance(t)
    labels = [b.label for b in imb.layout.updatemenus[0].buttons]
    assert "&lt;img src=x onerror=alert(1)&gt;" in labels and not any("<img" in lab for lab in labels)


def test_trace_does_not_import_views():
    code = ("import sys, sharddbg; t = sharddbg.load_trace(sys.argv[1]); t.get_ops(); t.get_fallbacks(); "
            "bad = [m for m in ('plotly', 'anywidget', 'ipywidgets', 'sharddbg.views') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code, str(DATA / "conv4.sdtrace.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_views_on_a_trace_without_events(tmp_path):
    d = _raw()
    for p in d["payloads"]:
        p["events"] = []
    path = tmp_path / "empty.sdtrace.json"
    path.write_text(json.dumps(d))
    t = sharddbg.load_trace(path)
    fig = t.plot_timeline()
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(N)] and "0 op calls" in fig.layout.title.text
    assert "no collectives recorded" in t.plot_comm_by_op().layout.annotations[0].text
    assert "no ops recorded" in t.plot_imbalance().layout.annotations[0].text
    w = t.show()
    assert w.data["total"] == 0 and w.data["rows"] == []
    html = Path(t.to_html(tmp_path / "empty.html")).read_text()
    assert "No exceptions were raised." in html and "No op took a DTensor fallback." in html


def test_incomplete_rank_and_in_flight_op(tmp_path):
    d = _raw()
    p3 = d["payloads"][3]
    last = max(e["seq"] for e in p3["events"] if e["kind"] == "op")
    ev = next(e for e in p3["events"] if e["kind"] == "op" and e["seq"] == last)
    ev.update(t_end_ns=None, host_ms=None, in_flight=True)
    p3["complete"] = False
    d["incomplete_ranks"] = [3]
    path = tmp_path / "hung.sdtrace.json"
    path.write_text(json.dumps(d))
    t = sharddbg.load_trace(path)
    df = tl.timeline_frame(t)
    row = df[(df["rank"] == 3) & (df["seq"] == last)].iloc[0]
    assert row["end_ms"] == df["end_ms"].max() >= row["start_ms"]  # drawn up to the last recorded time
    fig = tl.plot_timeline(t)
    assert any("incomplete ranks (timed out or sent nothing): [3]" in a.text for a in fig.layout.annotations)
    data = ex.explorer_data(t)
    assert data["incomplete_ranks"] == [3]
    hung = [r for r in ex.decode_rows(data) if r["rank"] == 3 and r["seq"] == last]
    assert hung[0]["in_flight"] is True and hung[0]["host_ms"] is None


def test_timeline_overview_bins(trace):
    bins = 40
    ops = tl.timeline_frame(trace)
    x0, x1 = float(ops["start_ms"].min()), float(ops["end_ms"].max())
    ov = tl.timeline_overview(ops, "ops", bins, x0, x1)
    w = (x1 - x0) / bins
    for r in range(N):  # the bins each rank's spans touch, computed span by span
        mine = ops[ops["rank"] == r]
        touched = set()
        for s, e in zip(mine["start_ms"], mine["end_ms"]):
            touched |= set(range(min(int((s - x0) // w), bins - 1), min(int((e - x0) // w), bins - 1) + 1))
        got = ov[ov["rank"] == r]
        assert set(got["bin"]) == touched
        # the bin where the error was raised is marked; every bin's colour is its most frequent path
        err = mine[mine["category"] == "error"].iloc[0]
        assert got[got["bin"] == min(int((err["start_ms"] - x0) // w), bins - 1)]["has_error"].iloc[0]
        for b in got.itertuples():
            assert b.n_spans == sum(b.counts.values()) and b.counts[b.category] == max(b.counts.values())
            assert b.has_error == ("error" in b.counts)
    fig = tl.plot_timeline(trace, overview=True)
    (hm,) = [d for d in fig.data if d.type == "heatmap"]
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(N)]
    assert "overview" in fig.layout.title.text and not any(d.type == "scattergl" for d in fig.data)
    coll = tl.collective_spans(trace).assign(category=lambda d: d["kind"])
    lo, hi = min(x0, coll["start_ms"].min()), max(x1, coll["end_ms"].max())
    cells = len(tl.timeline_overview(ops, "ops", tl.OVERVIEW_BINS, lo, hi)) + \
        len(tl.timeline_overview(coll, "collectives", tl.OVERVIEW_BINS, lo, hi))
    assert int(np.isfinite(np.array(hm.z, dtype=float)).sum()) == cells > 0
    assert sum(1 for row in hm.text for t in row if t) == cells
    # a window drawn span by span: only the spans that overlap it
    a, b = x0 + (x1 - x0) * 0.25, x0 + (x1 - x0) * 0.5
    win = tl.plot_timeline(trace, time_range=(a, b))
    drawn = sum(int(np.isnan(d.x).sum()) for d in win.data if d.mode == "lines" and d.legendgroup.startswith("op:"))
    assert drawn == int(((ops["end_ms"] >= a) & (ops["start_ms"] <= b)).sum()) and list(win.layout.xaxis.range) == [a, b]
