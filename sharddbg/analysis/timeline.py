"""The data of the timeline: op and collective spans on one time axis, and their binned overview.

Pure functions over ``Trace.get_ops()`` / ``Trace.get_collectives()``; the figure (views/timeline.py)
adds only lanes, colours and hover text. Times are ms since ``time_origin_ns`` (the first event of
the trace, ops and collectives together), the same origin the Perfetto export uses.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..schema import FALLBACK_PATHS

OP_SPAN_COLUMNS = ["rank", "seq", "op", "path", "phase", "depth", "start_ms", "end_ms", "category"]
COLLECTIVE_SPAN_COLUMNS = ["rank", "seq", "kind", "op", "start_ms", "end_ms", "bytes_sent", "bytes_recv", "category"]
OVERVIEW_COLUMNS = ["rank", "lane", "bin", "bin_start_ms", "bin_end_ms", "category", "n_spans", "counts", "has_error"]

# The category of an op span that raised; other op spans are categorised by their dispatch path.
ERROR_CATEGORY = "error"
# In an overview bin the category is the one with most spans; ties go to the first of these (errors,
# then the DTensor fallbacks), then to the name.
TIE_ORDER = (ERROR_CATEGORY, *FALLBACK_PATHS)


def time_origin_ns(ops: pd.DataFrame, colls: pd.DataFrame) -> int:
    """The earliest start of an op or issue of a collective, on the reference clock; 0 for no events."""
    starts = [ops["t_start_ns"].min() if len(ops) else None, colls["t_issue_ns"].min() if len(colls) else None]
    starts = [int(s) for s in starts if s is not None and not pd.isna(s)]
    return min(starts) if starts else 0


def op_span_frame(ops: pd.DataFrame, t0_ns: int) -> pd.DataFrame:
    """One row per op of ``ops`` (rows of ``get_ops()``, in that order): start_ms / end_ms since
    ``t0_ns``; ``category``: the dispatch path, or ``ERROR_CATEGORY`` if the call raised. An op still
    running at snapshot time ends at the last recorded end among ``ops``."""
    if ops.empty:
        return pd.DataFrame(columns=OP_SPAN_COLUMNS)
    last = ops["t_end_ns"].max()
    last = int(last) if not pd.isna(last) else int(ops["t_start_ns"].max())
    end = ops["t_end_ns"].fillna(last).astype("int64")
    df = pd.DataFrame({
        "rank": ops["rank"].astype(int).values, "seq": ops["seq"].astype(int).values, "op": ops["op"].values,
        "path": ops["path"].values, "phase": ops["phase"].values, "depth": ops["depth"].astype(int).values,
        "start_ms": (ops["t_start_ns"].astype("int64").values - t0_ns) / 1e6,
        "end_ms": (end.values - t0_ns) / 1e6,
    })
    df["category"] = df["path"].where(~ops["exc_type"].notna().values, ERROR_CATEGORY)
    return df[OP_SPAN_COLUMNS]


def collective_span_frame(colls: pd.DataFrame, t0_ns: int) -> pd.DataFrame:
    """One row per collective of ``colls`` (rows of ``get_collectives()``): issue to the return of its
    wait (a collective not waited for ends where it started), ms since ``t0_ns``; ``category``: its kind."""
    if colls.empty:
        return pd.DataFrame(columns=COLLECTIVE_SPAN_COLUMNS)
    done = colls["t_done_ns"].fillna(colls["t_issue_ns"])
    df = pd.DataFrame({
        "rank": colls["rank"].astype(int).values, "seq": colls["seq"].astype(int).values,
        "kind": colls["kind"].astype(str).values, "op": colls["op"].values,
        "start_ms": (colls["t_issue_ns"].astype("int64").values - t0_ns) / 1e6,
        "end_ms": (done.astype("int64").values - t0_ns) / 1e6,
        "bytes_sent": colls["bytes_sent"].values, "bytes_recv": colls["bytes_recv"].values,
    })
    df["category"] = df["kind"]
    return df[COLLECTIVE_SPAN_COLUMNS]


def in_window(spans: pd.DataFrame, time_range: tuple[float, float] | None) -> pd.DataFrame:
    """The spans that overlap ``time_range`` (ms, inclusive); all of them for ``None``."""
    if time_range is None or spans.empty:
        return spans
    a, b = time_range
    return spans[(spans["end_ms"] >= a) & (spans["start_ms"] <= b)]


def timeline_overview(spans: pd.DataFrame, lane: str, bins: int, x0: float, x1: float) -> pd.DataFrame:
    """Binned view of spans (``op_span_frame`` or ``collective_span_frame`` rows): one row per (rank,
    bin) that some span overlaps: rank, lane, bin, bin_start_ms, bin_end_ms, category (the most
    frequent; ties by ``TIE_ORDER``), n_spans, counts {category: spans} and has_error (a span that
    raised overlaps the bin)."""
    if spans.empty:
        return pd.DataFrame(columns=OVERVIEW_COLUMNS)
    width = max(x1 - x0, 1e-9) / bins
    rows = []
    cats = sorted(set(spans["category"].unique()))
    # every span's category and first and last bin, for all ranks at once
    code = pd.Categorical(spans["category"], categories=cats).codes.astype(np.int64)
    first = np.clip(((spans["start_ms"].to_numpy(float) - x0) // width).astype(int), 0, bins - 1)
    last = np.clip(((spans["end_ms"].to_numpy(float) - x0) // width).astype(int), 0, bins - 1)
    span_rank = spans["rank"].to_numpy()
    for rank in sorted(pd.unique(span_rank)):
        mine = span_rank == rank
        counts = np.zeros((len(cats), bins + 1), dtype=np.int64)
        # +1 at a span's first bin, -1 after its last: the running sum counts the spans over each bin
        np.add.at(counts, (code[mine], first[mine]), 1)
        np.add.at(counts, (code[mine], last[mine] + 1), -1)
        counts = np.cumsum(counts, axis=1)[:, :bins]
        for b in np.nonzero(counts.sum(axis=0))[0]:
            present = {cats[k]: int(counts[k, b]) for k in range(len(cats)) if counts[k, b]}
            precedence = {c: (len(TIE_ORDER) - TIE_ORDER.index(c)) if c in TIE_ORDER else 0 for c in present}
            top = max(present, key=lambda c: (present[c], precedence[c], c))
            rows.append({"rank": int(rank), "lane": lane, "bin": int(b), "bin_start_ms": x0 + b * width,
                         "bin_end_ms": x0 + (b + 1) * width, "category": top,
                         "n_spans": sum(present.values()), "counts": present, "has_error": ERROR_CATEGORY in present})
    return pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)
