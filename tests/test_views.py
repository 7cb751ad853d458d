"""The data behind every view, on golden traces recorded from a real 4-rank run (tests/data, regenerate
with tests/data/make_golden.py). No cluster, no browser. Expected values are computed here from the
sample's shape (66 rows over 4 ranks) or from the raw per-rank payloads, not from the views.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

import sharddbg
from sharddbg.analysis.comm import COLLECTIVE_COLUMNS, COLLECTIVE_EXTRA_COLUMNS, NO_OP, comm_by_op_kind
from sharddbg.analysis.formatting import format_bytes, format_shape, json_value
from sharddbg.analysis.layout import ShardLayout
from sharddbg.analysis.ops import is_metadata_op
from sharddbg.analysis.timeline import OVERVIEW_COLUMNS, timeline_overview
from sharddbg.exporters.perfetto import perfetto_dict
from sharddbg.trace import Trace
from sharddbg.views import explorer as ex
from sharddbg.views import timeline as tl
from sharddbg.views.comm import plot_comm_by_op
from sharddbg.views.imbalance import plot_imbalance

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


def _load(d: dict, tmp_path, name: str) -> Trace:
    """Write a (modified) raw trace file and read it back the way a user would."""
    path = tmp_path / f"{name}.sdtrace.json"
    path.write_text(json.dumps(d))
    return sharddbg.load_trace(path)


def _raw_ops(trace):
    """(rank, seq) -> raw op event, straight from the payloads."""
    return {(r, e["seq"]): e for r in trace.ranks for e in trace.events(r) if e["kind"] == "op"}


def _raw_colls(trace):
    """Collective records straight from the payloads, with their rank."""
    return [dict(e, rank=r) for r in trace.ranks for e in trace.events(r) if e["kind"] == "collective"]


def _neighbours(r: int) -> int:
    return (r > 0) + (r < N - 1)


def _without_collectives(tmp_path, schema_version: int = 2) -> Trace:
    """The golden trace as recorded without collective capture (``recorder.start(comm=False)``: no
    collective records, payload meta ``comm`` False) or, with ``schema_version=1``, as an old trace file
    from before collective records existed."""
    d = _raw()
    for p in d["payloads"]:
        p["events"] = [e for e in p["events"] if e["kind"] != "collective"]
        p["schema_version"] = schema_version
        if schema_version >= 2:
            p["meta"]["comm"] = False
        else:
            del p["meta"]["comm"]
    d["schema_version"] = schema_version
    return _load(d, tmp_path, f"nocoll{schema_version}")


def _with_collective_outside_ops(tmp_path) -> Trace:
    """The golden trace with rank 1's redistribute all_reduce issued outside any recorded op."""
    d = _raw()
    ev = next(e for e in d["payloads"][1]["events"] if e["kind"] == "collective" and e["coll"] == "all_reduce"
              and e["phase"] == "forward")
    ev.update(op=None, op_seq=None, outer_op=None, outer_op_seq=None)
    return _load(d, tmp_path, "outside")


def _time_origin(trace) -> int:
    """The first event of the trace (op start or collective issue), from the payloads."""
    starts = [e["t_start_ns"] - trace.clock_offsets_ns[r] for (r, _), e in _raw_ops(trace).items()]
    starts += [c["t_issue_ns"] - trace.clock_offsets_ns[c["rank"]] for c in _raw_colls(trace)]
    return min(starts)


def _shard_elems(ev) -> int:
    """Elements of the distributed arguments of one raw op event (plain tensors have no placements)."""
    return sum(math.prod(s) for s, pl in zip(ev["in_local_shapes"], ev["in_placements"]) if pl is not None)


# ---- timeline -------------------------------------------------------------------------------------
def test_timeline_frame_matches_payloads(trace):
    df = tl.timeline_frame(trace)
    raw = _raw_ops(trace)
    assert len(df) == len(raw)
    t0 = _time_origin(trace)
    for row in df.itertuples():
        e = raw[(row.rank, row.seq)]
        off = trace.clock_offsets_ns[row.rank]
        assert row.start_ms == pytest.approx((e["t_start_ns"] - off - t0) / 1e6)
        assert row.end_ms == pytest.approx((e["t_end_ns"] - off - t0) / 1e6)
        assert row.category == ("error" if e["error"] else e["path"])
        assert row.rank - 0.5 < row.y < row.rank + 0.5  # inside its rank's band
        # a whole backward pass has its own lane, above the ops it contains
        wide = e["op"] in ("Tensor.backward", "ShardTensor.backward")
        assert row.lane == ("autograd" if wide else "ops") and row.label == e["op"].rsplit(".", 1)[-1]
        assert (row.y == pytest.approx(row.rank + tl.AUTOGRAD_LANE)) == wide
        assert row.hover.startswith(f"<b>{e['op']}</b> · rank {row.rank} · seq {row.seq}<br>")
        assert f"bytes in {format_bytes(e['in_bytes'])} · out {format_bytes(e['out_bytes'])}" in row.hover
    # the ops of the backward pass (nested two deep, in ShardTensor.backward > Tensor.backward) sit in the
    # first op lane, like the forward ops, below the autograd spans that cover them
    bwd = df[df["phase"] == "backward"]
    assert len(bwd) and (bwd["y"] - bwd["rank"]).round(6).eq(round(tl.OP_LANE0, 6)).all()
    assert (df.loc[df["lane"] == "autograd", "y"] - df.loc[df["lane"] == "autograd", "rank"]).max() < tl.OP_LANE0 - tl.BAR_HEIGHT
    conv = df[(df["op"] == "torch.conv2d") & (df["phase"] == "forward")]
    for r in range(N):  # hover shows the real local shapes of the conv inputs: conv1 (3 channels), conv2 (4)
        assert sorted(re.search(r"in \((1, \d, \d+, 64)\)", h).group(1) for h in conv[conv["rank"] == r]["hover"]) == \
            [f"1, 3, {ROWS[r]}, 64", f"1, 4, {ROWS[r]}, 64"]


def test_collective_spans_match_payloads(trace):
    spans = tl.collective_spans(trace)
    raw = _raw_colls(trace)
    t0 = _time_origin(trace)
    assert len(spans) == len(raw) == 8 * N
    by_key = {(c["rank"], c["seq"]): c for c in raw}
    for s in spans.itertuples():
        c = by_key[(s.rank, s.seq)]
        off = trace.clock_offsets_ns[s.rank]
        assert s.kind == s.category == c["coll"] and s.op == c["op"]
        assert s.start_ms == pytest.approx((c["t_issue_ns"] - off - t0) / 1e6)
        assert s.end_ms == pytest.approx((c["t_done_ns"] - off - t0) / 1e6)  # issue to the return of its wait
        assert s.rank < s.y < s.rank + 0.5  # below the op lanes of its rank
        # the op that issued it, and the user's call it belongs to where that is another (the per-op views' op)
        owner = _owner(trace, c)
        inside = f" (in {owner})" if owner != c["op"] else ""
        assert f"from op {c['op']}{inside}<br>sent {format_bytes(c['bytes_sent'])}" in s.hover


def _lane_ticks(fig) -> dict[float, str]:
    return {round(v, 6): t for v, t in zip(fig.layout.yaxis.tickvals, fig.layout.yaxis.ticktext)}


def test_plot_timeline_one_band_per_rank(trace, tmp_path):
    fig = tl.plot_timeline(trace)
    # every lane is labelled: the rank at its first op lane, the autograd and collectives lanes by name
    ticks = _lane_ticks(fig)
    for r in range(N):
        assert ticks[round(r + tl.OP_LANE0, 6)] == f"rank {r}"
        assert ticks[round(r + tl.COLL_LANE, 6)] == "collectives" and ticks[round(r + tl.AUTOGRAD_LANE, 6)] == "autograd"
    assert len(ticks) == 3 * N
    assert fig.layout.yaxis.range[0] > fig.layout.yaxis.range[1]  # rank 0 on top
    ops = trace.get_ops()
    frame = tl.timeline_frame(trace)
    # one bar per span (a hover anywhere on it shows its label), from its start to its end
    bars = {d.name: d for d in fig.data if d.type == "bar" and d.legendgroup.startswith("op:")}
    expected = ops.assign(cat=ops["path"].where(ops["exc_type"].isna(), "error"))["cat"].value_counts()
    assert {k: len(d.x) for k, d in bars.items()} == {k.replace("_", " "): int(v) for k, v in expected.items()}
    assert all(len(d.hovertext) == len(d.x) and d.hoverinfo == "text" for d in bars.values())
    for cat, part in frame.groupby("category"):
        d = bars[cat.replace("_", " ")]
        assert np.allclose(d.base, part["start_ms"]) and np.all(np.asarray(d.base) + np.asarray(d.x) >= part["end_ms"] - 1e-9)
        assert list(d.text) == [o.rsplit(".", 1)[-1] for o in part["op"]]  # names inside the spans that hold them
    assert fig.layout.uniformtext.mode == "hide"  # a name that does not fit is not drawn
    raw_kinds = pd.Series([c["coll"] for c in _raw_colls(trace)]).value_counts().to_dict()
    assert raw_kinds == {"all_to_all_single": 3 * N, "all_reduce": 5 * N}
    assert f"{sum(raw_kinds.values())} collectives" in fig.layout.title.text
    coll = {d.name: len(d.x) for d in fig.data if d.type == "bar" and d.legendgroup.startswith("coll:")}
    assert coll == raw_kinds
    # room on both sides: the first and the last span are not clipped
    spans = pd.concat([frame[["start_ms", "end_ms"]], tl.collective_spans(trace)[["start_ms", "end_ms"]]])
    lo, hi = fig.layout.xaxis.range
    assert lo < spans["start_ms"].min() and hi > spans["end_ms"].max() + 0.01 * (spans["end_ms"].max() - spans["start_ms"].min())
    assert set(tl.CLOUD_BUTTONS) <= set(fig.layout.modebar.remove)  # no button sends the chart to a cloud service
    assert not any(d.type == "scattergl" for d in fig.data)
    nocoll = tl.plot_timeline(_without_collectives(tmp_path))
    assert "no collectives recorded" in nocoll.layout.title.text
    assert not any(d.legendgroup and d.legendgroup.startswith("coll:") for d in nocoll.data)
    assert "collectives" not in nocoll.layout.yaxis.ticktext


def test_timeline_right_margin_holds_its_legend(trace):
    """The timeline's right margin is sized from the longest text its legend shows (entries and group titles; the
    heatmap and the traces left out of the legend show none), as plotly shows it (HTML tags and entities as text), so
    that plotly need not widen it and draw the figure twice (tests/test_browser.py checks it in chromium)."""
    import plotly.graph_objects as go

    fig = tl.plot_timeline(trace)
    shown = [d.name for d in fig.data if d.showlegend is not False and d.type != "heatmap"]
    shown += [d.legendgrouptitle.text for d in fig.data if d.legendgrouptitle is not None and d.legendgrouptitle.text]
    longest = max(len(x) for x in shown)
    per_char, fixed = tl.LEGEND_CHAR_PX, tl.LEGEND_ENTRY_PX + tl.LEGEND_GAP_PX
    assert fig.layout.margin.r == math.ceil(fixed + per_char * longest)
    assert fig.layout.margin.b == tl.MARGIN_BOTTOM
    entry = go.Scatter(x=[1], y=[1], name="a &amp; <b>b</b>")  # shown as "a & b": 5 characters
    assert tl.legend_margin(go.Figure([entry])) == math.ceil(fixed + 5 * per_char)
    wide = go.Heatmap(z=[[1]], name="x" * 90)
    hidden = go.Scatter(x=[1], y=[1], name="y" * 90, showlegend=False)
    titled = go.Scatter(x=[1], y=[1], name="c", legendgroup="g", legendgrouptitle_text="a group title")
    assert tl.legend_margin(go.Figure([entry, wide, hidden])) == math.ceil(fixed + 5 * per_char)
    assert tl.legend_margin(go.Figure([entry, titled])) == math.ceil(fixed + 13 * per_char)
    assert tl.legend_margin(go.Figure([wide])) == tl.MARGIN_RIGHT_MIN


def test_timeline_many_spans_drawn_as_webgl_lines(trace, monkeypatch):
    monkeypatch.setattr(tl, "BARS_UP_TO", 10)
    fig = tl.plot_timeline(trace)
    ops = trace.get_ops()
    spans = {d.name: int(np.isnan(d.x).sum()) for d in fig.data if d.mode == "lines" and d.legendgroup.startswith("op:")}
    hovers = {d.name: len(d.hovertext) for d in fig.data if d.mode == "markers" and d.legendgroup.startswith("op:")
              and d.name != "error raised"}
    assert hovers == spans  # one hover label per span
    expected = ops.assign(cat=ops["path"].where(ops["exc_type"].isna(), "error"))["cat"].value_counts()
    assert spans == {k.replace("_", " "): int(v) for k, v in expected.items()}
    assert not any(d.type == "bar" for d in fig.data)


def test_two_groups_of_the_same_ranks_are_matched_apart(trace):
    """Every collective issued again on a second group of the same ranks (as the world group and a domain
    sub-mesh of every rank are): the timeline, the arrival waits and the mismatch check all match collectives
    by group and number, so each group's k-th collective is its own, lined up across its ranks."""
    from sharddbg.analysis.comm import arrival_wait_ms, matched_collectives

    payloads = {}
    for r in trace.ranks:
        p = copy.deepcopy(trace.payloads[r])
        extra = [dict(e, group_name="world", seq=e["seq"] + 10**6) for e in p["events"] if e["kind"] == "collective"]
        p["events"] = p["events"] + extra
        payloads[r] = p
    twice = Trace.from_payloads(payloads, trace.clock_offsets_ns)
    colls = twice.get_collectives()
    same = matched_collectives(colls)
    assert same.nunique() == 16  # 8 per group
    assert (colls.groupby(same)["rank"].apply(sorted) == pd.Series([list(range(N))] * 16)).all()
    links = tl.collective_links(twice)
    assert len(links) == 16 and all(link.ranks == list(range(N)) for link in links.itertuples())
    assert twice.get_collective_mismatches().empty
    # each group's waits are its own: the same as on the trace with one group
    once = trace.get_collectives()
    waits = arrival_wait_ms(colls)
    assert waits[colls["group_name"] != "world"].tolist() == pytest.approx(arrival_wait_ms(once).tolist())


