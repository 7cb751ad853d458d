"""The all-rank timeline: one row per rank, op spans by dispatch path, collective spans by kind.

The spans and the overview's bins are pure data (``sharddbg.analysis.timeline``); this module places
them in lanes, colours them and writes their hover text: ``timeline_frame`` (op spans) and
``collective_spans`` are exactly what the figure draws. Every string taken from a trace is
HTML-escaped before it reaches plotly (hover text and legend names are rendered as HTML by plotly.js).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from ..analysis.comm import NO_OP
from ..analysis.formatting import format_bytes, format_shape
from ..analysis.timeline import (ERROR_CATEGORY, collective_span_frame, in_window, op_span_frame,
                                 time_origin_ns, timeline_overview)
from .common import ERROR_COLOR, PATH_COLORS, collective_colors, esc, path_color

if TYPE_CHECKING:
    from ..trace import Trace

# Lanes inside one rank's band (the y axis is reversed: rank 0 on top).
OP_LANE0 = -0.16  # depth-0 ops; deeper ops below, LANE_STEP apart
LANE_STEP = 0.12
MAX_LANES = 3
COLL_LANE = 0.3
LANE_HALF = 0.09
# Above this many op spans, nested ops (depth > 0) are merged into their depth-0 parent's lane.
AGGREGATE_ABOVE = 60_000
# Above this many spans (ops + collectives) still to draw, the timeline is a binned overview (one image:
# its cost no longer grows with the events); plot_timeline(t, time_range=(a, b)) draws a window span by span.
OVERVIEW_ABOVE = 30_000
OVERVIEW_BINS = 1500

TIMELINE_COLUMNS = ["rank", "seq", "op", "path", "phase", "depth", "start_ms", "end_ms", "y", "category", "hover"]
COLLECTIVE_SPAN_COLUMNS = ["rank", "seq", "kind", "op", "start_ms", "end_ms", "bytes_sent", "bytes_recv", "category",
                           "y", "hover"]


def _time_origin(trace: Trace) -> int:
    return time_origin_ns(trace.get_ops(), trace.get_collectives())


def timeline_frame(trace: Trace, aggregate: bool | None = None) -> pd.DataFrame:
    """One row per op span: rank, seq, op, path, phase, depth, start_ms, end_ms (from the trace's first
    event), y (lane), category (path, or "error"), hover (HTML-escaped). In-flight ops end at the
    last recorded time. ``aggregate``: drop nested ops (depth > 0) — on by default above
    ``AGGREGATE_ABOVE`` spans, to keep the browser responsive."""
    ops = trace.get_ops()
    if ops.empty:
        return pd.DataFrame(columns=TIMELINE_COLUMNS)
    if aggregate is None:
        aggregate = len(ops) > AGGREGATE_ABOVE
    if aggregate:
        ops = ops[ops["depth"] == 0]
    df = op_span_frame(ops, _time_origin(trace))
    df["y"] = df["rank"] + OP_LANE0 + LANE_STEP * df["depth"].clip(upper=MAX_LANES)
    hover = []
    for o in ops.itertuples(index=False):
        hover.append(
            f"<b>{esc(o.op)}</b> · rank {int(o.rank)} · seq {int(o.seq)}<br>"
            f"{esc(o.phase)} · {esc(o.path)}" + (f" · node {esc(o.autograd_node)}" if isinstance(o.autograd_node, str) else "")
            + f"<br>in {esc(', '.join(format_shape(s) for s in (o.in_local_shapes or [])))} → out "
              f"{esc(format_shape(o.out_local_shape))} (local)"
            f"<br>bytes in {format_bytes(o.in_bytes)} · out {format_bytes(o.out_bytes)} · host {o.host_ms:.3f} ms"
            + (f"<br>module {esc(o.module)}" if isinstance(o.module, str) else "")
            + (f"<br>error: {esc(o.error)}" if isinstance(o.error, str) else ""))
    df["hover"] = hover
    return df[TIMELINE_COLUMNS]


def collective_spans(trace: Trace) -> pd.DataFrame:
    """One row per collective: rank, seq, kind, op, start_ms, end_ms, bytes, category (its kind), y
    (lane), hover (HTML-escaped). Empty, with these columns, when the trace has no collectives."""
    df = collective_span_frame(trace.get_collectives(), _time_origin(trace))
    df["y"] = df["rank"] + COLL_LANE
    df["hover"] = [
        f"<b>{esc(c.kind)}</b> · rank {int(c.rank)}<br>from op {esc(c.op if isinstance(c.op, str) else NO_OP)}<br>"
        f"sent {format_bytes(c.bytes_sent)} · received {format_bytes(c.bytes_recv)}<br>{c.end_ms - c.start_ms:.3f} ms"
        for c in df.itertuples(index=False)]
    return df[COLLECTIVE_SPAN_COLUMNS]


def _segments(df: pd.DataFrame):
    """x, y arrays (numpy, NaN between segments: plotly ships them as compact typed arrays) drawing every
    row as a horizontal segment, and the segments' midpoints (where their hover labels live)."""
    import numpy as np

    n = len(df)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    x[0::3], x[1::3] = df["start_ms"].to_numpy(float), df["end_ms"].to_numpy(float)
    y[0::3] = y[1::3] = df["y"].to_numpy(float)
    mid = (df["start_ms"].to_numpy(float) + df["end_ms"].to_numpy(float)) / 2
    return x, y, mid


