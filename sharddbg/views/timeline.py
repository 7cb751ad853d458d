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


def plot_timeline(trace, *, aggregate: bool | None = None, height: int | None = None):
    """Plotly Figure: one row per rank (rank 0 on top), op spans coloured by dispatch path (errors in
    dark red), collective spans below them coloured by kind; hover shows shapes, bytes and time."""
    import plotly.graph_objects as go

    ops = timeline_frame(trace, aggregate=aggregate)
    coll = collective_spans(trace)
    ranks = list(trace.ranks)
    fig = go.Figure()
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
    n_ops = len(trace.get_ops())
    title = f"Timeline · {len(ranks)} ranks · {n_ops} op calls" + (f" · {len(coll)} collectives" if len(coll) else
                                                                   " · no collectives recorded")
    if len(ops) < n_ops:
        title += f" · nested ops merged ({len(ops)} spans drawn)"
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 14}},
        height=height or max(260, 110 + 80 * len(ranks)), template="plotly_white", hovermode="closest",
        margin={"l": 70, "r": 20, "t": 50, "b": 45}, legend={"orientation": "v", "groupclick": "toggleitem"},
        xaxis={"title": "time since the first event (ms)", "showgrid": True, "zeroline": False},
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