def test_collectives_linked_across_ranks(trace):
    """The same collective (same group, same group_seq) on every rank: one link, from the payloads."""
    links = tl.collective_links(trace)
    t0 = _time_origin(trace)
    issued = {}
    for c in _raw_colls(trace):
        issued.setdefault(c["group_seq"], {})[c["rank"]] = (c["t_issue_ns"] - trace.clock_offsets_ns[c["rank"]] - t0) / 1e6
    assert sorted(links["group_seq"]) == sorted(issued) and len(links) == 8
    for link in links.itertuples():
        times = issued[link.group_seq]
        assert link.ranks == sorted(times) == list(range(N))
        assert link.start_ms == pytest.approx([times[r] for r in link.ranks])
        assert link.last_rank == max(times, key=times.get) and link.first_rank == min(times, key=times.get)
        assert link.lag_ms == pytest.approx(max(times.values()) - min(times.values()))
        assert link.group == "domain ranks [0, 1, 2, 3]"
    fig = tl.plot_timeline(trace)
    (drawn,) = [d for d in fig.data if d.name == "same collective on every rank"]
    xs = [x for x in drawn.x if x is not None]
    assert len(xs) == 8 * N and sorted(xs) == pytest.approx(sorted(t for v in issued.values() for t in v.values()))
    span = tl.collective_spans(trace).iloc[0]
    link = links[links["group_seq"] == span["group_seq"]].iloc[0]
    assert f"rank {link.last_rank} issued it last, {link.lag_ms:.3f} ms after rank {link.first_rank}" in span["hover"]


def _hue(color: str) -> float:
    import colorsys

    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


def test_collective_colours_apart_from_fallbacks():
    from sharddbg.views.common import COLLECTIVE_KIND_COLORS, OTHER_COLLECTIVE_COLORS, PATH_COLORS, collective_colors

    fallbacks = [_hue(PATH_COLORS[p]) for p in ("dtensor_fallback_function", "dtensor_fallback_dispatch")]
    for color in list(COLLECTIVE_KIND_COLORS.values()) + OTHER_COLLECTIVE_COLORS:
        for f in fallbacks:
            assert min(abs(_hue(color) - f), 360 - abs(_hue(color) - f)) >= 60, (color, f)
    assert collective_colors(["all_to_all_single", "zzz_new_kind"])["all_to_all_single"] == COLLECTIVE_KIND_COLORS["all_to_all_single"]


def test_timeline_aggregation(trace):
    full = tl.timeline_frame(trace)
    agg = tl.timeline_frame(trace, aggregate=True)
    # what stays: the autograd spans and the ops of the first op lane (top-level, or right inside a backward pass)
    first = full[(full["lane"] == "autograd") | ((full["y"] - full["rank"]).round(6) == round(tl.OP_LANE0, 6))]
    assert len(agg) == len(first) < len(full) and set(zip(agg["rank"], agg["seq"])) == set(zip(first["rank"], first["seq"]))
    assert (agg["phase"] == "backward").any()
    fig = tl.plot_timeline(trace, aggregate=True)
    assert f"nested ops merged ({len(agg)} spans drawn)" in fig.layout.title.text


# ---- communication per op -------------------------------------------------------------------------
def _owner(trace, c) -> str:
    """The op a collective belongs to in the per-op views, from the payloads: the user's own call (depth 0) around
    the call that issued it, found by walking the op records' parents."""
    if c["op_seq"] is None:
        return c["op"] or NO_OP
    records = {e["seq"]: e for e in trace.events(c["rank"]) if e["kind"] == "op"}
    seq = c["op_seq"]
    while records[seq]["parent_seq"] is not None:
        seq = records[seq]["parent_seq"]
    return records[seq]["op"]


def test_comm_by_op(trace):
    df = comm_by_op_kind(trace.get_collectives())
    raw = _raw_colls(trace)
    expected = {}
    for c in raw:  # from the payloads: count, bytes and time per (op on the stack, kind)
        e = expected.setdefault((c["op"], c["coll"]), [0, 0, 0.0])
        e[0] += 1
        e[1] += c["bytes_sent"] + c["bytes_recv"]
        e[2] += (c["t_done_ns"] - c["t_issue_ns"]) / 1e6
    got = {(r.op, r.kind): [r.calls, r.bytes, r.comm_ms] for r in df.itertuples()}
    assert got.keys() == expected.keys()
    for k, (calls, b, ms) in expected.items():
        assert got[k][:2] == [calls, b] and got[k][2] == pytest.approx(ms)
    assert list(df["bytes"]) == sorted(df["bytes"], reverse=True)
    # the halo exchange of the two forward convs, from the shapes: one row of 3 (then 4) channels x 64
    # columns x 4 bytes to each neighbour
    a2a = [c for c in raw if c["op"] == "torch.conv2d" and c["phase"] == "forward" and c["coll"] == "all_to_all_single"]
    for r in range(N):
        sent = sorted(c["bytes_sent"] for c in a2a if c["rank"] == r)
        assert sent == [_neighbours(r) * 3 * 64 * 4, _neighbours(r) * 4 * 64 * 4]
    # the figure: each collective under the user's own call it was issued in (as the op summary counts it)
    owned = {}
    for c in raw:
        e = owned.setdefault((_owner(trace, c), c["coll"]), [0, 0.0])
        e[0] += c["bytes_sent"] + c["bytes_recv"]
        e[1] += (c["t_done_ns"] - c["t_issue_ns"]) / 1e6
    assert owned.keys() != expected.keys()  # the golden trace has collectives issued by nested calls
    fig = plot_comm_by_op(trace)
    kinds = sorted({c["coll"] for c in raw})
    assert sorted({d.name for d in fig.data}) == kinds
    bars = {(y, d.name): x for d in fig.data if d.xaxis == "x" for y, x in zip(d.y, d.x) if x}
    times = {(y, d.name): x for d in fig.data if d.xaxis == "x2" for y, x in zip(d.y, d.x) if x}
    assert bars.keys() == set(owned)
    for (op, kind), (b, ms) in owned.items():
        assert bars[(op, kind)] == b and times[(op, kind)] == pytest.approx(ms)


def test_comm_without_collectives(tmp_path):
    for t in (_without_collectives(tmp_path), _without_collectives(tmp_path, schema_version=1)):
        colls = t.get_collectives()
        assert colls.empty and list(colls.columns) == COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS
        assert not t.collectives_recorded
        assert comm_by_op_kind(colls).empty
        assert "no collectives recorded" in plot_comm_by_op(t).layout.annotations[0].text
        assert len(t.get_ops()) == len(sharddbg.load_trace(DATA / "conv4.sdtrace.json").get_ops())


def test_collectives_outside_ops_have_one_name(trace, tmp_path):
    t = _with_collective_outside_ops(tmp_path)
    assert NO_OP == "<outside recorded ops>"
    kinds = comm_by_op_kind(t.get_collectives())
    (row,) = kinds[kinds["op"] == NO_OP].itertuples()
    assert (row.kind, row.calls, row.bytes) == ("all_reduce", 1, 8)
    assert NO_OP in set(t.get_comm_by_op()["op"]) and NO_OP in set(t.get_imbalance()["op"])
    # the figures say the same, escaped
    fig = plot_comm_by_op(t)
    assert "&lt;outside recorded ops&gt;" in {y for d in fig.data for y in d.y}
    spans = tl.collective_spans(t)
    (hover,) = spans[spans["op"].isna()]["hover"]
    assert "from op &lt;outside recorded ops&gt;" in hover


# ---- imbalance ------------------------------------------------------------------------------------
def test_imbalance_figure_draws_get_imbalance(trace):
    imb = trace.get_imbalance()
    fig = plot_imbalance(trace, op="torch.conv2d")
    shown = [d for d in fig.data if d.visible]
    assert [d.name for d in shown] == ["shard volume", "host ms", "comm ms", "wait ms"]
    assert all(list(d.x) == [f"rank {r}" for r in range(N)] for d in shown)
    menu = fig.layout.updatemenus[0]
    assert menu.buttons[menu.active].label == "torch.conv2d" and menu.buttons[0].label == "(all ops)"
    conv = imb[imb["op"] == "torch.conv2d"].set_index("rank")
    for d, col in zip(shown, ("shard_elems", "host_ms", "comm_ms", "wait_ms")):
        assert list(d.y) == pytest.approx([conv.loc[r, col] for r in range(N)])
    # the volume, from the payloads: every distributed argument of the forward calls
    raw = _raw_ops(trace)
    for r in range(N):
        fwd = [e for (rr, _), e in raw.items() if rr == r and e["op"] == "torch.conv2d" and e["phase"] == "forward"]
        assert conv.loc[r, "shard_elems"] == sum(_shard_elems(e) for e in fwd) == (3 + 4) * ROWS[r] * 64
    # all ops together: the sums over ops per rank
    fig = plot_imbalance(trace)
    shown = [d for d in fig.data if d.visible]
    per_rank = imb.groupby("rank")[["shard_elems", "host_ms", "comm_ms", "wait_ms"]].sum()
    for d, col in zip(shown, per_rank.columns):
        assert list(d.y) == pytest.approx(list(per_rank[col]))


def test_imbalance_counts_every_sharded_argument(trace, tmp_path):
    """x + x has two sharded arguments: both count, with or without collectives recorded."""
    for t in (trace, _without_collectives(tmp_path)):
        add = t.get_imbalance().set_index(["op", "rank"])
        for r in range(N):
            assert add.loc[("Tensor.add", r), "shard_elems"] == 2 * 3 * ROWS[r] * 64
    imb = _without_collectives(tmp_path).get_imbalance()
    assert (imb["comm_ms"] == 0).all() and (imb["wait_ms"] == 0).all()
    conv = imb[imb["op"] == "torch.conv2d"].set_index("rank")
    host = trace.get_ops().query("op == 'torch.conv2d'").groupby("rank")["host_ms"].sum()
    assert conv["host_ms"].to_dict() == pytest.approx(host.to_dict())  # forward and backward events


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
    raw = _raw_ops(trace)
    for row in df.itertuples():  # a fallback: its path is a DTensor fallback, or its handler fell back; neither a
        e = raw[(row.rank, row.seq)]  # call that runs the whole backward pass (Tensor.backward) nor a metadata read is one
        expected = not e["error"] and (e["path"].startswith("dtensor_fallback") or e["fallback"]) and \
            not e["op"].endswith(".backward") and not is_metadata_op(e["op"])
        assert (row.kind == "fallback") == expected, e["op"]
    spans = tl.timeline_frame(trace).set_index(["rank", "seq"])["start_ms"]  # one time axis for both views
    assert df.set_index(["rank", "seq"])["t_start_ms"].sort_index().tolist() == pytest.approx(spans.sort_index().tolist())
    first = df.iloc[:N]
    assert list(first["rank"]) == list(range(N)) and set(first["op"]) == {"Tensor.add"}
    assert set(first["error"]) == {f"TypeError: {HTML_MSG}"}


def test_op_detail_same_call_every_rank(trace, tmp_path):
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
    assert list(c.columns) == ex.COLL_FIELDS
    fwd = c[c["phase"] == "forward"]
    assert list(fwd["rank"]) == list(range(N)) and set(fwd["kind"]) == {"all_to_all_single"}
    assert list(fwd["bytes_sent"]) == [_neighbours(r) * 3 * 64 * 4 for r in range(N)]
    # and in backward the gradient all_reduce of its weight (4x3x3x3 floats) and bias (4), on every rank
    bwd = c[c["phase"] == "backward"]
    grads = {(int(r), p): b for r, p, b in zip(bwd["rank"], bwd["param"], bwd["bytes_sent"]) if p}
    assert grads == {**{(r, "0.weight"): 4 * 3 * 3 * 3 * 4 for r in range(N)}, **{(r, "0.bias"): 4 * 4 for r in range(N)}}
    nocoll = ex.op_detail(_without_collectives(tmp_path), 2, int(conv0["seq"]))["collectives"]
    assert nocoll.empty and list(nocoll.columns) == ex.COLL_FIELDS
    with pytest.raises(KeyError, match="no op with seq 9999 on rank 0"):
        ex.op_detail(trace, 0, 9999)


def test_explorer_data_json_and_row_cap(trace, tmp_path):
    data = ex.explorer_data(trace)
    json.dumps(data, allow_nan=False)  # strict JSON: what the widget and the report ship
    frame = ex.explorer_frame(trace)
    n_fb = int((frame["kind"] == "fallback").sum())
    assert data["total"] == len(trace.get_ops()) and data["left_out"] == 0
    assert data["counts"] == {"error": N, "fallback": n_fb, "op": len(trace.get_ops()) - N - n_fb}
    assert data["has_collectives"] is True and len(data["collectives"]) == len(_raw_colls(trace))
    assert data["incomplete_ranks"] == [] and data["dropped"] == 0
    # the compact encoding decodes to exactly the explorer's rows
    decoded = ex.decode_rows(data)
    assert len(decoded) == len(frame)
    for got, (_, want) in zip(decoded, frame.iterrows()):
        for f in ex.ROW_FIELDS:
            assert got[f] == json_value(want[f]), (f, got[f], want[f])
    small = ex.explorer_data(trace, max_rows=10)
    assert len(small["rows"]) == 10 and small["left_out"] == data["total"] - 10
    kinds = [r["kind"] for r in ex.decode_rows(small)]
    assert kinds[:N] == ["error"] * N and "op" not in kinds  # errors and fallbacks survive the cap
    assert small["summary"] == data["summary"]  # the summary counts every call, whatever the cap
    nocoll = ex.explorer_data(_without_collectives(tmp_path))
    assert nocoll["has_collectives"] is False and nocoll["collectives"] == []
    w = trace.show()
    assert w.data["total"] == data["total"] and w.selected == []
    w.selected = [0, 0]
    assert w.detail()["row"]["op"] == "torch.conv2d"