def _span_traces(fig, df: pd.DataFrame, name: str, color: str, width: int, group: str, group_title: str | None) -> None:
    """One WebGL line trace for the spans (no hover) + one of invisible midpoint markers carrying the
    hover text once per span; they share a legend entry."""
    import plotly.graph_objects as go

    x, y, mid = _segments(df)
    extra = {"legendgrouptitle_text": group_title} if group_title else {}
    fig.add_trace(go.Scattergl(x=x, y=y, mode="lines", line={"color": color, "width": width}, name=name,
                               legendgroup=group, hoverinfo="skip", connectgaps=False, **extra))
    fig.add_trace(go.Scattergl(x=mid, y=df["y"].to_numpy(float), mode="markers", name=name, legendgroup=group,
                               showlegend=False, marker={"color": color, "size": 9, "opacity": 0},
                               hovertext=df["hover"].tolist(), hoverinfo="text", hoverlabel={"bgcolor": color}))


def _op_categories(ops: pd.DataFrame) -> list[str]:
    """The op categories present, in legend order: dispatch paths as PATH_COLORS lists them, errors,
    then any other path."""
    order = list(PATH_COLORS) + [ERROR_CATEGORY]
    present = set(ops["category"])
    return [c for c in order if c in present] + sorted(present - set(order))


def _op_color(category: str) -> str:
    return ERROR_COLOR if category == ERROR_CATEGORY else path_color(category)


def _overview_figure(fig, ops: pd.DataFrame, coll: pd.DataFrame, ranks: list[int], bins: int, x0: float, x1: float):
    """Draw the binned overview: one heatmap image, lanes as rows (ops above, collectives below)."""
    import numpy as np
    import plotly.graph_objects as go

    ov = pd.concat([timeline_overview(ops, "ops", bins, x0, x1), timeline_overview(coll, "collectives", bins, x0, x1)])
    op_cats = _op_categories(ops)
    coll_cats = sorted(set(coll["category"]))
    cats = op_cats + coll_cats
    colors = {c: _op_color(c) for c in op_cats}
    colors.update(collective_colors(coll_cats))
    lanes = []  # (y center, rank, lane)
    for r in ranks:
        lanes.append((r + OP_LANE0, r, "ops"))
        if len(coll):
            lanes.append((r + COLL_LANE, r, "collectives"))
    edges, zrows, lane_row = [], [], {}
    for y, r, lane in sorted(lanes):
        if edges and edges[-1] < y - LANE_HALF:  # an empty row in the gap between two lanes
            zrows.append(None)
        if not edges or edges[-1] < y - LANE_HALF:
            edges.append(y - LANE_HALF)
        lane_row[(r, lane)] = len(zrows)
        zrows.append(None)
        edges.append(y + LANE_HALF)
    z = np.full((len(zrows), bins), np.nan)
    text = np.full((len(zrows), bins), "", dtype=object)
    width = (x1 - x0) / bins
    for o in ov.itertuples(index=False):
        i = lane_row[(o.rank, o.lane)]
        z[i, o.bin] = cats.index(o.category)
        what = ", ".join(f"{esc(c.replace('_', ' '))} {n}" for c, n in sorted(o.counts.items(), key=lambda kv: -kv[1]))
        text[i, o.bin] = (f"rank {o.rank} · {o.lane}<br>{o.bin_start_ms:.3f}–{o.bin_end_ms:.3f} ms<br>"
                          f"{o.n_spans} span{'s' if o.n_spans != 1 else ''}: {what}")
    n = max(len(cats), 1)
    scale = []
    for k, c in enumerate(cats or ["none"]):
        col = colors.get(c, "#ccc")
        scale += [[k / n, col], [(k + 1) / n, col]]
    fig.add_trace(go.Heatmap(x=[x0 + (b + 0.5) * width for b in range(bins)], y=edges, z=z, text=text,
                             hovertemplate="%{text}<extra></extra>", hoverongaps=False, showscale=False,
                             colorscale=scale, zmin=-0.5, zmax=n - 0.5, name="overview"))
    errs = ov[ov["has_error"].astype(bool)] if len(ov) else ov
    if len(errs):
        fig.add_trace(go.Scatter(x=(errs["bin_start_ms"] + errs["bin_end_ms"]) / 2,
                                 y=[r + OP_LANE0 - LANE_HALF - 0.07 for r in errs["rank"]], mode="markers",
                                 name="error raised", marker={"symbol": "triangle-down", "size": 7, "color": ERROR_COLOR},
                                 hovertext=[f"rank {r}: an op raised in {a:.3f}–{b:.3f} ms" for r, a, b in
                                            zip(errs["rank"], errs["bin_start_ms"], errs["bin_end_ms"])],
                                 hoverinfo="text", legendgroup="op:error"))
    for c in cats:  # legend entries
        group = "ops by dispatch path" if c in op_cats else "collectives"
        first = c == (op_cats[0] if c in op_cats else coll_cats[0])
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=esc(c.replace("_", " ")),
                                 marker={"symbol": "square", "size": 12, "color": colors[c]},
                                 legendgroup=("op:" if c in op_cats else "coll:") + c,
                                 **({"legendgrouptitle_text": group} if first else {})))


