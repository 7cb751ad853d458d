"""Plotly figures over a Trace: the all-rank timeline, communication per op, imbalance per rank.

Each figure has a pure data function beside it (``timeline_frame``, ``collective_spans``,
``comm_by_op_frame``, ``imbalance_frame``) that the tests check against the trace's own DataFrames.
Collective data (``get_collectives`` / ``get_comm_by_op`` / ``get_imbalance``, issue 4) is used when
the Trace has it; without it the op views still work and the comm views say that nothing was recorded.

Every string taken from a trace is HTML-escaped before it reaches plotly (hover text and legend names
are rendered as HTML by plotly.js).
"""

from __future__ import annotations

import math

import pandas as pd

from ._common import COLLECTIVE_COLORS, ERROR_COLOR, PATH_COLORS, esc, path_color

# Lanes inside one rank's band (the y axis is reversed: rank 0 on top).
OP_LANE0 = -0.16  # depth-0 ops; deeper ops below, LANE_STEP apart
LANE_STEP = 0.12
MAX_LANES = 3
COLL_LANE = 0.3
# Above this many op spans, nested ops (depth > 0) are merged into their depth-0 parent's lane.
AGGREGATE_ABOVE = 60_000
# Above this many spans (ops + collectives) still to draw, the timeline is a binned overview (one image:
# its cost no longer grows with the events); plot_timeline(t, time_range=(a, b)) draws a window span by span.
OVERVIEW_ABOVE = 30_000
OVERVIEW_BINS = 1500
LANE_HALF = 0.09
# In an overview bin the colour is the category with most spans (ties: the first of these); bins where an
# op raised get an error marker on top.
_SEVERITY = ("error", "dtensor_fallback_dispatch", "dtensor_fallback_function")


def _frame(trace, name: str) -> pd.DataFrame | None:
    """``trace.get_<name>()`` when the Trace has it and it is not empty, else None."""
    fn = getattr(trace, f"get_{name}", None)
    if fn is None:
        return None
    try:
        df = fn()
    except NotImplementedError:
        return None
    return df if isinstance(df, pd.DataFrame) and len(df) else None


def _t0(trace) -> int:
    ops = trace.get_ops()
    starts = [ops["t_start_ns"].min()] if len(ops) else []
    coll = _frame(trace, "collectives")
    if coll is not None and "t_issue_ns" in coll:
        starts.append(coll["t_issue_ns"].min())
    starts = [int(s) for s in starts if not pd.isna(s)]
    return min(starts) if starts else 0


def _shape(s) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "—"
    return "(" + ", ".join(str(x) for x in s) + ("," if len(s) == 1 else "") + ")"