def _summary_members(trace) -> dict[tuple, set]:
    """(op, path, phase) -> the (rank, seq) of the calls a row of get_op_summary() counts, from the payloads:
    the user's own forward calls (depth 0) and every backward call."""
    out: dict[tuple, set] = {}
    for (r, s), e in _raw_ops(trace).items():
        if e["phase"] == "backward" or e["depth"] == 0:
            out.setdefault((e["op"], e["path"], e["phase"]), set()).add((r, s))
    return out


def test_explorer_opens_on_the_op_summary(trace):
    expected = trace.get_op_summary()
    summary = ex.summary_frame(trace)
    assert len(summary) == len(expected) == 13
    # the same rows as get_op_summary(), every column equal; errors first, then fallbacks, each in its order
    assert list(summary.columns) == list(expected.columns) + ["kind", "spec_mismatches"]
    assert (summary["spec_mismatches"] == 0).all()  # the golden trace's specs agree with their data
    key = ["op", "path", "phase"]
    position = {tuple(k): i for i, k in enumerate(expected[key].itertuples(index=False, name=None))}
    got_order = [position[tuple(k)] for k in summary[key].itertuples(index=False, name=None)]
    assert sorted(got_order) == list(range(len(expected)))
    for row in summary.itertuples(index=False):
        want = expected.iloc[position[(row.op, row.path, row.phase)]]
        for c in expected.columns:
            assert json_value(getattr(row, c)) == json_value(want[c]), c
    ranked = [(ex.KIND_ORDER[k], i) for k, i in zip(summary["kind"], got_order)]
    assert ranked == sorted(ranked)
    # a row's kind is its calls': the add that raised, the ops through a DTensor fallback (forward and backward)
    assert list(summary["kind"]) == ["error"] + ["fallback"] * 5 + ["op"] * 7
    assert summary.iloc[0][key].tolist() == ["Tensor.add", "function_handler", "forward"] and summary.iloc[0]["errors"] == N
    assert set(summary.loc[summary["kind"] == "fallback", "path"]) == {"dtensor_fallback_function"}
    # each row expands to exactly the calls it counts (no nested forward call: those are in the list only)
    frame = ex.explorer_frame(trace)
    members = _summary_members(trace)
    assert set(members) == set(position)
    for i, row in enumerate(summary.itertuples(index=False)):
        mine = frame[frame["summary_row"] == i]
        assert set(zip(mine["rank"], mine["seq"])) == members[(row.op, row.path, row.phase)]
        assert len(mine) == row.calls and sorted(set(mine["rank"])) == row.ranks
    nested = frame[frame["summary_row"].isna()]
    assert set(nested["op"]) == {"Tensor.ndim.__get__", "ShardTensor.redistribute", "Tensor.backward"}
    assert (nested["phase"] == "forward").all() and (nested["depth"] > 0).all() and nested["call_group"].isna().all()
    # what the front end opens on: the same rows, JSON-able, each with the rows it expands to
    data = ex.explorer_data(trace)
    assert data["summary"] == ex.op_summary(trace)
    assert len(data["summary"]) == len(summary)
    for shipped, row in zip(data["summary"], summary.to_dict("records")):
        assert {k: shipped[k] for k in row} == {k: json_value(v) for k, v in row.items()}
        assert shipped["ranks_text"] == "ranks 0-3"
        assert sum(g["calls"] for g in shipped["groups"]) == row["calls"]


def test_identical_calls_collapse_into_one_row(trace, tmp_path):
    frame = ex.explorer_frame(trace)
    groups = ex.call_groups(trace)
    summary = ex.summary_frame(trace)
    ops = trace.get_ops().set_index(["rank", "seq"])
    # the expected partition, from the calls themselves: same summary row and equal shapes, placements, path,
    # dtype, module, location (cell and line: the same on every rank), error; times may differ
    same = ["in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape", "placements", "in_placements",
            "path", "dtype", "module", "location", "error", "in_flight"]
    expected: dict[tuple, set] = {}
    for r in frame[frame["summary_row"].notna()].itertuples(index=False):
        o = ops.loc[(r.rank, r.seq)]
        ident = json.dumps([int(r.summary_row), r.kind] + [json_value(o[c]) for c in same])
        expected.setdefault(ident, set()).add((r.rank, r.seq))
    got: dict[tuple, set] = {}
    for r in frame[frame["summary_row"].notna()].itertuples(index=False):
        got.setdefault((int(r.summary_row), int(r.call_group)), set()).add((r.rank, r.seq))
    assert sorted(map(sorted, got.values())) == sorted(map(sorted, expected.values()))
    # one group row per group, with its ranks, calls, the range of its times and its first call
    assert len(groups) == len(got) and list(groups.columns) == ex.GROUP_FIELDS
    for g in groups.itertuples(index=False):
        calls = got[(g.summary_row, g.call_group)]
        assert g.ranks == sorted({r for r, _ in calls}) and g.calls == len(calls)
        assert g.ranks_text == ex.ranks_text(g.ranks)
        host = [ops.loc[c, "host_ms"] for c in calls]
        assert (g.host_ms_min, g.host_ms_max) == pytest.approx((min(host), max(host)))
        assert (g.first_rank, g.first_seq) in calls and g.first_rank == min(g.ranks)
    by_op = {(s.op, s.phase): [g for g in groups.itertuples(index=False) if g.summary_row == i]
             for i, s in enumerate(summary.itertuples(index=False))}
    # the backward() call: the same on every rank but for its time -> one row "ranks 0-3"
    (bwd,) = by_op[("ShardTensor.backward", "forward")]
    assert bwd.ranks_text == "ranks 0-3" and bwd.calls == N and bwd.host_ms_min < bwd.host_ms_max
    # the two convs: 17 rows on ranks 0-1, 16 on ranks 2-3 -> two rows per conv, in call order
    conv = by_op[("torch.conv2d", "forward")]
    assert [(g.ranks_text, g.in_local_shapes[0]) for g in conv] == [
        ("ranks 0-1", [1, 3, 17, 64]), ("ranks 2-3", [1, 3, 16, 64]), ("ranks 0-1", [1, 4, 17, 64]), ("ranks 2-3", [1, 4, 16, 64])]
    add = by_op[("Tensor.add", "forward")]
    assert [g.ranks_text for g in add] == ["ranks 0-1", "ranks 2-3"] and {g.kind for g in add} == {"error"}
    assert {g.error for g in add} == {f"TypeError: {HTML_MSG}"}
    # rank 3 ran backward() on another placement: it is no longer identical to the others
    d = _raw()
    next(e for e in d["payloads"][3]["events"] if e.get("op") == "ShardTensor.backward")["placements"] = "(R,)"
    t = _load(d, tmp_path, "placement3")
    i = ex.summary_frame(t).index[ex.summary_frame(t)["op"] == "ShardTensor.backward"][0]
    g = ex.call_groups(t)
    assert [(x.ranks_text, x.placements) for x in g[g["summary_row"] == i].itertuples()] == \
        [("ranks 0-2", "(P(sum),)"), ("rank 3", "(R,)")]
    assert [ex.ranks_text(r) for r in ([0], [0, 1, 2, 3], [0, 1, 3], [0, 2], [])] == \
        ["rank 0", "ranks 0-3", "ranks 0-1,3", "ranks 0,2", "no rank"]


def test_json_value():
    assert json_value([np.int64(3), np.float64("nan"), None, pd.NA, {1: np.float32(0.5)}, (1, "a")]) == \
        [3, None, None, None, {"1": 0.5}, [1, "a"]]
    assert type(json_value(np.int64(3))) is int and type(json_value(np.bool_(True))) is bool
    assert format_shape([5]) == "(5,)" and format_shape([1, 3, 16]) == "(1, 3, 16)" and format_shape(None) == "—"
    assert [format_bytes(n) for n in (1023, 1536, 3 * 2**20, 5 * 2**30, None)] == \
        ["1023 B", "1.5 KiB", "3.0 MiB", "5.0 GiB", "—"]


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
    assert [r["local_bytes_text"] for r in data["ranks"]] == [format_bytes(3 * r * 64 * 4) for r in ROWS]
    # the same snapshots with rank 2 holding one row more than every spec says
    bad = copy.deepcopy(snaps)
    bad[2]["local_shape"][2] += 1
    lay = ShardLayout(bad)
    assert not lay.get_ranks().loc[2, "ok"] and lay.get_ranks()["ok"].sum() == N - 1
    assert any(w.startswith("rank 2 holds a local tensor of shape (1, 3, 17, 64)") and "(1, 3, 16, 64)" in w for w in lay.warnings)
    assert any("adding up to 67, but the global shape says 66" in w for w in lay.warnings)
    # rank 1 reports another dtype: a warning, rank 0's dtype is shown
    odd = copy.deepcopy(snaps)
    odd[1]["dtype"] = "torch.float64"
    lay = ShardLayout(odd)
    assert lay.dtype == "torch.float32"
    assert lay.warnings[0] == "ranks disagree on dtype: torch.float32 on ranks [0, 2, 3]; torch.float64 on ranks [1]"


def _snapshots() -> list[dict]:
    return json.loads((DATA / "x_snapshots.json").read_text())


def test_text_grid_draws_each_rank_where_it_holds_rows():
    lay = ShardLayout(_snapshots())
    grid = lay.text_grid()
    lines = grid.splitlines()
    # one box per rank, top to bottom, each edge labelled with the row where the next rank starts
    edges = [int(m.group(1)) for line in lines if (m := re.search(r"[┌├└][─┬┴┼]*[┐┤┘] (\d+)$", line))]
    assert edges == [0] + list(np.cumsum(ROWS))
    labels = [m.group(0) for line in lines if (m := re.search(r"rank \d\*?", line))]
    assert labels == ["rank 0", "rank 1", "rank 2*", "rank 3*"]  # * marks the smaller (uneven) shards
    assert [f"{r}x64" in grid for r in ROWS] == [True] * N and "* uneven" in grid
    w = len(max(lines, key=len))
    assert all(len(line) <= w for line in lines) and w <= 80  # fits a terminal
    # str(widget) / widget.text(): header, grid, one line per rank (terminals, logs, saved outputs)
    from sharddbg.views.inspector import ShardInspector

    widget = ShardInspector(lay)
    assert str(widget) == widget.text() == lay.text() and grid in widget.text()
    assert "rank 3 [domain=3] local (1, 3, 16, 64) offsets (0, 0, 50, 0)" in widget.text()


def test_layout_of_a_spec_that_disagrees_is_what_the_ranks_hold():
    """The spec says Replicate (the tensor is whole on every rank), but each rank holds its own rows: the
    diagram lays the rows out one after the other, every rank outlined as a mismatch; nothing overlaps."""
    snaps = _snapshots()
    for sn in snaps:
        sn.update(placements=[{"type": "replicate", "text": "Replicate()"}], sharding_shapes=None,
                  spec_local_shape=[1, 3, 66, 64], spec_offsets=[0, 0, 0, 0])
    lay = ShardLayout(snaps)
    assert [o[2] for o in lay.get_ranks()["offsets"]] == OFFS
    blocks = lay.blocks(2, 3)
    assert [(b["row0"], b["row1"], b["ranks"]) for b in blocks] == [(o, o + r, [k]) for k, (o, r) in enumerate(zip(OFFS, ROWS))]
    assert all(b["inferred"] and not b["ok"] for b in blocks) and not lay.get_ranks()["ok"].any()
    assert lay.extent == [1, 3, 66, 64]
    assert any("drawn as the ranks really hold it" in n and "17, 17, 16, 16 of its 66" in n for n in lay.notes)
    for r in range(N):
        assert f"rank {r}: tensor dim 2 is not sharded, but its local size is {ROWS[r]}" in " ".join(lay.warnings)
    assert "rank 0!" in lay.text_grid() and "! spec disagrees" in lay.text_grid()


def _mesh22_snapshots(rows=(34, 32), cols=(33, 31)) -> list[dict]:
    """Four ranks on a ddp x domain = 2 x 2 mesh, (1, 3, 66, 64) sharded Shard(2) over ddp, Shard(3) over domain."""
    out = []
    for r in range(4):
        i, j = divmod(r, 2)
        local = [1, 3, rows[i], cols[j]]
        out.append({"version": 1, "name": "x22", "rank": r, "status": "ok", "kind": "ShardTensor", "type": "ShardTensor",
                    "global_shape": [1, 3, 66, 64], "local_shape": local, "dtype": "torch.float32", "device": "cpu",
                    "requires_grad": False, "element_size": 4, "local_bytes": 4 * math.prod(local),
                    "mesh": {"dim_names": ["ddp", "domain"], "shape": [2, 2], "ranks": [[0, 1], [2, 3]],
                             "coordinate": [i, j], "device_type": "cpu"},
                    "placements": [{"type": "shard", "dim": 2, "text": "Shard(dim=2)"},
                                   {"type": "shard", "dim": 3, "text": "Shard(dim=3)"}],
                    "sharding_shapes": None, "spec_local_shape": local, "spec_offsets": None, "problems": []})
    return out