def _span_figure(fig, ops: pd.DataFrame, coll: pd.DataFrame) -> None:
    """Draw every span: per op category and per collective kind, a line trace and its hover markers."""
    import plotly.graph_objects as go

    for k, cat in enumerate(_op_categories(ops)):
        _span_traces(fig, ops[ops["category"] == cat], esc(cat.replace("_", " ")), _op_color(cat), 9, f"op:{cat}",
                     "ops by dispatch path" if k == 0 else None)
    errs = ops[ops["category"] == ERROR_CATEGORY]
    if len(errs):
        fig.add_trace(go.Scattergl(x=errs["start_ms"], y=errs["y"], mode="markers", name="error raised",
                                   marker={"symbol": "x", "size": 11, "color": ERROR_COLOR, "line": {"width": 1}},
                                   hovertext=errs["hover"], hoverinfo="text", legendgroup="ops"))
    for k, (kind, color) in enumerate(collective_colors(coll["kind"]).items()):
        _span_traces(fig, coll[coll["kind"] == kind], esc(kind), color, 7, f"coll:{kind}",
                     "collectives" if k == 0 else None)


def plot_timeline(trace: Trace, *, aggregate: bool | None = None, time_range: tuple[float, float] | None = None,
                  overview: bool | None = None, height: int | None = None):
    """Plotly Figure: one row per rank (rank 0 on top), op spans coloured by dispatch path (errors in
    dark red), collective spans below them coloured by kind; hover shows shapes, bytes and time.

    ``time_range=(a, b)``: only that window (ms since the first event). ``aggregate``: merge nested ops
    into their top-level op (default: above ``AGGREGATE_ABOVE`` spans). ``overview``: bin the spans into
    ``OVERVIEW_BINS`` time bins per rank lane, coloured by the most frequent category in each bin (default:
    above ``OVERVIEW_ABOVE`` spans to draw); zoom in with ``time_range`` to see single ops."""
    import plotly.graph_objects as go

    ops = in_window(timeline_frame(trace, aggregate=aggregate), time_range)
    coll = in_window(collective_spans(trace), time_range)
    ranks = list(trace.ranks)
    all_ops = trace.get_ops()
    fig = go.Figure()
    if overview is None:
        overview = len(ops) + len(coll) > OVERVIEW_ABOVE
    title = f"Timeline · {len(ranks)} ranks · {len(all_ops)} op calls" + (
        f" · {len(coll)} collectives" if len(coll) else " · no collectives recorded")
    if overview and (len(ops) or len(coll)):
        drawn = [f for f in (ops, coll) if len(f)]
        lo, hi = (min(f["start_ms"].min() for f in drawn), max(f["end_ms"].max() for f in drawn)) \
            if time_range is None else time_range
        _overview_figure(fig, ops, coll, ranks, OVERVIEW_BINS, float(lo), float(hi))
        if time_range is None:
            fig.update_xaxes(range=[float(lo), float(hi)])
        title += (f" · overview: {len(ops) + len(coll)} spans in {OVERVIEW_BINS} time bins, the most frequent "
                  f"path per bin<br><sub>plot_timeline(time_range=(a, b)) draws a window op by op</sub>")
    else:
        _span_figure(fig, ops, coll)
        if aggregate is not False and len(ops) and ops["depth"].max() == 0 and all_ops["depth"].max() > 0:
            title += f" · nested ops merged ({len(ops)} spans drawn)"
    if time_range is not None:
        title += f" · window {time_range[0]:g}–{time_range[1]:g} ms"
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 14}},
        height=height or max(260, 110 + 80 * len(ranks)), template="plotly_white", hovermode="closest",
        margin={"l": 70, "r": 20, "t": 50, "b": 45}, legend={"orientation": "v", "groupclick": "toggleitem"},
        xaxis={"title": "time since the first event (ms)", "showgrid": True, "zeroline": False,
               **({"range": list(time_range)} if time_range is not None else {})},
        yaxis={"tickmode": "array", "tickvals": ranks, "ticktext": [f"rank {r}" for r in ranks],
               "autorange": False, "range": [max(ranks, default=0) + 0.55, min(ranks, default=0) - 0.55],
               "showgrid": False, "zeroline": False},
    )
    for r in ranks[1:]:
        fig.add_hline(y=r - 0.5, line={"color": "#ddd", "width": 1})
    if r_inc := [r for r in ranks if r in trace.incomplete_ranks]:
        fig.add_annotation(text=f"incomplete ranks (timed out or sent nothing): {r_inc}", xref="paper", yref="paper",
                           x=1, y=1.08, showarrow=False, font={"color": "#b00020"})
    return fig
