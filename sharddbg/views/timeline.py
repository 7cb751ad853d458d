"""The all-rank timeline: one band per rank, op spans by dispatch path, collective spans by kind.

The spans and the overview's bins are pure data (``sharddbg.analysis.timeline``); this module places
them in lanes, colours them and writes their hover text: ``timeline_frame`` (op spans),
``collective_spans`` and ``collective_links`` (the same collective on every rank) are exactly what the
figure draws. Every string taken from a trace is HTML-escaped before it reaches plotly (hover text,
span labels and legend names are rendered as HTML by plotly.js).

A rank's band holds, top to bottom: the ``autograd`` lane (spans of a whole backward pass, such as
``Tensor.backward``, which would otherwise cover the ops they contain), the op lanes (one per nesting
depth below that), and the ``collectives`` lane.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..analysis.comm import NO_OP, call_keys, collective_owners, matched_collectives
from ..analysis.ops import AUTOGRAD_ENTRY_OPS
from ..analysis.formatting import format_bytes, format_shape
from ..analysis.timeline import (ERROR_CATEGORY, collective_span_frame, in_window, op_span_frame,
                                 time_origin_ns, timeline_overview)
from .common import (ERROR_COLOR, FIGURE_ALERT, FIGURE_GRID, FIGURE_LINE, PATH_COLORS, collective_colors, esc,
                     figure_template, path_color)

if TYPE_CHECKING:
    from ..trace import Trace

# Lanes inside one rank's band (the y axis is reversed: rank 0 on top; rank r's band is r - 0.5 .. r + 0.5).
AUTOGRAD_LANE = -0.37
OP_LANE0 = -0.24  # ops at depth 0 (below any autograd span); deeper ops below, LANE_STEP apart
LANE_STEP = 0.12
MAX_LANES = 3
COLL_LANE = 0.26
BAR_HEIGHT = 0.11  # a span's thickness, in rank bands (17 px at BAND_PX: room for a 10 px label)
LANE_HALF = 0.06  # an overview row's half height
BAND_PX = 150  # default height of one rank's band
# Above this many op spans, nested ops are merged into their top-level op's lane.
AGGREGATE_ABOVE = 60_000
# Up to this many spans (ops + collectives) each span is a bar: it answers a hover anywhere on it and
# shows its op's name when wide enough. Above, WebGL lines (one hover label at each span's middle).
BARS_UP_TO = 10_000
# Above this many spans still to draw, the timeline is a binned overview (one image: its cost no longer
# grows with the events); plot_timeline(t, time_range=(a, b)) draws a window span by span.
OVERVIEW_ABOVE = 30_000
OVERVIEW_BINS = 1500
# The overview's cells (lanes x bins) are at most this many: with many ranks the bins get wider, so that the figure's
# payload stays a few MB (its hover text is per cell) whatever the trace's size.
OVERVIEW_CELLS = 16_000
OVERVIEW_LANES_FULL = 16  # up to this many lanes (5 ranks) the overview keeps its OVERVIEW_BINS bins
OVERVIEW_MIN_BINS = 200
# The overview's strip marking the bins where an op raised, a row of its image (a marker per bin would be restyled
# point by point at every zoom: hundreds of ms with thousands of them): its height and its distance above the op lane
ERROR_STRIP = 0.04
ERROR_STRIP_GAP = 0.01
ERROR_LANE = "error strip"
# A big trace's overview also shades the windows around its slowest spans (zoom into one to see each op), at most
# DETAIL_WINDOWS windows of at most DETAIL_WINDOW_SPANS spans each; where the page cannot draw a zoomed window from the
# spans the figure carries (zoom_events), the figure draws them span by span itself.
DETAIL_WINDOWS = 4
DETAIL_WINDOW_SPANS = 1_000
WINDOW_MARKS = "windows around the slowest spans"  # the name of the markers above the shaded windows
# A big trace's overview also carries every span it bins as compact columns (``zoom_events``): zoomed in to a window of
# at most ZOOM_DRAW_SPANS spans, the page draws them one by one (views/_static/timeline_zoom.js: on a canvas over the
# plot, a hover of its own), without a kernel and without a second plotly redraw.
# Traces of more spans than ZOOM_EVENTS_MAX carry none (the report's size stays bounded: 13 bytes a span, deflated).
ZOOM_DRAW_SPANS = 20_000
ZOOM_EVENTS_MAX = 1_500_000
X_PAD = 0.02  # room left and right of the first and last span, as a share of the time drawn
# The figure's margins hold its legend (right) and its x axis (bottom) from the first draw: where they are too small,
# plotly widens them once it has drawn and then draws the whole figure a second time (the overview's image included).
# A legend entry in plotly's 12 px font takes its text (6.2 px a character in chromium's, lowercase words) plus 46 px
# (its symbol and gaps); plotly sets the legend 2 % of the plot's width right of it (LEGEND_GAP_PX: up to a 1,600 px
# plot). Wider text or a wider plot still fit, plotly widening the margin as before.
LEGEND_CHAR_PX = 6.5
LEGEND_ENTRY_PX = 50
LEGEND_GAP_PX = 32
MARGIN_RIGHT_MIN = 20
MARGIN_BOTTOM = 60  # the x axis's tick labels and title (plotly asks 53 px for them)
# The modebar buttons that would send the figure to a cloud service.
CLOUD_BUTTONS = ["sendDataToCloud", "editInChartStudio"]

TIMELINE_COLUMNS = ["rank", "seq", "op", "path", "phase", "depth", "lane", "start_ms", "end_ms", "y", "category",
                    "label", "hover"]
COLLECTIVE_SPAN_COLUMNS = ["rank", "seq", "kind", "op", "start_ms", "end_ms", "bytes_sent", "bytes_recv", "category",
                           "group", "group_seq", "collective", "y", "hover"]
LINK_COLUMNS = ["collective", "group", "group_seq", "kind", "ranks", "start_ms", "first_rank", "last_rank", "lag_ms"]


def _time_origin(trace: Trace) -> int:
    return time_origin_ns(trace.get_ops(), trace.get_collectives())


def is_autograd_wide(op: str) -> bool:
    """A span that covers a whole backward pass (a call that enters the autograd engine: ``Tensor.backward``,
    ``torch.autograd.grad``, ...; ``analysis.ops.AUTOGRAD_ENTRY_OPS``). It is drawn in the autograd lane,
    and the ops inside it count their depth from it (a backward op nested in ``Tensor.backward`` sits in
    the first op lane, like a forward op)."""
    return op in AUTOGRAD_ENTRY_OPS


def _lane_depths(ops: pd.DataFrame) -> np.ndarray:
    """Each op's nesting depth counted from its innermost autograd-wide ancestor (or from the top): its ancestors
    walked a level at a time for all ops together."""
    n = len(ops)
    out = np.zeros(n, dtype=int)
    if not n:
        return out
    key = call_keys(ops["rank"], ops["seq"])
    parent = call_keys(ops["rank"], ops["parent_seq"])
    wide_keys = key[ops["op"].isin(AUTOGRAD_ENTRY_OPS).to_numpy(dtype=bool)]
    index = pd.Index(key)
    if not index.is_unique:  # a seq recorded twice on a rank: the last record's parent, as a dict would keep
        last = ~pd.Series(key).duplicated(keep="last").to_numpy()
        index, parent_of = pd.Index(key[last]), parent[last]
    else:
        parent_of = parent
    cur = parent  # each op's next ancestor (-1: none)
    live = cur >= 0
    for _ in range(n):  # at most the deepest nesting; each pass climbs a level
        if not live.any():
            break
        live &= ~np.isin(cur, wide_keys)  # the innermost autograd-wide ancestor ends the count
        out += live
        pos = index.get_indexer(np.where(live, cur, -1))
        cur = np.where(live & (pos >= 0), parent_of[np.maximum(pos, 0)], -1)
        live &= cur >= 0
    return out


def _label(op: str) -> str:
    """The name drawn inside a span: the op's last dotted part (``torch.nn.functional.relu`` -> ``relu``)."""
    return op.rsplit(".", 1)[-1]