def test_facets_only_where_they_differ():
    lay = ShardLayout(_mesh22_snapshots())
    # dims 1 x 2: dim 3 is split but not drawn; both of its slices would show the same two blocks: one diagram
    blocks = lay.blocks(1, 2)
    assert [(b["facet"], b["ranks"], b["split_along"]) for b in blocks] == [("", [0, 1], [3]), ("", [2, 3], [3])]
    assert [b["uneven"] for b in blocks] == [False, False]
    # rank 3 holds 30 rows instead of 32: the two slices of dim 3 differ, so each is drawn (a facet), and the
    # ranks holding less than the largest shard along dim 3 (1 and 3: 31 columns) stay hatched inside them
    snaps = _mesh22_snapshots()
    snaps[3]["local_shape"][2] = 30
    lay = ShardLayout(snaps)
    blocks = lay.blocks(1, 2)
    assert {b["facet"] for b in blocks} == {"dim 3 in [0, 33)", "dim 3 in [33, 64)"}
    assert {b["ranks"][0]: b["uneven"] for b in blocks} == {0: False, 1: True, 2: True, 3: True}
    assert {b["ranks"][0]: b["uneven_dims"] for b in blocks} == {0: [], 1: [3], 2: [2], 3: [2, 3]}


def test_coordinates_on_the_cluster_mesh():
    """A tensor on the domain sub-mesh of a ddp x domain = 2 x 2 cluster: each rank and each group is
    named by both coordinates."""
    snaps = []
    for sn in _mesh22_snapshots():
        i, j = divmod(sn["rank"], 2)
        sn.update(global_shape=[1, 3, 66, 64], local_shape=[1, 3, 33, 64],
                  mesh={"dim_names": ["domain"], "shape": [2], "ranks": [2 * i, 2 * i + 1], "coordinate": [j]},
                  placements=[{"type": "shard", "dim": 2, "text": "Shard(dim=2)"}])
        snaps.append(sn)
    lay = ShardLayout(snaps, world_mesh={"ddp": 2, "domain": 2})
    assert list(lay.get_ranks()["coordinate"]) == ["ddp=0, domain=0", "ddp=0, domain=1", "ddp=1, domain=0", "ddp=1, domain=1"]
    assert [g["label"] for g in lay.groups] == ["ddp=0: ranks [0, 1]", "ddp=1: ranks [2, 3]"]
    assert [b["coordinates"] for b in lay.blocks(2, 3)] == [["ddp=0, domain=0"], ["ddp=0, domain=1"],
                                                          ["ddp=1, domain=0"], ["ddp=1, domain=1"]]
    assert "mesh domain=2 (the cluster's: ddp=2 x domain=2)" in lay.text()
    assert lay.to_json()["world_mesh"] == {"dim_names": ["ddp", "domain"], "shape": [2, 2]}
    # without the cluster's mesh: the tensor's own coordinates; a cluster dim of size 1 is left out
    assert ShardLayout(snaps).coordinate_text(2) == "domain=0"
    assert ShardLayout(_snapshots(), world_mesh={"ddp": 1, "domain": 4}).coordinate_text(3) == "domain=3"