def _bytes(n) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def timeline_frame(trace, aggregate: bool | None = None) -> pd.DataFrame:
    """One row per op span: rank, seq, op, path, phase, depth, start_ms, end_ms (from the trace's first
    event), y (lane), category (path, or "error"), hover (HTML-escaped). In-flight ops end at the
    last recorded time. ``aggregate``: drop nested ops (depth > 0) — on by default above
    ``AGGREGATE_ABOVE`` spans, to keep the browser responsive."""
    ops = trace.get_ops()
    cols = ["rank", "seq", "op", "path", "phase", "depth", "start_ms", "end_ms", "y", "category", "hover"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    if aggregate is None:
        aggregate = len(ops) > AGGREGATE_ABOVE
    if aggregate:
        ops = ops[ops["depth"] == 0]
    t0 = _t0(trace)
    last = ops["t_end_ns"].max()
    last = int(last) if not pd.isna(last) else int(ops["t_start_ns"].max())
    end = ops["t_end_ns"].fillna(last).astype("int64")
    df = pd.DataFrame({
        "rank": ops["rank"].astype(int).values, "seq": ops["seq"].astype(int).values, "op": ops["op"].values,
        "path": ops["path"].values, "phase": ops["phase"].values, "depth": ops["depth"].astype(int).values,
        "start_ms": (ops["t_start_ns"].astype("int64").values - t0) / 1e6,
        "end_ms": (end.values - t0) / 1e6,
    })
    df["y"] = df["rank"] + OP_LANE0 + LANE_STEP * df["depth"].clip(upper=MAX_LANES)
    err = ops["exc_type"].notna().values
    df["category"] = df["path"].where(~err, "error")
    hover = []
    for o in ops.itertuples(index=False):
        h = (f"<b>{esc(o.op)}</b> · rank {int(o.rank)} · seq {int(o.seq)}<br>"
             f"{esc(o.phase)} · {esc(o.path)}" + (f" · node {esc(o.autograd_node)}" if isinstance(o.autograd_node, str) else "") +
             f"<br>in {esc(', '.join(_shape(s) for s in (o.in_local_shapes or [])))} → out {esc(_shape(o.out_local_shape))} (local)"
             f"<br>bytes in {_bytes(o.in_bytes)} · out {_bytes(o.out_bytes)} · host {o.host_ms:.3f} ms"
             + (f"<br>module {esc(o.module)}" if isinstance(o.module, str) else "")
             + (f"<br>error: {esc(o.error)}" if isinstance(o.error, str) else ""))
        hover.append(h)
    df["hover"] = hover
    return df[cols]


def collective_spans(trace) -> pd.DataFrame:
    """One row per collective (when the Trace records them): rank, kind, start_ms, end_ms, bytes, hover."""
    coll = _frame(trace, "collectives")
    cols = ["rank", "seq", "kind", "op", "start_ms", "end_ms", "bytes_sent", "bytes_recv", "y", "hover"]
    if coll is None:
        return pd.DataFrame(columns=cols)
    t0 = _t0(trace)
    done = coll["t_done_ns"].fillna(coll["t_issue_ns"])
    df = pd.DataFrame({
        "rank": coll["rank"].astype(int).values, "seq": coll["seq"].astype(int).values,
        "kind": coll["kind"].astype(str).values, "op": coll.get("op", pd.Series([None] * len(coll))).values,
        "start_ms": (coll["t_issue_ns"].astype("int64").values - t0) / 1e6,
        "end_ms": (done.astype("int64").values - t0) / 1e6,
        "bytes_sent": coll["bytes_sent"].values, "bytes_recv": coll["bytes_recv"].values,
    })
    df["y"] = df["rank"] + COLL_LANE
    df["hover"] = [
        f"<b>{esc(c.kind)}</b> · rank {int(c.rank)}<br>from op {esc(c.op)}<br>sent {_bytes(c.bytes_sent)} · "
        f"received {_bytes(c.bytes_recv)}<br>{c.end_ms - c.start_ms:.3f} ms"
        for c in df.itertuples(index=False)]
    return df[cols]


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


def _in_window(df: pd.DataFrame, time_range) -> pd.DataFrame:
    if time_range is None or df.empty:
        return df
    a, b = time_range
    return df[(df["end_ms"] >= a) & (df["start_ms"] <= b)]


def timeline_overview(spans: pd.DataFrame, lane: str, bins: int, x0: float, x1: float) -> pd.DataFrame:
    """Binned view of spans (``timeline_frame`` or ``collective_spans`` rows, with a ``category``):
    one row per (rank, bin) that some span overlaps: rank, lane, bin, bin_start_ms, bin_end_ms,
    category (the most frequent; ties go to errors, then DTensor fallbacks), n_spans, counts {category:
    spans} and has_error (a span that raised overlaps the bin)."""
    import numpy as np

    cols = ["rank", "lane", "bin", "bin_start_ms", "bin_end_ms", "category", "n_spans", "counts", "has_error"]
    if spans.empty:
        return pd.DataFrame(columns=cols)
    width = max(x1 - x0, 1e-9) / bins
    rows = []
    cats = sorted(set(spans["category"]))
    for rank, g in spans.groupby("rank", sort=True):
        counts = np.zeros((len(cats), bins + 1), dtype=np.int64)
        for k, cat in enumerate(cats):
            c = g[g["category"] == cat]
            if c.empty:
                continue
            b0 = np.clip(((c["start_ms"].to_numpy(float) - x0) // width).astype(int), 0, bins - 1)
            b1 = np.clip(((c["end_ms"].to_numpy(float) - x0) // width).astype(int), 0, bins - 1)
            np.add.at(counts[k], b0, 1)
            np.add.at(counts[k], b1 + 1, -1)
        counts = np.cumsum(counts, axis=1)[:, :bins]
        for b in np.nonzero(counts.sum(axis=0))[0]:
            present = {cats[k]: int(counts[k, b]) for k in range(len(cats)) if counts[k, b]}
            rank_of = {c: (len(_SEVERITY) - _SEVERITY.index(c)) if c in _SEVERITY else 0 for c in present}
            top = max(present, key=lambda c: (present[c], rank_of[c], c))
            rows.append({"rank": int(rank), "lane": lane, "bin": int(b), "bin_start_ms": x0 + b * width,
                         "bin_end_ms": x0 + (b + 1) * width, "category": top,
                         "n_spans": sum(present.values()), "counts": present, "has_error": "error" in present})
    return pd.DataFrame(rows, columns=cols)


def _overview_figure(fig, ops: pd.DataFrame, coll: pd.DataFrame, ranks: list[int], bins: int, x0: float, x1: float):
    """Draw the binned overview: one heatmap image, lanes as rows (ops above, collectives below)."""
    import numpy as np
    import plotly.graph_objects as go

    coll = coll.assign(category=coll["kind"]) if len(coll) else coll.assign(category=[])
    ov = pd.concat([timeline_overview(ops, "ops", bins, x0, x1), timeline_overview(coll, "collectives", bins, x0, x1)])
    order = list(PATH_COLORS) + ["error"]
    op_cats = [c for c in order if c in set(ops["category"])] + sorted(set(ops["category"]) - set(order))
    coll_cats = sorted(set(coll["category"]))
    cats = op_cats + coll_cats
    colors = {c: (ERROR_COLOR if c == "error" else path_color(c)) for c in op_cats}
    colors.update({c: COLLECTIVE_COLORS[i % len(COLLECTIVE_COLORS)] for i, c in enumerate(coll_cats)})
    lanes = []  # (y center, rank, lane)
    for r in ranks:
        lanes.append((r + OP_LANE0, r, "ops"))
        if len(coll):
            lanes.append((r + COLL_LANE, r, "collectives"))
    edges, zrows, trows, lane_row = [], [], [], {}
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
    for k, c in enumerate(cats):  # legend entries
        group = "ops by dispatch path" if c in op_cats else "collectives"
        first = c == (op_cats[0] if c in op_cats else coll_cats[0])
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=esc(c.replace("_", " ")),
                                 marker={"symbol": "square", "size": 12, "color": colors[c]},
                                 legendgroup=("op:" if c in op_cats else "coll:") + c,
                                 **({"legendgrouptitle_text": group} if first else {})))
    return ov


def plot_timeline(trace, *, aggregate: bool | None = None, time_range: tuple[float, float] | None = None,
                  overview: bool | None = None, height: int | None = None):
    """Plotly Figure: one row per rank (rank 0 on top), op spans coloured by dispatch path (errors in
    dark red), collective spans below them coloured by kind; hover shows shapes, bytes and time.

    ``time_range=(a, b)``: only that window (ms since the first event). ``aggregate``: merge nested ops
    into their top-level op (default: above ``AGGREGATE_ABOVE`` spans). ``overview``: bin the spans into
    ``OVERVIEW_BINS`` time bins per rank lane, coloured by the worst dispatch path in each bin (default:
    above ``OVERVIEW_ABOVE`` spans to draw); zoom in with ``time_range`` to see single ops."""
    import plotly.graph_objects as go

    ops = _in_window(timeline_frame(trace, aggregate=aggregate), time_range)
    coll = _in_window(collective_spans(trace), time_range)
    ranks = list(trace.ranks)
    fig = go.Figure()
    if overview is None:
        overview = len(ops) + len(coll) > OVERVIEW_ABOVE
    n_ops = len(trace.get_ops())
    title = f"Timeline · {len(ranks)} ranks · {n_ops} op calls" + (f" · {len(coll)} collectives" if len(coll) else
                                                                   " · no collectives recorded")
    if overview and (len(ops) or len(coll)):
        lo = min([v for v in (ops["start_ms"].min() if len(ops) else None, coll["start_ms"].min() if len(coll) else None) if v is not None])
        hi = max([v for v in (ops["end_ms"].max() if len(ops) else None, coll["end_ms"].max() if len(coll) else None) if v is not None])
        if time_range is not None:
            lo, hi = time_range
        _overview_figure(fig, ops, coll, ranks, OVERVIEW_BINS, float(lo), float(hi))
        if time_range is None:
            fig.update_xaxes(range=[float(lo), float(hi)])
        title += (f" · overview: {len(ops) + len(coll)} spans in {OVERVIEW_BINS} time bins, the most frequent "
                  f"path per bin<br><sub>plot_timeline(time_range=(a, b)) draws a window op by op</sub>")
    else:
        order = list(PATH_COLORS) + ["error"]
        first = True
        for cat in order + sorted(set(ops["category"]) - set(order)):
            part = ops[ops["category"] == cat]
            if part.empty:
                continue
            color = ERROR_COLOR if cat == "error" else path_color(cat)
            _span_traces(fig, part, esc(cat.replace("_", " ")), color, 9, f"op:{cat}", "ops by dispatch path" if first else None)
            first = False
        errs = ops[ops["category"] == "error"]
        if len(errs):
            fig.add_trace(go.Scattergl(x=errs["start_ms"], y=errs["y"], mode="markers", name="error raised",
                                       marker={"symbol": "x", "size": 11, "color": ERROR_COLOR, "line": {"width": 1}},
                                       hovertext=errs["hover"], hoverinfo="text", legendgroup="ops"))
        for i, kind in enumerate(sorted(set(coll["kind"]))):
            part = coll[coll["kind"] == kind]
            _span_traces(fig, part, esc(kind), COLLECTIVE_COLORS[i % len(COLLECTIVE_COLORS)], 7, f"coll:{kind}",
                         "collectives" if i == 0 else None)
        if aggregate is not False and len(ops) and ops["depth"].max() == 0 and trace.get_ops()["depth"].max() > 0:
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
    if r_inc := [r for r in ranks if r in getattr(trace, "incomplete_ranks", [])]:
        fig.add_annotation(text=f"incomplete ranks (timed out or sent nothing): {r_inc}", xref="paper", yref="paper",
                           x=1, y=1.08, showarrow=False, font={"color": "#b00020"})
    return fig


def comm_by_op_frame(trace) -> pd.DataFrame:
    """Bytes and time per (op, collective kind), all ranks together: op, kind, calls, bytes, comm_ms.
    Empty when the Trace records no collectives."""
    cols = ["op", "kind", "calls", "bytes", "comm_ms"]
    coll = _frame(trace, "collectives")
    if coll is None:
        return pd.DataFrame(columns=cols)
    c = coll.copy()
    c["op"] = c["op"].fillna("(outside any op)") if "op" in c else "(unknown)"
    c["bytes"] = c["bytes_sent"].fillna(0) + c["bytes_recv"].fillna(0)
    dur = c["duration_ms"] if "duration_ms" in c else (c["t_done_ns"] - c["t_issue_ns"]) / 1e6
    c["comm_ms"] = pd.to_numeric(dur, errors="coerce")
    g = c.groupby(["op", "kind"], sort=False).agg(calls=("kind", "size"), bytes=("bytes", "sum"), comm_ms=("comm_ms", "sum"))
    return g.reset_index().sort_values(["bytes", "comm_ms"], ascending=False, kind="stable").reset_index(drop=True)[cols]


def _empty_figure(title: str, message: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 14}}, template="plotly_white", height=260,
                      xaxis={"visible": False}, yaxis={"visible": False})
    fig.add_annotation(text=message, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font={"size": 13, "color": "#555"})
    return fig


def plot_comm_by_op(trace):
    """Plotly Figure: bytes (left) and time (right) per op, stacked by collective kind."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    df = comm_by_op_frame(trace)
    if df.empty:
        return _empty_figure("Communication per op", "no collectives recorded in this trace<br>"
                             "(its ops did not communicate, or it was recorded without collective recording)")
    ops = list(dict.fromkeys(df.groupby("op", sort=False)["bytes"].sum().sort_values(ascending=False).index))
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=("bytes sent + received", "time in collectives (ms)"),
                        horizontal_spacing=0.04)
    for i, kind in enumerate(sorted(set(df["kind"]))):
        part = df[df["kind"] == kind].set_index("op").reindex(ops)
        color = COLLECTIVE_COLORS[i % len(COLLECTIVE_COLORS)]
        names = [esc(o) for o in ops]
        fig.add_trace(go.Bar(y=names, x=part["bytes"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, customdata=part["calls"].fillna(0),
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:,.0f} B in %{customdata} calls<extra></extra>"), 1, 1)
        fig.add_trace(go.Bar(y=names, x=part["comm_ms"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, showlegend=False,
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:.3f} ms<extra></extra>"), 1, 2)
    fig.update_layout(barmode="stack", template="plotly_white", height=max(260, 120 + 28 * len(ops)),
                      title={"text": "Communication per op (all ranks)", "x": 0.01, "font": {"size": 14}},
                      yaxis={"autorange": "reversed"}, legend={"title": {"text": "collective"}},
                      margin={"l": 10, "r": 20, "t": 70, "b": 40})
    return fig


_VOLUME_CANDIDATES = ("shard_bytes", "volume_bytes", "local_bytes", "in_bytes", "shard_elems", "volume", "numel")


def imbalance_frame(trace) -> pd.DataFrame:
    """Per (op, rank): shard volume beside time. From ``get_imbalance()`` when the Trace has it (long
    format: op, rank, a volume column, *_ms columns); else from the ops: forward depth-0 calls, volume =
    local elements of the first tensor argument, host_ms. Columns: op, rank, calls, volume, volume_unit,
    then the time columns (host_ms, and comm_ms / wait_ms when known)."""
    imb = _frame(trace, "imbalance")
    if imb is not None and {"op", "rank"} <= set(imb.columns):
        vol = next((c for c in _VOLUME_CANDIDATES if c in imb.columns), None)
        times = [c for c in imb.columns if c.endswith("_ms") and pd.api.types.is_numeric_dtype(imb[c])]
        if vol is not None and times:
            out = imb[["op", "rank", vol] + times].rename(columns={vol: "volume"}).copy()
            out["calls"] = imb["calls"] if "calls" in imb else 1
            out["volume_unit"] = "bytes" if "bytes" in vol else "elements"
            return out[["op", "rank", "calls", "volume", "volume_unit"] + times].reset_index(drop=True)
    ops = trace.get_ops()
    cols = ["op", "rank", "calls", "volume", "volume_unit", "host_ms"]
    if ops.empty:
        return pd.DataFrame(columns=cols)
    f = ops[(ops["phase"] == "forward") & (ops["depth"] == 0)].copy()
    f["volume"] = [math.prod(s[0]) if s else 0 for s in f["in_local_shapes"]]
    g = f.groupby(["op", "rank"], sort=False).agg(calls=("seq", "size"), volume=("volume", "sum"),
                                                   host_ms=("host_ms", "sum")).reset_index()
    g["volume_unit"] = "elements"
    return g[cols]


def plot_imbalance(trace, op: str | None = None):
    """Plotly Figure: per-rank shard volume (left) beside per-rank times side by side (right: host time
    includes the op's own collectives, so they are not stacked), for all ops together
    and, through the menu, for each op (the ops with the largest spread of time first)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    df = imbalance_frame(trace)
    if df.empty:
        return _empty_figure("Imbalance per rank", "no ops recorded")
    times = [c for c in df.columns if c.endswith("_ms")]
    unit = df["volume_unit"].iloc[0]
    ranks = sorted(df["rank"].unique())
    spread = df.groupby("op")[times[0]].agg(lambda s: s.max() - s.min()).sort_values(ascending=False)
    choices = ["(all ops)"] + list(spread.index[:12])
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"shard volume ({unit})", "time (ms)"), horizontal_spacing=0.1)
    time_colors = {"host_ms": "#4e79a7", "comm_ms": "#6a3d9a", "wait_ms": "#e15759"}
    n_per = 1 + len(times)
    for k, choice in enumerate(choices):
        part = df if choice == "(all ops)" else df[df["op"] == choice]
        per = part.groupby("rank")[["volume"] + times].sum().reindex(ranks).fillna(0)
        labels = [f"rank {r}" for r in ranks]
        vis = k == (choices.index(op) if op in choices else 0)
        fig.add_trace(go.Bar(x=labels, y=per["volume"], name="shard volume", marker_color="#9c755f", visible=vis,
                             legendgroup="vol",
                             hovertemplate="%{x}: %{y:,.0f} " + unit + "<extra></extra>"), 1, 1)
        for t in times:
            fig.add_trace(go.Bar(x=labels, y=per[t], name=t.replace("_ms", " ms"), visible=vis,
                                 marker_color=time_colors.get(t, "#76b7b2"), legendgroup=t,
                                 hovertemplate="%{x}: %{y:.3f} ms<extra></extra>"), 1, 2)
    buttons = []
    for k, choice in enumerate(choices):
        visible = [False] * (n_per * len(choices))
        visible[k * n_per:(k + 1) * n_per] = [True] * n_per
        buttons.append({"label": esc(choice), "method": "update", "args": [{"visible": visible},
                        {"title.text": f"Imbalance per rank · {esc(choice)}"}]})
    fig.update_layout(barmode="group", template="plotly_white", height=340,
                      title={"text": f"Imbalance per rank · {esc(op if op in choices else choices[0])}", "x": 0.01, "font": {"size": 14}},
                      updatemenus=[{"buttons": buttons, "active": choices.index(op) if op in choices else 0,
                                    "x": 1.0, "xanchor": "right", "y": 1.22, "yanchor": "top"}],
                      margin={"l": 60, "r": 20, "t": 90, "b": 40})
    return fig