def timeline_frame(trace: Trace, aggregate: bool | None = None) -> pd.DataFrame:
    """One row per op span: rank, seq, op, path, phase, depth (its nesting depth in the trace), lane
    (``autograd`` or ``ops``), start_ms, end_ms (from the trace's first event), y (its lane in the rank's
    band), category (path, or "error"), label (drawn inside the span), hover (HTML-escaped). In-flight ops
    end at the last recorded time. ``aggregate``: only the spans of the first op lane and the autograd
    lane (nested ops merged into their parent's span) — on by default above ``AGGREGATE_ABOVE`` spans."""
    df, ops = _op_spans(trace, aggregate)
    return df.assign(hover=_op_hover(ops))[TIMELINE_COLUMNS]


# The columns of get_ops() that an op span (op_span_frame, _lane_depths) and its hover text (_op_hover) read.
OP_SOURCE_COLUMNS = ["rank", "seq", "parent_seq", "depth", "op", "path", "phase", "autograd_node", "module",
                     "in_local_shapes", "out_local_shape", "in_bytes", "out_bytes", "t_start_ns", "t_end_ns", "host_ms",
                     "error", "exc_type"]


def _op_spans(trace: Trace, aggregate: bool | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``timeline_frame``'s rows without their hover text (its index: 0, 1, ...), and the rows of
    ``get_ops()`` they come from, in the same order, with the columns ``OP_SOURCE_COLUMNS``: a big trace's hover
    text is written only for what is drawn."""
    # the columns the spans and their hover text read (a mask below moves each column it is given: a big trace's cost)
    ops = trace.get_ops()
    if ops.empty:
        return pd.DataFrame(columns=[c for c in TIMELINE_COLUMNS if c != "hover"]), ops
    ops = ops[OP_SOURCE_COLUMNS]
    wide = ops["op"].isin(AUTOGRAD_ENTRY_OPS).to_numpy(dtype=bool)  # is_autograd_wide, on the column
    lane_depth = _lane_depths(ops)
    if aggregate is None:
        aggregate = len(ops) > AGGREGATE_ABOVE
    if aggregate:
        keep = wide | (lane_depth == 0)
        ops, wide, lane_depth = ops[keep], wide[keep], lane_depth[keep]
    df = op_span_frame(ops, _time_origin(trace)).reset_index(drop=True)
    df["lane"] = np.where(wide, "autograd", "ops")
    df["y"] = df["rank"] + np.where(wide, AUTOGRAD_LANE, OP_LANE0 + LANE_STEP * np.minimum(lane_depth, MAX_LANES - 1))
    names, distinct = pd.factorize(df["op"], use_na_sentinel=False)  # each label made once per distinct name
    df["label"] = np.array([esc(_label(o)) for o in distinct], dtype=object)[names].tolist()
    return df, ops


def _op_hover(ops: pd.DataFrame) -> list[str]:
    """The hover text of each op of ``ops`` (rows of ``get_ops()``), HTML-escaped."""
    hover = []
    for o in ops.itertuples(index=False):
        hover.append(
            f"<b>{esc(o.op)}</b> · rank {int(o.rank)} · seq {int(o.seq)}<br>"
            f"{esc(o.phase)} · {esc(o.path)}" + (f" · node {esc(o.autograd_node)}" if isinstance(o.autograd_node, str) else "")
            + f"<br>in {esc(', '.join(format_shape(s) for s in (o.in_local_shapes or [])))} → out "
              f"{esc(format_shape(o.out_local_shape))} (local)"
            f"<br>bytes in {format_bytes(o.in_bytes)} · out {format_bytes(o.out_bytes)} · host "
            + ("still running" if pd.isna(o.host_ms) else f"{o.host_ms:.3f} ms")
            + (f"<br>module {esc(o.module)}" if isinstance(o.module, str) else "")
            + (f"<br>error: {esc(o.error)}" if isinstance(o.error, str) else ""))
    return hover


def _group_text(ranks, mesh_dim) -> str:
    where = f"ranks {list(ranks)}" if ranks else "its group"
    return f"{mesh_dim} {where}" if isinstance(mesh_dim, str) else where


def collective_links(trace: Trace) -> pd.DataFrame:
    """The same collective on every rank of its group (``analysis.comm.matched_collectives``): one row per
    collective issued on more than one rank: collective (its id), group (text), group_seq, kind, ranks,
    start_ms (each rank's issue, ms since the first event, in the order of ``ranks``), first_rank / last_rank
    (the first and the last to issue it), lag_ms (how long after the first the last issued it)."""
    return _links(trace, None)


def _links(trace: Trace, only: set | None) -> pd.DataFrame:
    """``collective_links``, of the collectives whose id is in ``only`` (all for None)."""
    colls = trace.get_collectives()
    if colls.empty:
        return pd.DataFrame(columns=LINK_COLUMNS)
    t0 = _time_origin(trace)
    rows = []
    ids = matched_collectives(colls)
    if only is not None:
        keep = ids.isin(only).to_numpy()
        colls, ids = colls[keep], ids[keep]
    for collective, part in colls.groupby(ids, sort=False):
        if part["rank"].nunique() < 2:
            continue
        part = part.sort_values("rank")
        starts = ((part["t_issue_ns"].astype("int64") - t0) / 1e6).tolist()
        ranks = [int(r) for r in part["rank"]]
        first, last = int(np.argmin(starts)), int(np.argmax(starts))
        c0 = part.iloc[0]
        rows.append({"collective": int(collective), "group": _group_text(c0["group_ranks"], c0["mesh_dim"]),
                     "group_seq": int(c0["group_seq"]),
                     "kind": str(c0["kind"]), "ranks": ranks, "start_ms": starts, "first_rank": ranks[first],
                     "last_rank": ranks[last], "lag_ms": starts[last] - starts[first]})
    return pd.DataFrame(rows, columns=LINK_COLUMNS)


def collective_spans(trace: Trace) -> pd.DataFrame:
    """One row per collective: rank, seq, kind, op, start_ms, end_ms, bytes, category (its kind), group
    (text), group_seq, y (lane), hover (HTML-escaped; it names the collective across ranks: which rank
    issued it last, how long after the first). Empty, with these columns, when the trace has none."""
    df, colls = _coll_spans(trace)
    if df.empty:
        return pd.DataFrame(columns=COLLECTIVE_SPAN_COLUMNS)
    return df.assign(hover=_coll_hover(trace, df, colls))[COLLECTIVE_SPAN_COLUMNS]


def _coll_spans(trace: Trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``collective_spans``'s rows without their hover text (its index: 0, 1, ...), and the rows of
    ``get_collectives()`` they come from, in the same order."""
    colls = trace.get_collectives()
    df = collective_span_frame(colls, _time_origin(trace))
    if df.empty:
        return pd.DataFrame(columns=[c for c in COLLECTIVE_SPAN_COLUMNS if c != "hover"]), colls
    df = df.reset_index(drop=True)
    # once per distinct group (its ranks' list object and mesh dim): a big trace has a handful; each row's group found
    # on whole columns (its list object by its id, its mesh dim by its code), the text made from the group's first row
    lists = colls["group_ranks"].to_numpy(dtype=object)
    meshes = colls["mesh_dim"].to_numpy(dtype=object)
    list_codes = pd.factorize(np.fromiter(map(id, lists), dtype=np.int64, count=len(lists)))[0]
    mesh_codes = pd.factorize(colls["mesh_dim"])[0] + 1  # 0: missing
    group = pd.factorize(list_codes * (int(mesh_codes.max()) + 1) + mesh_codes)[0]
    first = np.unique(group, return_index=True)[1]
    texts = np.array([_group_text(lists[i] if isinstance(lists[i], list) else None, meshes[i]) for i in first], dtype=object)
    df["group"] = texts[group].tolist()
    df["group_seq"] = colls["group_seq"].astype(int).values
    df["collective"] = matched_collectives(colls).astype(int).values
    df["y"] = df["rank"] + COLL_LANE
    return df, colls


def _coll_hover(trace: Trace, df: pd.DataFrame, colls: pd.DataFrame) -> list[str]:
    """The hover text of the collectives ``df`` (rows of ``_coll_spans``; ``colls``: their rows of
    ``get_collectives()``, in the same order), HTML-escaped."""
    if df.empty:
        return []
    across = {}
    for link in _links(trace, set(df["collective"])).itertuples(index=False):
        across[link.collective] = (
            f"<br>{esc(link.group)} #{link.group_seq}: rank {link.last_rank} issued it last, "
            f"{link.lag_ms:.3f} ms after rank {link.first_rank}")
    # the user's call it belongs to, as every per-op view counts it (analysis.comm.collective_owners), where it is
    # not the op that issued it
    owners = collective_owners(colls, trace.get_ops())
    within = [f" (in {esc(o)})" if o != i else "" for o, i in zip(owners["owner"], owners["issued_in"])]
    return [
        f"<b>{esc(c.kind)}</b> · rank {int(c.rank)}<br>from op {esc(c.op if isinstance(c.op, str) else NO_OP)}{inside}<br>"
        f"sent {format_bytes(c.bytes_sent)} · received {format_bytes(c.bytes_recv)}<br>{c.end_ms - c.start_ms:.3f} ms"
        + across.get(c.collective, f"<br>{esc(c.group)} #{c.group_seq}")
        for c, inside in zip(df.itertuples(index=False), within)]


def _text_color(color: str) -> str:
    """Dark text on light span colours, white on dark ones."""
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "#ffffff"


def _bar_trace(df: pd.DataFrame, name: str, color: str, group: str, group_title: str | None, min_width: float,
               labels: bool):
    """One bar per span: the whole span answers a hover; its name is drawn inside where it fits."""
    import plotly.graph_objects as go

    extra = {"legendgrouptitle_text": group_title} if group_title else {}
    width = np.maximum(df["end_ms"].to_numpy(float) - df["start_ms"].to_numpy(float), min_width)
    text = {"text": df["label"].tolist(), "textposition": "inside", "insidetextanchor": "middle",
            "textfont": {"size": 10, "color": _text_color(color)}, "texttemplate": "%{text}"} if labels else \
        {"textposition": "none"}
    return go.Bar(base=df["start_ms"].to_numpy(float), x=width, y=df["y"].to_numpy(float), orientation="h",
                  width=BAR_HEIGHT, name=name, legendgroup=group, marker={"color": color, "line": {"width": 0}},
                  hovertext=df["hover"].tolist(), hoverinfo="text", hoverlabel={"bgcolor": color},
                  cliponaxis=True, **text, **extra)


def _segments(df: pd.DataFrame):
    """x, y arrays (numpy, NaN between segments: plotly ships them as compact typed arrays) drawing every
    row as a horizontal segment, and the segments' midpoints (where their hover labels live)."""
    n = len(df)
    x = np.full(3 * n, np.nan)
    y = np.full(3 * n, np.nan)
    x[0::3], x[1::3] = df["start_ms"].to_numpy(float), df["end_ms"].to_numpy(float)
    y[0::3] = y[1::3] = df["y"].to_numpy(float)
    mid = (df["start_ms"].to_numpy(float) + df["end_ms"].to_numpy(float)) / 2
    return x, y, mid


def _line_traces(fig, df: pd.DataFrame, name: str, color: str, width: int, group: str, group_title: str | None) -> None:
    """Many spans: one WebGL line trace (no hover) + one of invisible midpoint markers carrying the hover
    text once per span; they share a legend entry."""
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
    present = set(ops["category"].unique())
    return [c for c in order if c in present] + sorted(present - set(order))


def _op_color(category: str) -> str:
    return ERROR_COLOR if category == ERROR_CATEGORY else path_color(category)


def _lanes(ranks: list[int], ops: pd.DataFrame, coll: pd.DataFrame) -> list[tuple[float, int, str]]:
    """(y, rank, lane) of every lane drawn, top to bottom."""
    out = []
    autograd = len(ops) and (ops["lane"] == "autograd").any()
    for r in ranks:
        if autograd:
            out.append((r + AUTOGRAD_LANE, r, "autograd"))
        out.append((r + OP_LANE0, r, "ops"))
        if len(coll):
            out.append((r + COLL_LANE, r, "collectives"))
    return sorted(out)


def legend_margin(fig) -> int:
    """The right margin (px) that holds ``fig``'s legend: its longest entry or group title (plotly's legend
    entries: the traces shown in the legend, a heatmap never), at ``LEGEND_CHAR_PX`` a character, plus
    ``LEGEND_ENTRY_PX`` and the legend's distance from the plot, ``LEGEND_GAP_PX``; ``MARGIN_RIGHT_MIN`` without a
    legend.

    Parameters
    ----------
    fig : plotly.graph_objects.Figure
        The figure, its traces added.

    Returns
    -------
    int
        The margin in pixels.

    Examples
    --------
    >>> import plotly.graph_objects as go
    >>> legend_margin(go.Figure([go.Scatter(x=[1], y=[1], name="all reduce"), go.Heatmap(z=[[1]], name="x" * 80)]))
    147
    """
    import html
    import re

    texts = []
    for t in fig.data:
        if t.type == "heatmap" or t.showlegend is False:
            continue
        texts.append(t.name or "")
        if t.legendgrouptitle is not None and t.legendgrouptitle.text:
            texts.append(t.legendgrouptitle.text)
    # what plotly shows: the text without its HTML tags and entities
    longest = max((len(html.unescape(re.sub(r"<[^>]*>", "", x))) for x in texts), default=None)
    if longest is None:
        return MARGIN_RIGHT_MIN
    return max(MARGIN_RIGHT_MIN, int(np.ceil(LEGEND_ENTRY_PX + LEGEND_GAP_PX + LEGEND_CHAR_PX * longest)))


def overview_bins(n_lanes: int) -> int:
    """How many time bins the overview has for ``n_lanes`` lanes: ``OVERVIEW_BINS`` up to
    ``OVERVIEW_LANES_FULL`` lanes; above, at most ``OVERVIEW_CELLS`` cells (never fewer than ``OVERVIEW_MIN_BINS``
    bins).

    Parameters
    ----------
    n_lanes : int
        The lanes drawn (ranks x autograd / ops / collectives).

    Returns
    -------
    int
        The number of bins.

    Examples
    --------
    >>> overview_bins(12), overview_bins(48)
    (1500, 333)
    """
    if n_lanes <= OVERVIEW_LANES_FULL:
        return OVERVIEW_BINS
    return int(min(OVERVIEW_BINS, max(OVERVIEW_MIN_BINS, OVERVIEW_CELLS // n_lanes)))


def busy_ms(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The time the spans ``[starts, ends]`` cover in each bin between ``edges`` (ms), summed over the spans
    (spans that overlap each other count twice): the overview's busy time and comm time per bin.

    Parameters
    ----------
    starts, ends : numpy.ndarray
        The spans' start and end (ms).
    edges : numpy.ndarray
        The bins' edges (ms, increasing; ``len(edges) - 1`` bins).

    Returns
    -------
    numpy.ndarray
        ``len(edges) - 1`` sums in ms.

    Examples
    --------
    >>> busy_ms(np.array([0.5]), np.array([2.5]), np.array([0.0, 1.0, 2.0, 3.0])).tolist()
    [0.5, 1.0, 0.5]
    """
    # covered(x) = sum over spans of clip(x - start, 0, end - start), from sorted starts and ends and their prefix sums
    s, e = np.sort(starts.astype(float)), np.sort(ends.astype(float))
    cs, ce = np.concatenate([[0.0], np.cumsum(s)]), np.concatenate([[0.0], np.cumsum(e)])
    ks, ke = np.searchsorted(s, edges, side="right"), np.searchsorted(e, edges, side="right")
    covered = edges * ks - cs[ks] - edges * ke + ce[ke]
    return np.diff(covered)


def _busy_by_bin(spans: pd.DataFrame, lane: str, bins: int, x0: float, x1: float) -> dict:
    """(rank, lane, bin) -> busy ms: a lane's top spans (ops at depth 0: nested ones lie inside them) per bin."""
    if spans.empty:
        return {}
    if lane == "ops":  # the first op lane's spans (the top ops; a backward op inside Tensor.backward among them)
        spans = spans[np.isclose(spans["y"].to_numpy(float) - spans["rank"].to_numpy(float), OP_LANE0)]
    edges = x0 + (max(x1 - x0, 1e-9) / bins) * np.arange(bins + 1)
    out = {}
    for r, part in spans.groupby("rank"):
        busy = busy_ms(part["start_ms"].to_numpy(float), part["end_ms"].to_numpy(float), edges)
        for b in np.flatnonzero(busy > 0):
            out[(int(r), lane, int(b))] = float(busy[b])
    return out


def _overview_figure(fig, ops: pd.DataFrame, coll: pd.DataFrame, ranks: list[int], bins: int, x0: float, x1: float):
    """Draw the binned overview: one heatmap image, lanes as rows (autograd, ops, collectives; a strip marking the bins
    where an op raised); a cell's hover says its spans by category and how much of the bin they cover (busy; for
    collectives: comm time)."""
    import plotly.graph_objects as go

    # each lane's spans taken once, with the columns the bins read
    binned = ops[["rank", "start_ms", "end_ms", "category", "y"]]
    lane = ops["lane"].to_numpy(dtype=object)
    autograd_spans, op_spans = binned[lane == "autograd"], binned[lane == "ops"]
    ov = pd.concat([timeline_overview(autograd_spans, "autograd", bins, x0, x1),
                    timeline_overview(op_spans, "ops", bins, x0, x1),
                    timeline_overview(coll, "collectives", bins, x0, x1)])
    busy = {**_busy_by_bin(autograd_spans, "autograd", bins, x0, x1),
            **_busy_by_bin(op_spans, "ops", bins, x0, x1),
            **_busy_by_bin(coll, "collectives", bins, x0, x1)}
    op_cats = _op_categories(ops)
    coll_cats = sorted(set(coll["category"].unique()))
    cats = op_cats + coll_cats
    colors = {c: _op_color(c) for c in op_cats}
    colors.update(collective_colors(coll_cats))
    errs = ov[ov["has_error"].astype(bool)] if len(ov) else ov
    # the rows, top to bottom: each lane's; where an op raised, a thin strip just above each rank's op lane (the
    # autograd lane's row ends above it)
    rows = [(y - LANE_HALF, y + LANE_HALF, r, lane) for y, r, lane in _lanes(ranks, ops, coll)]
    if len(errs):
        rows += [(r + OP_LANE0 - LANE_HALF - ERROR_STRIP_GAP - ERROR_STRIP, r + OP_LANE0 - LANE_HALF - ERROR_STRIP_GAP,
                  r, ERROR_LANE) for r in ranks]
        rows.sort()
        rows = [(top, min(bottom, nxt[0]) if nxt else bottom, r, lane)
                for (top, bottom, r, lane), nxt in zip(rows, rows[1:] + [None])]
    edges, zrows, lane_row = [], [], {}
    for top, bottom, r, lane in rows:
        if edges and edges[-1] < top:  # an empty row in the gap between two lanes
            zrows.append(None)
        if not edges or edges[-1] < top:
            edges.append(top)
        lane_row[(r, lane)] = len(zrows)
        zrows.append(None)
        edges.append(bottom)
    z = np.full((len(zrows), bins), np.nan)
    text = np.full((len(zrows), bins), "", dtype=object)
    width = (x1 - x0) / bins
    for o in ov.itertuples(index=False):
        i = lane_row[(o.rank, o.lane)]
        z[i, o.bin] = cats.index(o.category)
        what = ", ".join(f"{esc(c.replace('_', ' '))} {n}" for c, n in sorted(o.counts.items(), key=lambda kv: -kv[1]))
        b_ms = busy.get((int(o.rank), o.lane, int(o.bin)), 0.0)
        share = f"{'comm' if o.lane == 'collectives' else 'busy'} {b_ms:.3f} ms ({100 * b_ms / width:.0f} %)"
        text[i, o.bin] = (f"rank {o.rank} · {o.lane}<br>{o.bin_start_ms:.3f}–{o.bin_end_ms:.3f} ms<br>"
                          f"{o.n_spans} span{'s' if o.n_spans != 1 else ''}: {what}<br>{share}")
    for r, b, a, e in zip(errs["rank"], errs["bin"], errs["bin_start_ms"], errs["bin_end_ms"]):
        i = lane_row[(int(r), ERROR_LANE)]
        z[i, int(b)] = cats.index(ERROR_CATEGORY)
        text[i, int(b)] = f"rank {int(r)}: an op raised in {a:.3f}–{e:.3f} ms"
    n = max(len(cats), 1)
    scale = []
    for k, c in enumerate(cats or ["none"]):
        col = colors.get(c, "#ccc")
        scale += [[k / n, col], [(k + 1) / n, col]]
    fig.add_trace(go.Heatmap(x=[x0 + (b + 0.5) * width for b in range(bins)], y=edges, z=z, text=text,
                             hovertemplate="%{text}<extra></extra>", hoverongaps=False, showscale=False,
                             colorscale=scale, zmin=-0.5, zmax=n - 0.5, name="overview"))
    for c in cats:  # legend entries
        group = "ops by dispatch path" if c in op_cats else "collectives"
        first = c == (op_cats[0] if c in op_cats else coll_cats[0])
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=esc(c.replace("_", " ")),
                                 marker={"symbol": "square", "size": 12, "color": colors[c]},
                                 legendgroup=("op:" if c in op_cats else "coll:") + c,
                                 **({"legendgrouptitle_text": group} if first else {})))


def detail_windows(ops: pd.DataFrame, coll: pd.DataFrame, n_windows: int = DETAIL_WINDOWS,
                   max_spans: int = DETAIL_WINDOW_SPANS) -> list[tuple[float, float]]:
    """The windows a big trace's overview draws span by span: around its slowest spans (top ops, collectives;
    the autograd lane's whole backward passes left out), each from a quarter of the span's time before it to
    as much after, holding at most ``max_spans`` spans of ``ops`` and ``coll``, none overlapping another;
    at most ``n_windows``, in time order.

    Parameters
    ----------
    ops, coll : pandas.DataFrame
        ``timeline_frame`` and ``collective_spans`` rows.
    n_windows : int
        How many windows at most.
    max_spans : int
        How many spans a window holds at most.

    Returns
    -------
    list of (float, float)
        (start_ms, end_ms) of each window.

    Examples
    --------
    >>> windows = detail_windows(timeline_frame(t), collective_spans(t))
    >>> all(a < b for a, b in windows)
    True
    """
    starts = np.sort(np.concatenate([ops["start_ms"].to_numpy(float), coll["start_ms"].to_numpy(float)]))
    ends = np.sort(np.concatenate([ops["end_ms"].to_numpy(float), coll["end_ms"].to_numpy(float)]))
    top = ops[["start_ms", "end_ms"]][(ops["lane"] == "ops").to_numpy(dtype=bool)] if len(ops) else ops[["start_ms", "end_ms"]]
    cand = pd.concat([top, coll[["start_ms", "end_ms"]]])
    cand = cand.assign(d=cand["end_ms"] - cand["start_ms"]).sort_values("d", ascending=False, kind="stable")
    chosen: list[tuple[float, float]] = []
    for s0, e0, d in cand.head(50 * n_windows).itertuples(index=False, name=None):
        a, b = s0 - max(d, 1e-6) / 4, e0 + max(d, 1e-6) / 4
        if any(a <= y and x <= b for x, y in chosen):
            continue
        # spans overlapping [a, b]: all but those ending before a or starting after b
        n = len(starts) - np.searchsorted(ends, a, side="left") - (len(starts) - np.searchsorted(starts, b, side="right"))
        if n <= max_spans:
            chosen.append((float(a), float(b)))
            if len(chosen) == n_windows:
                break
    return sorted(chosen)


def _in_windows(df: pd.DataFrame, windows: list[tuple[float, float]]) -> pd.DataFrame:
    """The spans of ``df`` that overlap one of ``windows``."""
    keep = np.zeros(len(df), dtype=bool)
    for a, b in windows:
        keep |= (df["end_ms"].to_numpy(float) >= a) & (df["start_ms"].to_numpy(float) <= b)
    return df[keep]


def _detail_traces(ops: pd.DataFrame, coll: pd.DataFrame, windows: list[tuple[float, float]]) -> list:
    """The spans of ``windows`` drawn one by one over the overview (WebGL lines, hover at each span's middle);
    their legend entries are the overview's (one click hides a category everywhere)."""
    import plotly.graph_objects as go

    ops_in, coll_in = _in_windows(ops, windows), _in_windows(coll, windows)
    parts = [(ops_in[ops_in["category"] == c], _op_color(c), 9, "op:" + c) for c in _op_categories(ops_in)] if len(ops_in) else []
    parts += [(coll_in[coll_in["kind"] == k], col, 7, "coll:" + k) for k, col in collective_colors(coll_in["kind"]).items()] \
        if len(coll_in) else []
    traces = []
    for part, color, width, group in parts:
        x, y, mid = _segments(part)
        traces.append(go.Scattergl(x=x, y=y, mode="lines", line={"color": color, "width": width}, name="drawn op by op",
                                   legendgroup=group, showlegend=False, hoverinfo="skip", connectgaps=False))
        traces.append(go.Scattergl(x=mid, y=part["y"].to_numpy(float), mode="markers", name="drawn op by op",
                                   legendgroup=group, showlegend=False, marker={"color": color, "size": 9, "opacity": 0},
                                   hovertext=part["hover"].tolist(), hoverinfo="text", hoverlabel={"bgcolor": color}))
    return traces


def _window_marks(fig, ops: pd.DataFrame, coll: pd.DataFrame, windows: list[tuple[float, float]], hint: str) -> None:
    """Each window shaded, and edged by a dotted line that shows where a window is narrower than a pixel; a marker
    above the first rank says what it is (``hint``: how to see it op by op)."""
    import plotly.graph_objects as go

    for a, b in windows:
        fig.add_vrect(x0=a, x1=b, fillcolor=FIGURE_LINE, opacity=0.25, line={"color": FIGURE_LINE, "width": 1, "dash": "dot"},
                      layer="below")
    top = float(ops["rank"].min() if len(ops) else coll["rank"].min()) - 0.5
    fig.add_trace(go.Scatter(x=[(a + b) / 2 for a, b in windows], y=[top] * len(windows), mode="markers", cliponaxis=False,
                             marker={"symbol": "triangle-down", "size": 10, "color": FIGURE_LINE}, name=WINDOW_MARKS,
                             hovertext=[f"{a:.3f}–{b:.3f} ms: around one of the slowest spans; {hint}"
                                        for a, b in windows],
                             hoverinfo="text"))


def zoom_events(ops: pd.DataFrame, coll: pd.DataFrame, categories: list[str], colors: dict[str, str]) -> dict | None:
    """Every span of ``ops`` and ``coll`` as compact columns, for the page to draw any window one by one when
    zoomed in (``views/_static/timeline_zoom.js``): sorted by start; ``columns`` is URL-safe base64 (no ``/`` for the
    page's JSON to escape) of the zlib-deflated
    bytes of, in this order, ``start`` (uint32 ticks from the previous span's start), ``duration`` (uint32 ticks),
    ``row`` (uint16, into ``rows``: each span's y), ``category`` (uint8, into ``categories``) and ``name`` (uint16,
    into ``names``: the op's name, HTML-escaped, for collectives their kind and the op that issued them), all
    little-endian; a tick is ``tick_ms`` ms from ``origin_ms``.

    Parameters
    ----------
    ops, coll : pandas.DataFrame
        ``timeline_frame`` and ``collective_spans`` rows (hover text not needed).
    categories : list of str
        The categories drawn, in legend order (every span's category among them).
    colors : dict
        Category -> colour.

    Returns
    -------
    dict or None
        ``n``, ``origin_ms``, ``tick_ms``, ``rows``, ``categories``, ``colors``, ``collective`` (per category: a
        collective kind), ``groups`` (per category: its legend group), ``names``, ``columns``, ``draw_up_to``
        (``ZOOM_DRAW_SPANS``), ``bar_px`` (a span's thickness for ops and for collectives); None when there are no
        spans or more than ``ZOOM_EVENTS_MAX``.

    Examples
    --------
    >>> z = zoom_events(timeline_frame(t), collective_spans(t), ["aten_direct", "all_reduce"], {})
    >>> z is None or z["n"] == len(timeline_frame(t)) + len(collective_spans(t))
    True
    """
    import base64
    import zlib

    n = len(ops) + len(coll)
    if n == 0 or n > ZOOM_EVENTS_MAX:
        return None
    start = np.concatenate([ops["start_ms"].to_numpy(float), coll["start_ms"].to_numpy(float)])
    end = np.concatenate([ops["end_ms"].to_numpy(float), coll["end_ms"].to_numpy(float)])
    y = np.concatenate([ops["y"].to_numpy(float), coll["y"].to_numpy(float)])
    coll_names = coll["kind"].astype(str) + " · from " + coll["op"].fillna(NO_OP).astype(str) if len(coll) else \
        pd.Series([], dtype=object)
    coll_kinds = set(coll["category"].unique()) if len(coll) else set()
    order = np.argsort(start, kind="stable")
    # each span's category as its index into ``categories``: looked up once per distinct category
    cat_codes, cat_values = _factorized_in_order([ops["category"], coll["category"]], order)
    if (cat_codes < 0).any():
        raise ValueError("zoom_events: a span without a category")
    cat_index = {c: k for k, c in enumerate(categories)}
    cat_code = np.array([cat_index[c] for c in cat_values], dtype=np.int64)[cat_codes]
    name_codes, names = _factorized_in_order([ops["op"], coll_names], order)
    start, end, y = start[order], np.maximum(end[order], start[order]), y[order]
    origin = float(start[0])
    # 1 µs (what the hover shows: ms to 3 decimals) unless the trace is longer than 2**32 µs: fewer bits to deflate
    tick = max(float(end.max() - origin) / (2**32 - 2), 1e-3)
    ticks = np.round((start - origin) / tick).astype(np.int64)
    delta = np.diff(ticks, prepend=0).astype(np.uint32)
    duration = np.minimum(np.round((end - start) / tick), 2**32 - 1).astype(np.uint32)
    row_codes, rows = pd.factorize(np.round(y, 6))
    payload = b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in (
        delta, duration, row_codes.astype(np.uint16), cat_code.astype(np.uint8),
        name_codes.astype(np.uint16)))
    return {"n": int(n), "origin_ms": origin, "tick_ms": tick, "rows": [float(v) for v in rows],
            "categories": [esc(c.replace("_", " ")) for c in categories],
            "colors": [colors.get(c, "#888888") for c in categories],
            "collective": [c in coll_kinds for c in categories],
            # each category's legend group: a category hidden from the legend is not drawn either
            "groups": [("coll:" if c in coll_kinds else "op:") + c for c in categories],
            "names": [esc(v) for v in names], "columns": base64.urlsafe_b64encode(zlib.compress(payload, 6)).decode("ascii"),
            "draw_up_to": ZOOM_DRAW_SPANS, "bar_px": [9, 7]}


def _factorized_in_order(parts: list[pd.Series], order: np.ndarray) -> tuple[np.ndarray, list]:
    """What ``pd.factorize`` gives for the values of ``parts``, one part after the other, put in ``order``: each
    value's code, numbered by first appearance in that order (-1 for a missing value), and the distinct values. Each
    part is factorized on its own (a column of Arrow strings without a Python object per row), then the codes put in
    order and numbered again."""
    distinct: dict = {}
    codes = []
    for part in parts:
        part_codes, part_values = pd.factorize(part)
        remap = np.array([distinct.setdefault(v, len(distinct)) for v in part_values] + [-1], dtype=np.int64)
        codes.append(remap[part_codes])  # -1 (missing) takes the last entry: -1
    code = np.concatenate(codes)[order] if codes else np.array([], dtype=np.int64)
    out = np.full(len(code), -1, dtype=np.int64)
    present = code >= 0
    renumbered, kept = pd.factorize(code[present])
    out[present] = renumbered
    values = list(distinct)
    return out, [values[k] for k in kept]


def _link_trace(links: pd.DataFrame, coll: pd.DataFrame, gl: bool):
    """Dotted lines joining the same collective's spans on every rank (at each rank's issue time)."""
    import plotly.graph_objects as go

    drawn = set(coll["collective"])
    xs, ys = [], []
    for link in links.itertuples(index=False):
        if link.collective not in drawn:
            continue
        xs += list(link.start_ms) + [None]
        ys += [r + COLL_LANE for r in link.ranks] + [None]
    cls = go.Scattergl if gl else go.Scatter
    return cls(x=xs, y=ys, mode="lines", line={"color": FIGURE_LINE, "width": 1, "dash": "dot"},
               name="same collective on every rank", legendgroup="links", hoverinfo="skip", connectgaps=False)


def _span_figure(fig, ops: pd.DataFrame, coll: pd.DataFrame, links: pd.DataFrame, bars: bool, x_span: float) -> None:
    """Draw every span: per op category and per collective kind, bars (or line traces and their hover
    markers), the error markers and the links between ranks."""
    import plotly.graph_objects as go

    min_width = max(x_span, 1e-6) / 2000  # a span too short to see still gets a sliver to hover on
    for k, cat in enumerate(_op_categories(ops)):
        part, name, title = ops[ops["category"] == cat], esc(cat.replace("_", " ")), "ops by dispatch path" if k == 0 else None
        if bars:
            fig.add_trace(_bar_trace(part, name, _op_color(cat), f"op:{cat}", title, min_width, labels=True))
        else:
            _line_traces(fig, part, name, _op_color(cat), 9, f"op:{cat}", title)
    errs = ops[ops["category"] == ERROR_CATEGORY]
    if len(errs):
        cls = go.Scatter if bars else go.Scattergl
        fig.add_trace(cls(x=errs["start_ms"], y=errs["y"], mode="markers", name="error raised",
                          marker={"symbol": "x", "size": 11, "color": ERROR_COLOR, "line": {"width": 1}},
                          hovertext=errs["hover"], hoverinfo="text", legendgroup="op:error"))
    for k, (kind, color) in enumerate(collective_colors(coll["kind"]).items()):
        part, title = coll[coll["kind"] == kind], "collectives" if k == 0 else None
        if bars:
            fig.add_trace(_bar_trace(part.assign(label=""), esc(kind), color, f"coll:{kind}", title, min_width,
                                     labels=False))
        else:
            _line_traces(fig, part, esc(kind), color, 7, f"coll:{kind}", title)
    if len(links) and len(coll):
        fig.add_trace(_link_trace(links, coll, gl=not bars))


def plot_timeline(trace: Trace, *, aggregate: bool | None = None, time_range: tuple[float, float] | None = None,
                  overview: bool | None = None, height: int | None = None):
    """Plotly Figure: one band per rank (rank 0 on top): op spans coloured by dispatch path (errors in
    dark red, names inside the spans wide enough to hold them), spans of a whole backward pass in their
    own ``autograd`` lane above, collective spans coloured by kind in the ``collectives`` lane below,
    the same collective joined across ranks by a dotted line; hover anywhere on a span for its shapes,
    bytes and time.

    ``time_range=(a, b)``: only that window (ms since the first event). ``aggregate``: merge nested ops
    into their top-level op (default: above ``AGGREGATE_ABOVE`` spans). ``overview``: bin the spans into
    ``OVERVIEW_BINS`` time bins per rank lane, coloured by the most frequent category in each bin (default:
    above ``OVERVIEW_ABOVE`` spans to draw); zoom in with ``time_range`` to see single ops. Up to
    ``BARS_UP_TO`` spans each is a bar; above, a WebGL line whose hover label sits at its middle."""
    import plotly.graph_objects as go

    from .figure import DrawnWithoutZoom, view_figure

    all_ops = trace.get_ops()
    merged = aggregate if aggregate is not None else len(all_ops) > AGGREGATE_ABOVE
    # the spans first, their hover text only for those drawn one by one (a big trace's overview draws a few)
    frame, op_rows = _op_spans(trace, merged)
    coll_frame, coll_rows = _coll_spans(trace)
    ops = in_window(frame, time_range)
    coll = in_window(coll_frame, time_range)

    def hovered(o: pd.DataFrame, c: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
        return (o.assign(hover=_op_hover(op_rows.iloc[o.index.to_numpy()])),
                c.assign(hover=_coll_hover(trace, c, coll_rows.iloc[c.index.to_numpy()])))

    ranks = list(trace.ranks)
    fig = go.Figure()
    without_zoom = None  # what a copy of the figure without its sd_zoom draws instead: the windows op by op
    if overview is None:
        overview = len(ops) + len(coll) > OVERVIEW_ABOVE
    title = f"Timeline · {len(ranks)} ranks · {len(all_ops)} op calls" + (
        f" · {len(coll)} collectives" if len(coll) else " · no collectives recorded")
    drawn = [f for f in (ops, coll) if len(f)]
    lo, hi = (min(f["start_ms"].min() for f in drawn), max(f["end_ms"].max() for f in drawn)) if drawn else (0.0, 1.0)
    lo, hi = float(lo), float(hi)
    if overview and drawn:
        if time_range is not None:
            lo, hi = time_range
        bins = overview_bins(len(_lanes(ranks, ops, coll)))
        _overview_figure(fig, ops, coll, ranks, bins, float(lo), float(hi))
        windows = detail_windows(ops, coll, DETAIL_WINDOWS, DETAIL_WINDOW_SPANS) \
            if len(ops) + len(coll) > OVERVIEW_ABOVE else []
        op_cats, coll_cats = _op_categories(ops) if len(ops) else [], sorted(set(coll["category"].unique()))
        colors = {c: _op_color(c) for c in op_cats}
        colors.update(collective_colors(coll_cats))
        zoom = zoom_events(ops, coll, op_cats + coll_cats, colors)
        head = title + f" · overview: {len(ops) + len(coll)} spans in {bins} time bins, the most frequent path per bin"
        how = "plot_timeline(time_range=(a, b)) draws any window op by op</sub>"
        # drawn here: the windows op by op (WebGL), where the page cannot draw a zoomed window from the spans
        detail = _detail_traces(*hovered(_in_windows(ops, windows), _in_windows(coll, windows)), windows) \
            if windows else []
        predrawn = head + (f"; shaded: the {len(windows)} windows around the slowest spans, drawn op by op (zoom in)"
                           if windows else "") + "<br><sub>" + how
        if zoom is None:
            fig.add_traces(detail)
            title = predrawn
        else:
            # any window of at most ZOOM_DRAW_SPANS spans is drawn one by one once zoomed into: the windows around the
            # slowest spans are only marked (drawing them here would cost the first screen a second of WebGL)
            fig.update_layout(meta={"sd_zoom": zoom})
            without_zoom = DrawnWithoutZoom(detail, predrawn)
            title = head + (f"; shaded: the {len(windows)} windows around the slowest spans" if windows else "") + (
                "<br><sub>zoom in to a window of at most "
                f"{ZOOM_DRAW_SPANS:,} spans to see it op by op; " + how)
        if windows:
            _window_marks(fig, ops, coll, windows, "zoom in here" + (" to see it op by op" if zoom is not None else
                                                                        ": drawn op by op"))
    else:
        bars = len(ops) + len(coll) <= BARS_UP_TO
        ops, coll = hovered(ops, coll)
        _span_figure(fig, ops, coll, collective_links(trace), bars, hi - lo)
        if merged and len(frame) < len(all_ops):
            title += f" · nested ops merged ({len(ops)} spans drawn)"
    if time_range is not None:
        title += f" · window {time_range[0]:g}–{time_range[1]:g} ms"
        if without_zoom is not None:
            without_zoom.title += f" · window {time_range[0]:g}–{time_range[1]:g} ms"
        x_range = list(time_range)
    else:
        pad = max((hi - lo) * X_PAD, 1e-3)
        x_range = [lo - pad, hi + pad]
    lanes = _lanes(ranks, ops, coll)
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 14}},
        height=height or max(300, 110 + BAND_PX * len(ranks)), template=figure_template(), hovermode="closest",
        barmode="overlay", bargap=0, uniformtext={"minsize": 8, "mode": "hide"},
        margin={"l": 90, "r": legend_margin(fig), "t": 60, "b": MARGIN_BOTTOM},
        legend={"orientation": "v", "groupclick": "toggleitem"},
        modebar={"remove": CLOUD_BUTTONS},
        xaxis={"title": "time since the first event (ms)", "showgrid": True, "zeroline": False,
               "range": x_range, "autorange": False},
        yaxis={"tickmode": "array", "tickvals": [y for y, _, _ in lanes],
               "ticktext": [f"rank {r}" if lane == "ops" else lane for _, r, lane in lanes],
               "autorange": False, "range": [max(ranks, default=0) + 0.5, min(ranks, default=0) - 0.5],
               "showgrid": False, "zeroline": False},
    )
    for r in ranks[1:]:
        # the shape add_hline would add (a line across the x axis's domain), without its look for empty subplots
        fig.add_shape(type="line", x0=0, x1=1, xref="x domain", y0=r - 0.5, y1=r - 0.5, yref="y",
                      line={"color": FIGURE_GRID, "width": 1})
    if r_inc := [r for r in ranks if r in trace.incomplete_ranks]:
        fig.add_annotation(text=f"incomplete ranks (timed out or sent nothing): {r_inc}", xref="paper", yref="paper",
                           x=1, y=1.08, showarrow=False, font={"color": FIGURE_ALERT})
    return view_figure(fig, "timeline", without_zoom)