# ---- what a view leaves in a notebook ---------------------------------------------------------------
def test_explorer_output_bundle(trace, tmp_path, monkeypatch):
    from sharddbg.views import bundle

    w = trace.show()
    data, _ = w._repr_mimebundle_()
    assert set(data) == {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain", bundle.VIEW_MIMETYPE}
    # text/plain says what is in the trace (not "<... object at 0x...>")
    text = data["text/plain"]
    ops = trace.get_ops()
    assert text == str(w) == w.text() and text.startswith(f"Trace explorer: {len(ops)} op calls on {N} ranks, {N} raised")
    # what is wrong, as the trace's findings say it (tests/test_findings.py): the error first, then the fallbacks
    assert f"  ✖ error: Ranks 0-3 raised TypeError: {HTML_MSG} in Tensor.add (" in text
    assert all(op in text.splitlines()[2] for op in trace.get_fallbacks()["op"])
    # and the op summary: a line per row (its flag, op, path, phase, calls), under it a line per call group
    summary = ex.summary_frame(trace)
    groups = ex.call_groups(trace)
    lines = text.splitlines()
    assert any(line.startswith("  op summary (13 rows") for line in lines)
    row_line = re.compile(r"^ {4}(✖ error|⚠ fallback|) +(\S+) +(\S+) +(forward|backward) +(\d+) ")
    rows = [m.groups() for m in map(row_line.match, lines) if m]
    flags = {"error": "✖ error", "fallback": "⚠ fallback", "op": ""}
    assert rows == [(flags[r.kind], r.op, r.path, r.phase, str(r.calls)) for r in summary.itertuples()]
    assert sum(1 for line in lines if re.match(r"^ {15}ranks? \d", line)) == len(groups)
    assert " " * 15 + "ranks 0-3 · 4 calls · in () -> out — · (P(sum),) · host " in text
    # the static rendering: errors, fallbacks, the calls in the explorer's order; escaped; no script
    html = data["text/html"]
    assert 'class="sd-root sd-static sd-explorer"' in html and "<script" not in html.replace("&lt;script", "")
    assert "&lt;b&gt;bold&lt;/b&gt;" in html and "<b>bold" not in html
    # first the op summary, each row with its calls on each rank (identical ones as one row), then the calls
    assert html.index("<h4>Op summary</h4>") < html.index("<h4>Errors</h4>") < html.index("<h4>Op calls</h4>")
    assert [m.group(1) for m in re.finditer(r'<tr class="sd-summary-row sd-kind-(\w+) sd-phase-\w+">', html)] == list(summary["kind"])
    assert html.count('<tr class="sd-call-group ') == len(groups)
    assert html.count('<td class="sd-col-ranks_text">ranks 0-3</td>') == 2  # backward() and its redistribute
    assert html.count('<tr class="sd-call-group sd-kind-error">') == 2  # the add: ranks 0-1, ranks 2-3
    assert html.count('<tr class="sd-op sd-kind-error sd-phase-forward">') == N
    assert html.count("✖ raised") == N + 1  # each call that raised, and the add's summary row
    assert html.count('<tr class="sd-op ') == len(ops)
    # the payload: versioned, the whole trace (it loads back as the same trace)
    payload = data[bundle.VIEW_MIMETYPE]
    assert (payload["format"], payload["version"], payload["view"]) == ("sharddbg.view", 1, "explorer")
    assert payload["summary"]["op_calls"] == len(ops) and payload["summary"]["errors"] == N
    (tmp_path / "back.sdtrace.json").write_text(json.dumps(payload["data"]))
    back = sharddbg.load_trace(tmp_path / "back.sdtrace.json")
    assert back.get_ops()[["rank", "seq", "op"]].equals(ops[["rank", "seq", "op"]])
    # and what the widget's front end draws, as JSON (the JupyterLab extension draws it without the kernel)
    assert payload["drawn"] == json.loads(json.dumps(w.data, allow_nan=False))
    # above the cap: a summary and a note instead of the trace and the drawn data
    monkeypatch.setattr(bundle, "PAYLOAD_MAX_BYTES", 1000)
    big = w._repr_mimebundle_()[0][bundle.VIEW_MIMETYPE]
    assert big["data"] is None and big["drawn"] is None and big["data_bytes"] > 1000 and "t.save(" in big["note"]
    assert big["summary"] == payload["summary"] and big["version"] == 1


def test_inspector_output_bundle():
    from sharddbg.views import bundle
    from sharddbg.views.inspector import ShardInspector

    lay = ShardLayout(_snapshots())
    data, _ = ShardInspector(lay)._repr_mimebundle_()
    assert set(data) == {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain", bundle.VIEW_MIMETYPE}
    assert data["text/plain"] == lay.text()
    html = data["text/html"]
    assert f'<pre class="sd-grid">{html_escape(lay.text_grid())}</pre>' in html
    for r in range(N):
        assert f"<td class=\"sd-col-local_shape\">(1, 3, {ROWS[r]}, 64)</td>" in html
    payload = data[bundle.VIEW_MIMETYPE]
    assert payload["view"] == "inspector" and payload["data"]["snapshots"] == lay.snapshots
    again = ShardLayout(payload["data"]["snapshots"], world_mesh=payload["data"]["world_mesh"])
    assert again.to_json() == lay.to_json()
    assert payload["drawn"] == lay.to_json()  # what the widget draws, for the JupyterLab extension


def test_figures_and_verification_views_carry_what_the_extension_draws(trace):
    """Communication per op and the timeline (plotly figures, the same objects) and the verification views
    leave the versioned payload beside their own bundle: the figure as plotly's JSON, the tables in the order
    and words of the static view."""
    import plotly.io as pio

    from sharddbg.analysis.check import CheckResult
    from sharddbg.views import bundle
    from sharddbg.views.check import CheckView, check_html

    fig = sharddbg.rendering.comm_by_op(trace)  # the timeline's the same way (tests/test_browser.py reads it)
    payload = fig._repr_mimebundle_()[bundle.VIEW_MIMETYPE]
    assert (payload["format"], payload["version"], payload["view"]) == ("sharddbg.view", 1, "comm")
    assert payload["drawn"]["figure"] == json.loads(pio.to_json(fig, validate=False))
    smoke_result, check_result = long_smoke_and_check()
    assert isinstance(check_result, CheckResult)
    data = check_result._repr_mimebundle_()
    assert data["text/html"] == check_html(check_result) and data["text/plain"] == check_result.verdict
    drawn = data[bundle.VIEW_MIMETYPE]["drawn"]
    assert data[bundle.VIEW_MIMETYPE]["view"] == "check" and drawn["outcome"] == "fail"
    assert [r["ok"] for r in drawn["rows"]] == sorted(r["ok"] for r in drawn["rows"])  # failures first, as the HTML
    assert all(cell in data["text/html"] for cell in drawn["rows"][0]["cells"][1:3])
    smoke = smoke_result._repr_mimebundle_()[bundle.VIEW_MIMETYPE]
    assert smoke["view"] == "smoke" and smoke["drawn"]["rows"][0]["status"] == "wrong"
    assert CheckView(check_result).figure is None or CheckView(check_result).figure.sharddbg_payload()["view"] == "check_rows"


def html_escape(text: str) -> str:
    import html

    return html.escape(text, quote=True)


# ---- report and escaping --------------------------------------------------------------------------
def _hostile_trace(tmp_path) -> Trace:
    """The golden trace with an op name and a module path that contain HTML."""
    d = _raw()
    for p in d["payloads"]:
        for e in p["events"]:
            if e.get("op") == "Tensor.abs":
                e["op"] = "<img src=x onerror=alert(1)>"
                e["module"] = "<i>mod</i>"
    return _load(d, tmp_path, "hostile")


def test_report_standalone_and_escaped(trace, tmp_path):
    t = _hostile_trace(tmp_path)
    out = t.to_html(tmp_path / "report.html")
    html = Path(out).read_text()
    # offline: plotly.js inlined, nothing fetched from a CDN
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=", html)
    # plotly's partial bundle when it is installed (its figures are bars and scatters only), named on the page
    from plotly.offline import get_plotlyjs_version

    from sharddbg.exporters.plotly_bundle import CARTESIAN_BUNDLE, read_partial_bundle
    carried = re.search(r'<!-- plotly.js (\S+), (\w+) bundle: [^<]*? -->\n<script type="text/plain" id="sd-plotly-js" '
                        r'data-plotly-bundle="(\w+)" data-plotly-version="([^"]+)">', html)
    assert carried and carried.group(1) == carried.group(4) == get_plotlyjs_version() and carried.group(2) == carried.group(3)
    assert carried.group(2) == ("cartesian" if CARTESIAN_BUNDLE.exists() else "full")
    if carried.group(2) == "cartesian":
        assert read_partial_bundle(CARTESIAN_BUNDLE).source in html and len(html) < 3_000_000
    else:
        assert "plotly.js v" in html and len(html) > 3_000_000  # (its code mentions a topojson CDN, for maps only)
    # every string from the trace escaped: the raw markup never appears, its escaped form does
    for raw in ("<b>bold</b>", "<script>alert('sharddbg')", "<img src=x", "<i>mod</i>"):
        assert raw not in html, raw
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;script&gt;alert(&#x27;sharddbg&#x27;)&lt;/script&gt;" in html
    assert "\\u003cimg src=x onerror=alert(1)\\u003e" in html  # inside the explorer's JSON
    # the sections are all there, with the trace's own numbers
    for section in ("Errors", "DTensor fallbacks", "Timeline", "Communication per op", "Imbalance", "Explorer"):
        assert f"<h2>{section}</h2>" in html
    assert f"{t.overview.headline()} · generated " in html
    assert len(re.findall(r'<(?:div|details) class="sd-finding ', html)) == len(t.findings) > 0
    # each figure is a box that waits, saying so, with its figure's JSON beside it, and its height kept meanwhile;
    # the page's script draws it once it comes near the screen (an IntersectionObserver), and plotly.js is text
    # that script evaluates then: nothing of plotly runs while the page is parsed
    for fig in ("timeline", "comm", "imbalance"):
        box = re.search(f'<div class="sd-figure" id="sd-fig-{fig}" data-sd-figure="{fig}" data-state="pending" '
                        r'style="min-height: (\d+)px"><p class="sd-figure-pending sd-meta">drawn when it comes into view</p></div>', html)
        assert box, fig
        drawn = json.loads(re.search(f'<script type="application/json" id="sd-fig-{fig}-data">(.*?)</script>', html).group(1))
        assert drawn["data"] and int(box.group(1)) == drawn["layout"]["height"]
    assert "Plotly.newPlot" not in html.split('id="sd-plotly-js"')[0]
    assert re.search(r'<script type="text/plain" id="sd-plotly-js"[^>]*>/\*\*\s*\* plotly.js (\(cartesian - minified\) )?v', html)
    assert "new IntersectionObserver(" in html and html.index('id="sd-explorer-data"') < html.index('id="sd-plotly-js"')
    # the explorer's front end and its data, the op summary it opens on included
    embedded = json.loads(re.search(r'<script type="application/json" id="sd-explorer-data">(.*?)</script>', html).group(1))
    assert embedded["summary"] == ex.op_summary(t) and len(embedded["summary"]) == len(t.get_op_summary())
    assert "function renderExplorer(" in html


def test_report_plotly_bundle_choice(trace, tmp_path, monkeypatch):
    """The partial bundle is read from its own text (version from its header, trace types from its trace modules)
    and chosen only when it registers every trace type asked for and is the plotly package's plotly.js; a missing,
    unreadable or other-version bundle gives the full one, saying why; the report names what it carries in a
    comment that nothing in the reason can end early. (The real bundle's types are checked in chromium,
    tests/test_browser.py.)"""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    from sharddbg.exporters import plotly_bundle as pb

    version = get_plotlyjs_version()
    header = "/**\n* plotly.js (cartesian - minified) v{}\n*/\n"
    body = 'var a={moduleType:"trace",name:"bar"},b={moduleType:"trace",name:"scatter"},c={moduleType:"component",name:"legend"};'
    small = tmp_path / "small.min.js"
    small.write_text(header.format(version) + body)
    read = pb.read_partial_bundle(small)
    assert (read.version, read.trace_types) == (version, frozenset({"bar", "scatter"}))
    chosen = pb.plotly_bundle_for(["scatter", "bar", "bar"], partial=small)
    assert (chosen.name, chosen.version, chosen.source) == ("cartesian", version, small.read_text())
    assert "(bar, scatter)" in chosen.why
    for types, partial, why in ((["bar", "heatmap", "scattergl"], small, "the figures use heatmap, scattergl, which"),
                                (["bar"], tmp_path / "none.min.js", "plotly's partial bundle is not installed"),
                                (["bar"], tmp_path / "other.min.js", f"is plotly.js 0.0.1, the plotly package's is {version}"),
                                (["bar"], tmp_path / "headless.min.js", "could not be read: ")):
        (tmp_path / "other.min.js").write_text(header.format("0.0.1") + body)
        (tmp_path / "headless.min.js").write_text(body)
        full = pb.plotly_bundle_for(types, partial=partial)
        assert (full.name, full.version) == ("full", version) and full.source == get_plotlyjs(), types
        assert why in full.why, (full.why, why)
    (tmp_path / "no-types.min.js").write_text(header.format(version) + "var a=1;")
    with pytest.raises(pb.UnreadableBundle, match="defines no trace module"):
        pb.read_partial_bundle(tmp_path / "no-types.min.js")
    # a report without the partial bundle carries the full one; its reason names a path with "--" in it
    missing = tmp_path / "a--b" / "plotly-cartesian.min.js"
    monkeypatch.setattr(pb, "CARTESIAN_BUNDLE", missing)
    html = Path(trace.to_html(tmp_path / "report.html")).read_text()
    comment = re.search(r"<!-- (plotly.js [^\n]*?) -->\n<script", html).group(1)
    assert "--" not in comment and "not installed" in comment and str(missing).replace("--", "- -") in comment
    assert f'data-plotly-bundle="full" data-plotly-version="{version}">' in html and get_plotlyjs() in html


def test_plotly_bundles_pinned_to_the_plotly_package():
    """The npm packages of plotly.js (the extension's full bundle, the report's partial one) are pinned exactly to
    the plotly.js the plotly package ships, in package.json and in the lockfile npm ci installs from: the report
    uses a partial bundle of another version not at all, and the figures' JSON is made for that version."""
    from plotly.offline import get_plotlyjs_version

    root = Path(__file__).resolve().parents[1] / "extension"
    pins = json.loads((root / "package.json").read_text())["dependencies"]
    lock = json.loads((root / "package-lock.json").read_text())["packages"]
    for name in ("plotly.js-dist-min", "plotly.js-cartesian-dist-min"):
        assert pins[name] == lock[f"node_modules/{name}"]["version"] == get_plotlyjs_version(), name


def test_report_errors_name_each_rank_once(tmp_path):
    """An error raised many times on each rank (a loop): its block names each rank once, not once per call (a
    big trace's list of ranks was a page of text above the figures)."""
    from sharddbg.views.common import error_entries

    d = _raw()
    for p in d["payloads"]:
        errs = [e for e in p["events"] if e["kind"] == "op" and e.get("error")]
        top = max(e["seq"] for e in p["events"])
        p["events"] += [dict(e, seq=top + 1 + k, error=dict(e["error"], origin_seq=top + 1 + k)) for k in range(3) for e in errs]
    t = _load(d, tmp_path, "repeated")
    assert len(t.get_errors()) == 4 * N
    assert [e["ranks"] for e in error_entries(t)] == [str(list(range(N)))]


def test_plotly_text_escaped(tmp_path):
    t = _hostile_trace(tmp_path)
    fig = tl.plot_timeline(t)
    texts = [h for d in fig.data if d.hovertext is not None for h in list(d.hovertext) if h]
    assert any("&lt;img src=x onerror=alert(1)&gt;" in h for h in texts)
    assert any("&lt;b&gt;bold&lt;/b&gt;" in h for h in texts)
    assert not any("<img" in h or "<b>bold" in h or "<i>mod" in h for h in texts)
    imb = plot_imbalance(t)
    labels = [b.label for b in imb.layout.updatemenus[0].buttons]
    assert "&lt;img src=x onerror=alert(1)&gt;" in labels and not any("<img" in lab for lab in labels)


# Text that breaks out of an element, an attribute and a textarea if any template printed it unescaped.
HOSTILE = "<script>alert(1)</script>\"><img src=x onerror=alert(1)></textarea>"
HOSTILE_RAW = ("<script>alert(1)", "<img src=x", "</textarea>")


def _hostile_everywhere(tmp_path) -> Trace:
    """The golden trace with HOSTILE in every op's name, the file of its user frame, its cell's code, and
    the exception's message and traceback."""
    d = _raw()
    for p in d["payloads"]:
        for e in p["events"]:
            if e["kind"] != "op":
                continue
            e["op"] = f"{e['op']} {HOSTILE}"
            e["user_frame"] = f"/tmp/{HOSTILE}.py:1 in run"
            e["user_code"] = HOSTILE
            if e["error"] is not None:
                e["error"]["message"] = HOSTILE
                e["error"]["traceback"] += HOSTILE
    return _load(d, tmp_path, "hostile_everywhere")


def test_every_template_escapes_trace_text(tmp_path):
    """Every view's static HTML and the report, through their public functions, on data carrying HOSTILE:
    none of its markup survives, its escaped text is there (the report's explorer data holds it as JSON)."""
    from html.parser import HTMLParser

    from sharddbg.analysis.check import ROW_COLUMNS as CHECK_ROWS
    from sharddbg.analysis.check import TABLE_COLUMNS as CHECK_COLUMNS
    from sharddbg.analysis.check import CheckResult
    from sharddbg.analysis.doctor import DoctorReport
    from sharddbg.analysis.findings import Finding
    from sharddbg.analysis.replica_check import TABLE_COLUMNS as REPLICA_COLUMNS
    from sharddbg.analysis.replica_check import ReplicaCheck
    from sharddbg.analysis.smoke import TABLE_COLUMNS as SMOKE_COLUMNS
    from sharddbg.analysis.smoke import SmokeConfig, SmokeResult
    from sharddbg.views.check import check_html, doctor_html
    from sharddbg.views.inspector import inspector_html
    from sharddbg.views.replicas import replica_check_html
    from sharddbg.views.smoke import smoke_html

    escaped = html_escape(HOSTILE)

    class Elements(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags: list[str] = []
            self.handlers: list[str] = []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            self.handlers += [name for name, _ in attrs if name.startswith("on")]

    t = _hostile_everywhere(tmp_path)
    snapshots = _snapshots()
    for sn in snapshots:
        sn["name"] = HOSTILE
        sn["mesh"]["dim_names"] = [HOSTILE]
        sn["placements"][0]["text"] = HOSTILE
    check = pd.DataFrame([{"tensor": HOSTILE, "kind": "output", "rank": r, "group": 0, "ok": r != 1, "max_abs": 0.5,
                           "max_rel": 0.1, "ratio": 10.0, "rtol": 1e-4, "atol": 1e-6, "bad": 3 * (r == 1), "numel": 12,
                           "dtype": "torch.float32", "shape": (3, 4), "reference_shape": (12, 4),
                           "compared": "local shard", "row_dim": 0, "note": HOSTILE} for r in range(N)],
                         columns=CHECK_COLUMNS)
    smoke = pd.DataFrame([{"config": HOSTILE, "ok": False, "outcome": HOSTILE, "mesh": HOSTILE, "wrapper": "none",
                           "compiled": False, "training": True, "expected_error": "", "loss_off_step": 0,
                           "loss_off_error": 1.0, "loss_error": 1.0,
                           "loss_error_step": 0, "grad_error": 1.0, "grad_error_param": HOSTILE, "step_ms": 1.0,
                           "first_step_ms": 2.0, "fallbacks": 0.0, "fallback_ops": HOSTILE,
                           "collectives_per_step": 1.0, "losses": [1.0], "reference_losses": [0.5],
                           "about": HOSTILE}]).set_index("config")[SMOKE_COLUMNS]
    replicas = pd.DataFrame([{"name": HOSTILE, "kind": "parameter", "group_ranks": [0, 1], "state": "differs",
                              "ranks_differing": [1], "reference_rank": 0, "max_abs_diff": 0.5, "shape": (3,),
                              "dtype": HOSTILE, "placements": HOSTILE, "detail": HOSTILE}], columns=REPLICA_COLUMNS)
    # the results as the views receive them: the hostile strings in their tables and what they were made of
    rows = pd.DataFrame([{"tensor": HOSTILE, "group": 0, "rank": r, "row": 3 * r + k, "max_abs": 0.5 * (r == 1 and k == 0),
                          "ok": not (r == 1 and k == 0)} for r in range(N) for k in range(3)], columns=CHECK_ROWS)
    check_result = CheckResult(HOSTILE, check, rows, inputs=[HOSTILE], outputs=[HOSTILE], models=[], backward="none",
                               backward_note=HOSTILE, loss=None, reference_loss=None, tf32={"applies": False}, groups=[0])
    assert check_result.patterns() and check_result.patterns()[0].tensor == HOSTILE
    doctor_report = DoctorReport([Finding(HOSTILE, status, HOSTILE, HOSTILE, (0,)) for status in ("ok", "warn", "fail")],
                                 [HOSTILE])
    smoke_result = SmokeResult(smoke, [SmokeConfig(HOSTILE)], {}, 1e-4, 3, N)
    replica_check = ReplicaCheck(replicas, HOSTILE, HOSTILE, [[0, 1]])
    rendered = {
        "explorer": ex.explorer_html(t),
        "report": Path(t.to_html(tmp_path / "report.html", title=HOSTILE)).read_text(),
        "check": check_html(check_result),
        "doctor": doctor_html(doctor_report),
        "smoke": smoke_html(smoke_result),
        "replicas": replica_check_html(replica_check),
        "inspector": inspector_html(ShardLayout(snapshots)),
    }
    for view, text in rendered.items():
        for raw in HOSTILE_RAW:
            assert raw not in text, (view, raw)
        assert escaped in text, view
        elements = Elements()
        elements.feed(text)
        assert "img" not in elements.tags and "textarea" not in elements.tags and not elements.handlers, view
        if view != "report":
            assert "script" not in elements.tags, view
    # (the report's scripts are plotly's and the explorer's); the explorer's data there carries the op names
    # as JSON text, every < and > as \u escapes
    report = rendered["report"]
    assert json.dumps(HOSTILE)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e") in report
    # each place a trace string goes: op names, the user frame's file, the cell's code, the message
    explorer = rendered["explorer"]
    assert f'<td class="sd-col-op" title="Tensor.abs {escaped}">' in explorer  # an op name in the op summary
    assert "<td>textarea&gt;.py:1 in run</td>" in explorer  # the calls' source: the frame's file name, after its last "/"
    assert f"/tmp/{escaped}.py:1 in run" in explorer  # the error's user frame, whole
    assert f'<td title="cell [2], line 1: `{escaped}`">' in explorer  # where in the cell, an attribute
    assert f'<span class="sd-error-msg">TypeError: {escaped}</span>' in explorer and f"<h1>{escaped}</h1>" in report
    assert f'title="✖ {escaped}"' in rendered["smoke"]  # an attribute


def test_trace_does_not_import_views():
    code = ("import sys, sharddbg; t = sharddbg.load_trace(sys.argv[1]); t.get_ops(); t.get_fallbacks(); "
            "t.get_collectives(); t.get_imbalance(); t.to_perfetto(sys.argv[2]); "
            "bad = [m for m in ('plotly', 'anywidget', 'ipywidgets', 'torch', 'sharddbg.views') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code, str(DATA / "conv4.sdtrace.json"), "/dev/null"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_views_on_a_trace_without_events(tmp_path):
    d = _raw()
    for p in d["payloads"]:
        p["events"] = []
    t = _load(d, tmp_path, "empty")
    fig = t.plot_timeline()
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(N)] and "0 op calls" in fig.layout.title.text
    assert "no collectives recorded" in t.plot_comm_by_op().layout.annotations[0].text
    assert "no ops recorded" in t.plot_imbalance().layout.annotations[0].text
    w = t.show()
    assert w.data["total"] == 0 and w.data["rows"] == [] and w.data["summary"] == []
    assert "op summary: no op calls" in w.text() and "No op calls were recorded." in ex.explorer_html(t)
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
    t = _load(d, tmp_path, "hung")
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
    ov = timeline_overview(ops, "ops", bins, x0, x1)
    assert list(ov.columns) == OVERVIEW_COLUMNS and set(ov["lane"]) == {"ops"}
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
    assert [t for t in fig.layout.yaxis.ticktext if t.startswith("rank")] == [f"rank {r}" for r in range(N)]
    assert "overview" in fig.layout.title.text and not any(d.type in ("scattergl", "bar") for d in fig.data)
    coll = tl.collective_spans(trace)
    lo, hi = min(x0, coll["start_ms"].min()), max(x1, coll["end_ms"].max())
    cells = sum(len(timeline_overview(ops[ops["lane"] == lane], lane, tl.OVERVIEW_BINS, lo, hi)) for lane in ("autograd", "ops")) + \
        len(timeline_overview(coll, "collectives", tl.OVERVIEW_BINS, lo, hi))
    # the bins an error span touches on each rank, span by span: marked in the strip above the rank's op lane
    w_all = (hi - lo) / tl.OVERVIEW_BINS
    raised = {(int(e.rank), b) for e in ops[ops["category"] == "error"].itertuples()
              for b in range(min(int((e.start_ms - lo) // w_all), tl.OVERVIEW_BINS - 1),
                             min(int((e.end_ms - lo) // w_all), tl.OVERVIEW_BINS - 1) + 1)}
    assert int(np.isfinite(np.array(hm.z, dtype=float)).sum()) == cells + len(raised) and cells > 0 and raised
    assert sum(1 for row in hm.text for t in row if t) == cells + len(raised)
    strip = {(int(t.split()[1].rstrip(":")), b) for row in hm.text for b, t in enumerate(row) if "an op raised" in t}
    assert strip == raised
    rows_y = np.array(hm.y, dtype=float)
    for k, (row, text) in enumerate(zip(np.array(hm.z, dtype=float), hm.text)):
        marked = [t for t in text if "an op raised" in t]
        if marked:  # the strip's row lies just above the rank's op lane, in the error colour
            r = int(marked[0].split()[1].rstrip(":"))
            assert rows_y[k] < rows_y[k + 1] <= r + tl.OP_LANE0 - tl.LANE_HALF
            assert set(row[np.isfinite(row)]) == {tl._op_categories(ops).index("error")}
    assert not any(d.name == "error raised" for d in fig.data)  # no marker per bin (restyled at every zoom)
    # a window drawn span by span: only the spans that overlap it
    a, b = x0 + (x1 - x0) * 0.25, x0 + (x1 - x0) * 0.5
    win = tl.plot_timeline(trace, time_range=(a, b))
    drawn = sum(len(d.x) for d in win.data if d.type == "bar" and d.legendgroup.startswith("op:"))
    assert drawn == int(((ops["end_ms"] >= a) & (ops["start_ms"] <= b)).sum()) and list(win.layout.xaxis.range) == [a, b]


def test_perfetto_shares_the_timeline_clock(trace):
    """Perfetto's slices start where the timeline's spans do (µs vs ms from the same first event)."""
    evs = perfetto_dict(trace)["traceEvents"]
    ops = tl.timeline_frame(trace).set_index(["rank", "seq"])
    colls = tl.collective_spans(trace).set_index(["rank", "seq"])
    slices = [e for e in evs if e["ph"] == "X"]
    assert len(slices) == len(ops) + len(colls)
    for e in slices:
        span = (colls if e["cat"].startswith("collective") else ops).loc[(e["pid"], e["args"]["seq"])]
        assert e["ts"] == pytest.approx(span["start_ms"] * 1000) and e["dur"] == pytest.approx(
            (span["end_ms"] - span["start_ms"]) * 1000)
    # one name per track: ops (forward, and backward nested in Tensor.backward) on thread 0's track,
    # collectives on their own, on every rank
    names = sorted((e["pid"], e["tid"], e["args"]["name"]) for e in evs if e["name"] == "thread_name")
    assert names == [(r, t, n) for r in range(N) for t, n in ((0, "thread 0"), (1000, "collectives"))]


def test_the_explorer_builds_its_tables_once_per_trace(trace, monkeypatch):
    """Opening the widget, its text, its static rendering and every detail click read one set of tables: a
    click does not regroup the trace's calls."""
    fresh = sharddbg.load_trace(DATA / "conv4.sdtrace.json")
    built = []
    real = ex._build_tables
    monkeypatch.setattr(ex, "_build_tables", lambda t: built.append(t) or real(t))
    w = fresh.show()
    w.text(), ex.explorer_html(fresh), ex.summary_frame(fresh), ex.call_groups(fresh)
    row = ex.explorer_frame(fresh).iloc[0]
    for _ in range(3):
        w.selected = [int(row["rank"]), int(row["seq"])]
        assert w.detail()["row"]["key"] == row["key"]
    assert built == [fresh]
    # what the functions hand out is the caller's to change
    mine = ex.summary_frame(fresh)
    mine.loc[0, "op"] = "changed"
    assert ex.summary_frame(fresh).loc[0, "op"] != "changed"


# ---- light and dark pages -------------------------------------------------------------------------------
def _rgba(color: str) -> tuple[float, float, float, float]:
    """A CSS colour (#rrggbb, rgb(...) or rgba(...)) as (r, g, b, alpha), channels 0-255."""
    color = {"white": "#ffffff", "black": "#000000"}.get(color, color)
    if color.startswith("#"):
        return (*(int(color[i:i + 2], 16) for i in (1, 3, 5)), 1.0)
    parts = [float(v) for v in re.findall(r"[\d.]+", color)]
    return (*parts[:3], parts[3] if len(parts) > 3 else 1.0)


def _contrast(color: str, background: tuple[int, int, int]) -> float:
    """WCAG contrast ratio of an opaque colour on a background."""
    def lum(rgb):
        c = [v / 255 for v in rgb]
        c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]
    a, b = lum(_rgba(color)[:3]), lum(background)
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def _smoke_result(rows: dict[str, list[float]], reference: list[float], rtol: float = 1e-3):
    from sharddbg.analysis.smoke import SmokeResult

    table = pd.DataFrame({"losses": list(rows.values()), "reference_losses": [reference] * len(rows), "ok": True},
                         index=pd.Index(list(rows), name="config"))
    return SmokeResult(table, [], {}, rtol, len(reference), N)


def test_figures_read_on_light_and_dark_pages(trace):
    from sharddbg.views.common import empty_figure

    reference = [2.0, 1.5, 1.2]
    figures = {"timeline": tl.plot_timeline(trace), "comm": plot_comm_by_op(trace), "imbalance": plot_imbalance(trace),
               "empty": empty_figure("nothing", "nothing to draw"),
               "losses": _smoke_result({"single-device": reference}, reference).plot_losses()}
    for name, fig in figures.items():
        layout = fig.to_dict()["layout"]["template"]["layout"]
        # the page's own background shows through: white in a light theme, #111 in JupyterLab Dark
        assert _rgba(layout["paper_bgcolor"])[3] == 0 and _rgba(layout["plot_bgcolor"])[3] == 0, name
        for color in (layout["font"]["color"], layout["xaxis"]["tickfont"]["color"], layout["title"]["font"]["color"]):
            assert _contrast(color, (255, 255, 255)) >= 4 and _contrast(color, (17, 17, 17)) >= 4, (name, color)
        grid = _rgba(layout["xaxis"]["gridcolor"])
        assert grid[:3] == (128, 128, 128) and 0 < grid[3] < 0.5, (name, grid)  # mid grey, faint on both
        for ann in fig.layout.annotations:  # no annotation in a colour that disappears on one of them
            if ann.font.color:
                assert _contrast(ann.font.color, (255, 255, 255)) >= 3 and _contrast(ann.font.color, (17, 17, 17)) >= 3


def test_loss_plot_has_a_floor_a_labelled_tolerance_and_lines_apart():
    reference = [2.0, 1.5, 1.2]
    same = [2.0, 1.5 * (1 + 3e-7), 1.2 * (1 + 1e-7)]
    result = _smoke_result({"single-device": reference, "domain=4": [2.0, 1.5 * (1 + 2e-6), 1.2],
                            "ddp=2 x domain=2, DDP": same, "ddp=2 x domain=2, FSDP2": list(same)}, reference)
    fig = result.plot_losses()
    assert [t.name for t in fig.data] == ["single-device", "domain=4", "ddp=2 x domain=2, DDP", "ddp=2 x domain=2, FSDP2"]
    # a log axis with a floor: the errors of 0 drawn on it (a decade below the smallest error that is not 0),
    # the axis starting below it, and the hover saying they are exact
    floor = 1e-8
    assert fig.layout.yaxis.type == "log"
    assert list(fig.data[0].y) == [floor] * 3 and fig.data[2].y[0] == floor
    assert fig.layout.yaxis.range[0] < math.log10(floor) < math.log10(1e-7) < fig.layout.yaxis.range[1]
    assert all("0 (exact, drawn at the floor 1e-08)" in h for h in fig.data[0].hovertext)
    assert "3.00e-07" in fig.data[2].hovertext[1]
    floor_line = [s for s in fig.layout.shapes if s.y0 == floor]
    assert floor_line and any("0 (exact) drawn at 1e-08" in a.text and a.y == pytest.approx(-8) for a in fig.layout.annotations)
    # the tolerance's label on its line: annotations on a log axis take log10 of the value (y=rtol put it at 1)
    (rtol_line,) = [s for s in fig.layout.shapes if s.y0 == 1e-3]
    (label,) = [a for a in fig.layout.annotations if a.text == "rtol 0.001"]
    assert rtol_line.y1 == 1e-3 and label.y == pytest.approx(-3) and label.yref in (None, "y")
    # identical lines both visible: each its own dash and marker, the later ones narrower, drawn on top
    assert len({t.line.dash for t in fig.data}) == len({t.marker.symbol for t in fig.data}) == len(fig.data)
    widths, sizes = [t.line.width for t in fig.data], [t.marker.size for t in fig.data]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    # ... and moved a little apart along the steps (the hover still names the step)
    firsts = [t.x[0] for t in fig.data]
    assert len(set(firsts)) == len(firsts) and all(abs(x) < 0.1 for x in firsts)
    assert fig.data[3].hovertext[1].startswith("ddp=2 x domain=2, FSDP2<br>step 1: ")


def test_report_light_and_dark_by_the_readers_preference(trace, tmp_path):
    html = Path(trace.to_html(tmp_path / "report.html")).read_text()
    head = html[:html.index("</style>")]
    dark = re.search(r"@media \(prefers-color-scheme: dark\) \{(.*?)\n\}", head, re.S)
    assert dark, "no dark block"
    for var in ("--jp-layout-color0", "--jp-ui-font-color1", "--jp-border-color2"):
        value = re.search(var + r": (#[0-9a-f]{6})", dark.group(1)).group(1)
        light = re.search(r":root \{.*?" + var + r": (#[0-9a-f]{6})", head, re.S).group(1)
        assert value != light, var
    assert _contrast(re.search(r"--jp-layout-color0: (#[0-9a-f]{6})", dark.group(1)).group(1), (0, 0, 0)) < 1.5
    assert "color-scheme: light dark" in head
    assert re.search(r"body \{[^}]*background: var\(--jp-layout-color0\)", head)


class _Cells(HTMLParser):
    """Each table's header texts, and its body cells as (text, title attribute), in document order."""

    def __init__(self):
        super().__init__()
        self.heads: list[list[str]] = []
        self.cells: list[list[tuple[str, str | None]]] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.heads.append([])
            self.cells.append([])
        elif tag in ("th", "td"):
            self._in = tag
            target = self.heads[-1] if tag == "th" else self.cells[-1]
            target.append("" if tag == "th" else ["", dict(attrs).get("title")])

    def handle_endtag(self, tag):
        if tag in ("th", "td"):
            self._in = None

    def handle_data(self, data):
        if self._in == "th":
            self.heads[-1][-1] += data
        elif self._in == "td":
            self.cells[-1][-1][0] += data


def _cells(html: str) -> _Cells:
    parsed = _Cells()
    parsed.feed(html)
    return parsed


LONG_OUTCOME = "loss off from step 0 by 3.1e-02 (rtol 1e-04): the halo of conv2d is missing on ranks 1-2"
LONG_NOTE = "compared with the reference's rows 16-33 of dim 2 (this rank's shard), after the halo was trimmed"


def long_smoke_and_check():
    """A smoke matrix and a numerical check with long names, outcomes and notes (what narrow outputs must
    hold): (SmokeResult, CheckResult). The browser test shows them too."""
    from sharddbg.analysis.check import ROW_COLUMNS as CHECK_ROWS
    from sharddbg.analysis.check import TABLE_COLUMNS as CHECK_COLUMNS
    from sharddbg.analysis.check import CheckResult
    from sharddbg.analysis.smoke import TABLE_COLUMNS as SMOKE_COLUMNS
    from sharddbg.analysis.smoke import SmokeConfig, SmokeResult

    outcome, note = LONG_OUTCOME, LONG_NOTE
    smoke = pd.DataFrame([{"config": "domain=4 fsdp2 compiled", "ok": False, "outcome": outcome, "mesh": "domain=4",
                           "wrapper": "fsdp2", "compiled": True, "training": True, "expected_error": "",
                           "loss_off_step": 0, "loss_off_error": 0.03, "loss_error": 0.03, "loss_error_step": 0,
                           "grad_error": 0.1, "grad_error_param": "w", "step_ms": 1.0, "first_step_ms": 2.0,
                           "fallbacks": 0.0, "fallback_ops": "", "collectives_per_step": 1.0, "losses": [1.0],
                           "reference_losses": [0.5], "about": "four ranks on one domain mesh"}]).set_index("config")[SMOKE_COLUMNS]
    smoke_result = SmokeResult(smoke, [SmokeConfig("domain=4 fsdp2 compiled")], {}, 1e-4, 3, N)
    check = pd.DataFrame([{"tensor": "model.decoder.blocks.0.conv.weight.grad", "kind": "gradient", "rank": r,
                           "group": 0, "ok": r != 1, "max_abs": 0.5, "max_rel": 0.1, "ratio": 10.0, "rtol": 1e-4,
                           "atol": 1e-6, "bad": 3 * (r == 1), "numel": 12, "dtype": "torch.float32", "shape": (3, 4),
                           "reference_shape": (12, 4), "compared": "local shard", "row_dim": 0, "note": note}
                          for r in range(N)], columns=CHECK_COLUMNS)
    rows = pd.DataFrame([], columns=CHECK_ROWS)
    result = CheckResult("1 of 4 rows differ", check, rows, inputs=[], outputs=[], models=[], backward="none",
                         backward_note="", loss=None, reference_loss=None, tf32={"applies": False}, groups=[0])
    return smoke_result, result


def test_smoke_and_check_tables_put_the_verdict_first_and_long_text_on_hover():
    """In a narrow output the pass/fail column must stay in view: it comes first in the smoke matrix and in the
    numerical check; long text wraps, its whole text in the cell's title; a wide table scrolls inside the output."""
    from sharddbg.views.check import check_html
    from sharddbg.views.smoke import smoke_html

    outcome, note = LONG_OUTCOME, LONG_NOTE
    smoke_result, result = long_smoke_and_check()
    page = smoke_html(smoke_result)
    table = _cells(page)
    assert table.heads[0][:2] == ["verdict", "configuration"]
    verdict, name = table.cells[0][0], table.cells[0][1]
    assert verdict == [f"✖ {outcome}", f"✖ {outcome}"]
    assert name[1] == "domain=4 fsdp2 compiled: four ranks on one domain mesh"
    assert 'class="sd-scroll" style="max-width: 100%; overflow-x: auto;"' in page

    page = check_html(result)
    table = _cells(page)
    assert table.heads[0][0] == "ok" and table.heads[0][-1] == "note"
    assert [row[0] for row in table.cells[0][::len(table.heads[0])]] == ["✖", "✔", "✔", "✔"]  # failures first
    first = table.cells[0][:len(table.heads[0])]
    assert first[1] == ["model.decoder.blocks.0.conv.weight.grad"] * 2
    assert first[-1] == ["[1]", note]  # the numbered note, whole on hover
    assert 'class="sd-scroll"' in page


def test_explorer_op_names_wrap_and_backward_rows_are_marked(trace):
    """An op name may break after a dot (never be cut), its whole name on hover; a backward row carries a "bwd"
    chip; the tables take at least their columns' least widths."""
    page = ex.explorer_html(trace)
    assert '<td class="sd-col-op" title="torch.conv2d"><span class="sd-op-name">torch.<wbr>conv2d</span></td>' in page
    assert ('<td class="sd-col-op" title="torch.conv2d (backward)"><span class="sd-op-name">torch.<wbr>conv2d</span>'
            '<span class="sd-chip-phase"') in page
    path_px = ex.path_column_px(set(trace.get_ops()["path"]))
    assert path_px >= int(6.2 * len("dtensor_fallback_function")) + 21  # the widest chip fits its column
    assert f'style="min-width: {ex.table_min_width(ex.SUMMARY_LIST_COLUMNS, path_px)}px"' in page
    assert f'<col style="width:{path_px}px">' in page
    assert ex.explorer_data(trace)["flexible_min_px"] == ex.FLEXIBLE_MIN_PX


def test_inspector_says_its_verdict_before_the_drawing():
    """The warnings (or "spec and data agree") come before the diagram, in the static HTML and the text; beside a
    real problem the uneven shards are only a note."""
    from sharddbg.views.inspector import inspector_html

    fine = ShardLayout(_snapshots())
    assert fine.verdict == "spec and data agree" and fine.to_json()["verdict"] == fine.verdict
    page = inspector_html(fine)
    assert page.index("✓ spec and data agree") < page.index('<pre class="sd-grid">')
    snaps = _snapshots()
    for sn in snaps:
        sn.update(placements=[{"type": "replicate", "text": "Replicate()"}], sharding_shapes=None,
                  spec_local_shape=[1, 3, 66, 64], spec_offsets=[0, 0, 0, 0])
    wrong = ShardLayout(snaps)
    assert wrong.verdict.startswith(f"{len(wrong.warnings)} problems")
    page = inspector_html(wrong)
    first_warning = page.index("⚠ rank 0: tensor dim 2 is not sharded")
    assert page.index(wrong.verdict) < first_warning < page.index('<pre class="sd-grid">') < page.index("sd-ranks")
    text = wrong.text()
    assert text.index("WARNING: rank 0: tensor dim 2 is not sharded") < text.index("rank 0!")


# ---- big traces: bounded payloads -------------------------------------------------------------------
@pytest.fixture(scope="module")
def big16() -> Trace:
    """The golden trace's records repeated over 16 ranks (6,400 events; bench/bench_trace_big.py makes the
    million-event one the same way); the tests lower the size thresholds to it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_trace_big", DATA.parent.parent / "bench" / "bench_trace_big.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = mod.big_trace_document(6_400, 16)
    return Trace(dict(zip(doc["ranks"], doc["payloads"])), {r: 0 for r in doc["ranks"]}, [], doc["meta"])


def _origin_ms(t) -> tuple[pd.DataFrame, pd.DataFrame]:
    """get_ops / get_collectives with start_ms / end_ms since the trace's first event, from their ns columns."""
    ops, colls = t.get_ops(), t.get_collectives()
    t0 = min(int(ops["t_start_ns"].min()), int(colls["t_issue_ns"].min()))
    ops = ops.assign(start_ms=(ops["t_start_ns"] - t0) / 1e6,
                     end_ms=(ops["t_end_ns"].fillna(ops["t_end_ns"].max()) - t0) / 1e6)
    colls = colls.assign(start_ms=(colls["t_issue_ns"] - t0) / 1e6,
                         end_ms=(colls["t_done_ns"].fillna(colls["t_issue_ns"]) - t0) / 1e6)
    return ops, colls


def test_big_trace_explorer_ships_a_bounded_sample_and_says_so(trace, big16, monkeypatch):
    from sharddbg.views import bundle

    # a small trace is as before: every call, no sentence
    small = ex.explorer_data(trace)
    assert small["sample"] is None and small["left_out_text"] is None and small["left_out"] == 0
    for name, value in (("BIG_TRACE_ABOVE", 1000), ("BIG_ERRORS", 40), ("BIG_FALLBACKS", 40), ("BIG_SLOWEST", 100),
                        ("BIG_FIRST", 100), ("SAMPLE_ROWS", 280)):
        monkeypatch.setattr(ex, name, value)
    ops, colls = _origin_ms(big16)
    data = ex.explorer_data(big16)
    rows = pd.DataFrame(ex.decode_rows(data))
    assert len(rows) <= 280 and data["total"] == len(ops) and data["left_out"] == len(ops) - len(rows)
    # the sentence, against the trace's own tables: how many raised / fell back, how many rows, how to see the rest
    from sharddbg.analysis.ops import is_fallback

    raising = ops["exc_type"].notna() & ops["error_handled"].map(lambda h: h is not True)
    raised, fell_back = int(raising.sum()), int((is_fallback(ops) & ~raising).sum())
    assert fell_back > 40 and raised > 40
    text = data["left_out_text"]
    assert text.startswith(f"this view holds {len(rows)} of the {len(ops)} op calls")
    assert f"40 of the {raised} that raised" in text and f"40 of the {fell_back} DTensor fallbacks" in text
    assert f"{len(ops) - len(rows)} are left out of the list" in text and "t.show(rank=2, window=(" in text
    # the slowest ordinary call and the first one in time are there, on every rank they ran on
    plain = ops[~raising & ~is_fallback(ops)]
    slowest = plain.loc[plain["host_ms"].idxmax()]
    first = plain.loc[plain["t_start_ns"].idxmin()]
    shipped = set(zip(rows["rank"], rows["seq"]))
    assert (slowest["rank"], slowest["seq"]) in shipped and (first["rank"], first["seq"]) in shipped
    assert rows.groupby("key")["rank"].nunique().max() == 16  # whole calls: each on all 16 ranks
    # only the collectives the shipped calls count, and every one a shipped call's detail lists
    shipped_colls = {(c[0], c[1]) for c in data["collectives"]}
    assert 0 < len(shipped_colls) < len(colls)
    for r in rows[rows["kind"] == "op"].head(2).itertuples():
        mine = ex.op_detail(big16, r.rank, r.seq)["collectives"]
        assert set(zip(mine["rank"], mine["seq"])) <= shipped_colls
    # the summary still counts every call
    assert sum(s["calls"] for s in data["summary"]) == int(big16.get_op_summary()["calls"].sum())
    # a rank and a window: the calls of rank 2 starting in it (ms since the first event), all of them
    a, b = 0.3 * ops["start_ms"].max(), 0.31 * ops["start_ms"].max()
    part = ex.explorer_data(big16, rank=2, window=(a, b))
    want = ops[(ops["rank"] == 2) & (ops["start_ms"] >= a) & (ops["start_ms"] <= b)]
    got = pd.DataFrame(ex.decode_rows(part))
    on2 = got[got["rank"] == 2]
    assert 0 < len(on2) == len(want) and set(on2["seq"]) == set(want["seq"]) and part["sample"] is None
    assert set(got["key"]) == set(on2["key"]) and got["rank"].nunique() == 16  # each call on every rank
    assert part["initial_rank"] == 2
    assert part["left_out_text"].startswith(f"this view lists the {len(got)} op calls on rank 2 starting in ")
    with pytest.raises(ValueError, match="rank 99 is not in this trace"):
        ex.explorer_data(big16, rank=99)
    with pytest.raises(ValueError, match=r"window must be \(start_ms, end_ms\)"):
        big16.show(window=(5.0, 1.0))
    # the notebook keeps the bounded view when the trace is too big to keep
    w = big16.show()
    drawn_bytes = len(json.dumps(w.data, separators=(",", ":"), allow_nan=False))
    monkeypatch.setattr(bundle, "PAYLOAD_MAX_BYTES", drawn_bytes + 100)
    payload = w._repr_mimebundle_()[0][bundle.VIEW_MIMETYPE]
    assert payload["data"] is None and payload["drawn"] == json.loads(json.dumps(w.data)) and "the view is kept" in payload["note"]


def test_busy_ms_is_the_spans_time_in_each_bin():
    rng = np.random.default_rng(7)
    starts = rng.uniform(0, 100, 300)
    ends = starts + rng.uniform(0, 20, 300)
    edges = np.linspace(-5, 130, 28)
    want = [np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum() for lo, hi in zip(edges[:-1], edges[1:])]
    assert np.allclose(tl.busy_ms(starts, ends, edges), want) and np.isclose(sum(want), (ends - starts).sum())


def test_big_trace_timeline_is_an_overview_with_its_slowest_windows_drawn(big16, monkeypatch, tmp_path):
    from sharddbg.views.figure import figure_drawn

    for name, value in (("OVERVIEW_ABOVE", 1000), ("OVERVIEW_CELLS", 4000), ("OVERVIEW_MIN_BINS", 50),
                        ("DETAIL_WINDOW_SPANS", 300)):
        monkeypatch.setattr(tl, name, value)
    ops, colls = _origin_ms(big16)
    fig = tl.plot_timeline(big16)
    (hm,) = [d for d in fig.data if d.type == "heatmap"]
    lanes = 16 * 3  # autograd, ops, collectives on each rank
    assert len(hm.x) == tl.overview_bins(lanes) == 4000 // lanes
    # each rank's comm time, summed over its bins' hover text, is its collectives' time (get_collectives)
    comm = {}
    for row in hm.text:
        for cell in row:
            if cell and "· collectives" in cell:
                r = int(cell.split()[1])
                comm[r] = comm.get(r, 0.0) + float(re.search(r"comm ([\d.]+) ms", cell).group(1))
    want = (colls["end_ms"] - colls["start_ms"]).groupby(colls["rank"]).sum()
    for r in range(16):
        assert comm[r] == pytest.approx(want[r], abs=5e-4 * len(hm.x))
    # the windows around the slowest spans, each within its bound: shaded and marked; the page draws any zoomed window
    # from the spans the figure carries, so they are not drawn here (WebGL: a second of the first screen at 1M)
    windows = tl.detail_windows(tl.timeline_frame(big16), tl.collective_spans(big16), tl.DETAIL_WINDOWS, 300)
    assert 0 < len(windows) <= tl.DETAIL_WINDOWS and "windows around the slowest spans" in fig.layout.title.text
    assert len(fig.layout.shapes) == len(windows) + 15  # shaded windows, the 15 lines between rank bands
    assert [(s.x0, s.x1) for s in fig.layout.shapes if s.type == "rect"] == windows
    (marks,) = [d for d in fig.data if d.type == "scatter" and d.name == tl.WINDOW_MARKS]
    assert len(marks.x) == len(windows) and "to see it op by op" in marks.hovertext[0]
    assert "sd_zoom" in fig.layout.meta and not any(d.type == "scattergl" for d in fig.data)
    overlap = lambda f, a, b: (f["end_ms"] >= a) & (f["start_ms"] <= b)
    inside_ops = np.any([overlap(ops, a, b) for a, b in windows], axis=0)
    inside_colls = np.any([overlap(colls, a, b) for a, b in windows], axis=0)
    for a, b in windows:
        assert int(overlap(ops, a, b).sum() + overlap(colls, a, b).sum()) <= 300
    slowest = colls.loc[(colls["end_ms"] - colls["start_ms"]).idxmax()]
    assert any(a <= slowest["start_ms"] and slowest["end_ms"] <= b for a, b in windows) or \
        (colls["end_ms"] - colls["start_ms"]).max() < (ops["end_ms"] - ops["start_ms"]).max()
    assert len(json.dumps(figure_drawn(fig))) < 2_000_000
    _check_any_window_drawn_from_the_carried_spans(big16, fig, tmp_path)

    def drawn_op_by_op(data) -> int:  # the spans the windows' WebGL traces draw (one hover marker each)
        return sum(len(d["x"]) if isinstance(d["x"], list) else len(base64.b64decode(d["x"]["bdata"])) // 8
                   for d in data if d["type"] == "scattergl" and d["mode"] == "markers")

    # a notebook that cannot keep the figure with the spans it carries keeps it without them, the windows drawn op by
    # op instead: every span in them (windows of at most 40 spans here, fewer bytes than the spans the figure carries)
    from sharddbg.views import bundle

    monkeypatch.setattr(tl, "DETAIL_WINDOW_SPANS", 40)
    fig = tl.plot_timeline(big16)
    windows = tl.detail_windows(tl.timeline_frame(big16), tl.collective_spans(big16), tl.DETAIL_WINDOWS, 40)
    assert windows and [(s.x0, s.x1) for s in fig.layout.shapes if s.type == "rect"] == windows
    inside_ops = np.any([overlap(ops, a, b) for a, b in windows], axis=0)
    inside_colls = np.any([overlap(colls, a, b) for a, b in windows], axis=0)
    with_spans = len(json.dumps(figure_drawn(fig), separators=(",", ":")))
    monkeypatch.setattr(bundle, "PAYLOAD_MAX_BYTES", with_spans - 1)
    kept = fig.sharddbg_payload()["drawn"]["figure"]
    assert "sd_zoom" not in (kept["layout"].get("meta") or {}) and len(kept["data"]) > len(fig.data)
    assert drawn_op_by_op(kept["data"]) == int(inside_ops.sum() + inside_colls.sum())
    kept_title = kept["layout"]["title"]["text"]
    assert "drawn op by op" in kept_title and "zoom in to a window" not in kept_title
    # too large with them too: the overview alone
    without = len(json.dumps(kept, separators=(",", ":")))
    monkeypatch.setattr(bundle, "PAYLOAD_MAX_BYTES", without - 1)
    alone = fig.sharddbg_payload()["drawn"]["figure"]
    assert "sd_zoom" not in (alone["layout"].get("meta") or {}) and len(alone["data"]) == len(fig.data)
    # plotly's own renderer (it cannot draw a window from the spans) gets the windows drawn op by op, not the spans
    import plotly.io as pio

    monkeypatch.setattr(bundle, "PAYLOAD_MAX_BYTES", 5 * 2**20)
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")
    shown = fig._repr_mimebundle_()
    plotly_own = shown["application/vnd.plotly.v1+json"]
    assert "sd_zoom" not in (plotly_own["layout"].get("meta") or {})
    assert "drawn op by op" in plotly_own["layout"]["title"]["text"]
    assert drawn_op_by_op(plotly_own["data"]) == int(inside_ops.sum() + inside_colls.sum())
    assert "sd_zoom" in shown[bundle.VIEW_MIMETYPE]["drawn"]["figure"]["layout"]["meta"]
    # a trace with more spans than the figure may carry draws its windows op by op itself
    monkeypatch.setattr(tl, "ZOOM_EVENTS_MAX", len(ops) - 1)
    alone = tl.plot_timeline(big16)
    assert "sd_zoom" not in (alone.layout.meta or {}) and "drawn op by op" in alone.layout.title.text
    assert drawn_op_by_op(figure_drawn(alone)["figure"]["data"]) == int(inside_ops.sum() + inside_colls.sum())
    (marks,) = [d for d in alone.data if d.type == "scatter" and d.name == tl.WINDOW_MARKS]
    assert "drawn op by op" in marks.hovertext[0]


def _zoom_columns(z: dict) -> pd.DataFrame:
    """The spans a timeline's ``sd_zoom`` carries, decoded as the page decodes them (views/_static/timeline_zoom.js)."""
    import base64
    import zlib

    raw, n = zlib.decompress(base64.urlsafe_b64decode(z["columns"])), z["n"]
    parts, at = {}, 0
    for name, dtype in (("delta", "<u4"), ("duration", "<u4"), ("row", "<u2"), ("category", "u1"), ("name", "<u2")):
        size = np.dtype(dtype).itemsize * n
        parts[name] = np.frombuffer(raw[at:at + size], dtype=dtype)
        at += size
    assert at == len(raw)
    start = z["origin_ms"] + np.cumsum(parts["delta"].astype(np.int64)) * z["tick_ms"]
    return pd.DataFrame({"start_ms": start, "end_ms": start + parts["duration"] * z["tick_ms"],
                         "y": np.array(z["rows"])[parts["row"]], "category": np.array(z["categories"])[parts["category"]],
                         "name": np.array(z["names"], dtype=object)[parts["name"]]})


def _check_any_window_drawn_from_the_carried_spans(big16, fig, tmp_path) -> None:
    """Zoomed into any window (not only the slowest ones drawn in Python), the page draws its spans one by one from
    the spans the figure carries: decoded here as the page does, and by the page's own script under node."""
    import shutil

    z = fig.layout.meta["sd_zoom"]
    ops, coll = tl.timeline_frame(big16), tl.collective_spans(big16)
    spans = _zoom_columns(z)
    assert z["n"] == len(spans) == len(ops) + len(coll) and z["draw_up_to"] == tl.ZOOM_DRAW_SPANS
    # a window away from every one drawn in Python: its spans, from the carried columns, are the trace's own
    windows = tl.detail_windows(ops, coll)
    x1 = float(max(ops["end_ms"].max(), coll["end_ms"].max()))
    tick = z["tick_ms"]  # the carried times' resolution: a window whose edges no span starts or ends near
    edges = np.concatenate([ops["start_ms"], ops["end_ms"], coll["start_ms"], coll["end_ms"]]).astype(float)
    a = next(x for x in np.linspace(0, x1, 81)[1:-1]
             if all(x + x1 / 200 < w0 or x > w1 for w0, w1 in windows)
             and not (np.abs(edges - x) < 3 * tick).any() and not (np.abs(edges - x - x1 / 200) < 3 * tick).any())
    b = a + x1 / 200
    overlap = lambda f: f[(f["end_ms"] >= a) & (f["start_ms"] <= b)]
    want = pd.concat([overlap(ops)[["start_ms", "end_ms", "y", "category"]], overlap(coll)[["start_ms", "end_ms", "y", "category"]]])
    got = overlap(spans)
    assert 0 < len(got) == len(want) <= tl.ZOOM_DRAW_SPANS
    ticks = lambda ms: np.round((np.asarray(ms, dtype=float) - z["origin_ms"]) / tick).astype(np.int64)
    got_keys = sorted(zip(ticks(got["start_ms"]), np.round(got["y"], 6)))
    want_keys = sorted(zip(ticks(want["start_ms"]), np.round(want["y"].astype(float), 6)))
    assert got_keys == want_keys
    assert set(got["category"]) == {c.replace("_", " ") for c in want["category"]}
    assert set(got["name"]) >= set(overlap(ops)["op"])
    assert len(z["columns"]) < 40 * z["n"]  # compact: a few bytes a span
    # the page's own script finds the same spans (node runs the module as the page does; skipped without node)
    node = shutil.which("node")
    if node is None:  # the page's script is then checked by bench/bench_views.py in chromium only
        return
    js = Path(sharddbg.__file__).parent / "views" / "_static" / "timeline_zoom.js"
    (tmp_path / "zoom.json").write_text(json.dumps(z))
    script = tmp_path / "check.mjs"
    script.write_text(f"""
        import {{ readFileSync }} from "fs";
        globalThis.document = {{}};
        const z = JSON.parse(readFileSync({json.dumps(str(tmp_path / "zoom.json"))}, "utf8"));
        const m = await import({json.dumps(js.as_uri())});
        const ev = await m.decodeSpans(z);
        const per = m.visibleSpans(ev, {a}, {b}, z.draw_up_to, z.categories);
        const idx = per.flat();
        console.log(JSON.stringify({{n: idx.length, starts: idx.map(i => Math.round((ev.start[i] - z.origin_ms) / z.tick_ms)).sort((x, y) => x - y)}}));
    """)
    out = json.loads(subprocess.run([node, str(script)], capture_output=True, text=True, check=True, timeout=60).stdout)
    assert out["n"] == len(want)
    assert out["starts"] == sorted(ticks(got["start_ms"]).tolist())
    # too many spans in the window: none drawn one by one (the overview's bins stay)
    assert subprocess.run([node, "--input-type=module", "-e", f"""
        import {{ readFileSync }} from "fs";
        const z = JSON.parse(readFileSync({json.dumps(str(tmp_path / "zoom.json"))}, "utf8"));
        const m = await import({json.dumps(js.as_uri())});
        const ev = await m.decodeSpans(z);
        process.exit(m.visibleSpans(ev, -1, 1e12, 10, z.categories) === null ? 0 : 1);"""], timeout=60).returncode == 0


def _lane_depths_by_record(ops: pd.DataFrame) -> list[int]:
    """Each op's depth below its innermost autograd-wide ancestor, walked one op at a time (the rule the timeline's
    lanes follow)."""
    wide = {(r, s) for r, s, o in zip(ops["rank"], ops["seq"], ops["op"]) if tl.is_autograd_wide(o)}
    parent = {(r, s): int(p) for r, s, p in zip(ops["rank"], ops["seq"], ops["parent_seq"]) if not pd.isna(p)}
    out = []
    for r, s in zip(ops["rank"], ops["seq"]):
        depth, key = 0, (r, s)
        while key in parent:
            key = (r, parent[key])
            if key in wide:
                break
            depth += 1
        out.append(depth)
    return out


def test_big_trace_tables_on_columns_are_the_record_by_record_ones(trace, big16, monkeypatch):
    """What a big trace's report reads on whole columns (the collectives' owners, the imbalance, the mismatches, the
    timeline's lanes, the explorer's groups of identical calls) equals what the code reading one record at a time
    gives, on the golden trace and on the 16-rank one."""
    from sharddbg.analysis import comm

    for t in (trace, big16):
        ops, colls = t.get_ops(), t.get_collectives()
        # owners: all collectives at once against collective_calls one at a time (the small-trace path)
        monkeypatch.setattr(comm, "BY_COLUMNS_ABOVE", 10**9)
        by_record = comm.collective_owners(colls, ops)
        imbalance = comm.imbalance(ops, colls)
        monkeypatch.setattr(comm, "BY_COLUMNS_ABOVE", 0)
        pd.testing.assert_frame_equal(comm.collective_owners(colls, ops), by_record, check_exact=True)
        pd.testing.assert_frame_equal(comm.imbalance(ops, colls), imbalance, check_exact=False, rtol=1e-12)
        assert imbalance["shard_elems"].sum() > 0 and imbalance["n_collectives"].sum() == len(colls)
        # mismatches (every third collective kept: ranks missing, most collectives now mismatched): the quick look
        # on plain lists leaves out only collectives the full look finds nothing wrong with
        part = colls.iloc[::3]
        full = part.assign(_match=comm.matched_collectives(part)).sort_values(comm.MATCH_KEY, kind="stable")
        want = [row for _, d in full.groupby("_match", sort=False) for row in comm._mismatch_rows(d, set(t.ranks))]
        got = comm.collective_mismatches(part, traced_ranks=t.ranks)
        assert len(got) == len(want) > 0 and got.to_dict("records") == want
        assert comm.collective_mismatches(colls, traced_ranks=t.ranks).empty
        # one all_reduce's size and one all_to_all's splits changed on one rank: those two, nothing else
        bad = colls.copy()
        ar = bad.index[(bad["kind"] == "all_reduce").to_numpy()][0]
        a2a = bad.index[((bad["kind"] == "all_to_all_single") & bad["splits_sent"].map(lambda x: isinstance(x, list)
                                                                                       and len(x) > 1)).to_numpy()][0]
        bad.loc[ar, "bytes_sent"] += 4
        bad.at[a2a, "splits_sent"] = [v + 4 for v in bad.at[a2a, "splits_sent"]]
        found = comm.collective_mismatches(bad, traced_ranks=t.ranks)
        assert sorted(zip(found["problem"], found["group_seq"])) == sorted(
            [("size", int(bad.at[ar, "group_seq"])), ("splits", int(bad.at[a2a, "group_seq"]))])
        # the timeline's lanes
        assert tl._lane_depths(ops).tolist() == _lane_depths_by_record(ops)
        assert (tl._lane_depths(ops) > 0).any()
        # the explorer's groups of identical calls: their values' reprs compared, numbered in call order per summary row
        order = ex._tables(t).calls
        order = order[order["summary_row"].notna()].sort_values(["summary_row", "occurrence", "rank", "seq"], kind="stable")
        identity = pd.Series([repr(r) for r in order[list(ex.CALL_IDENTITY)].itertuples(index=False, name=None)],
                             index=order.index)
        want_groups = identity.groupby(order["summary_row"], sort=False).transform(lambda s: pd.factorize(s)[0])
        assert (order["call_group"].astype("int64") == want_groups).all() and want_groups.max() > 0
