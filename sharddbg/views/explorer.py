"""The trace explorer: every op call of every rank, errors and fallbacks first, filters, and a detail
panel for the clicked op (the same call on every rank: inputs/outputs, placements, time; its
collectives; module, handler, user source line; traceback for errors).

``explorer_frame(trace)`` is the list the widget shows, ``op_detail(trace, rank, seq)`` what its detail
panel shows: both pure and tested on golden traces. ``TraceExplorer`` (anywidget) ships the rows to
the browser once; filtering and the detail panel then run there without the kernel (so the same front
end works inside the standalone HTML report). Strings are set as text in the browser, never as HTML.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import anywidget
import pandas as pd
import traitlets

from ..analysis.formatting import json_value
from ..analysis.ops import is_fallback
from ..analysis.timeline import time_origin_ns
from .common import PATH_COLORS, static

if TYPE_CHECKING:
    from ..trace import Trace

ROW_FIELDS = ["rank", "seq", "op", "path", "phase", "kind", "key", "depth", "parent_seq", "module", "user_frame",
              "handler", "autograd_node", "fwd_seq", "in_local_shapes", "in_global_shapes", "out_local_shape",
              "out_global_shape", "placements", "in_placements", "dtype", "in_bytes", "out_bytes", "host_ms",
              "device_ms", "t_start_ms", "exc_type", "error", "traceback", "unmasked", "not_implemented", "in_flight"]
COLL_FIELDS = ["rank", "seq", "kind", "phase", "op_seq", "outer_op_seq", "group_ranks", "mesh_dim", "bytes_sent",
               "bytes_recv", "duration_ms", "param"]
KIND_ORDER = {"error": 0, "fallback": 1, "op": 2}
# Repeated strings: shipped once in a string table, rows hold their index (a 100k-row trace shrinks ~3x).
TABLE_FIELDS = ("op", "path", "phase", "kind", "key", "module", "user_frame", "handler", "autograd_node",
                "placements", "dtype", "exc_type", "error", "traceback")
# Lists (shapes, placements per argument): their JSON text goes into the same table.
JSON_FIELDS = ("in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape", "in_placements")
DEFAULT_MAX_ROWS = 20_000


def explorer_frame(trace: Trace) -> pd.DataFrame:
    """The explorer's rows: one per op call per rank, ``kind`` = error / fallback / op, errors first,
    then fallbacks, then everything else in time order. ``key`` names the same call on every rank
    (phase, op, and its occurrence number on that rank)."""
    ops = trace.get_ops()
    if ops.empty:
        return pd.DataFrame(columns=ROW_FIELDS)
    ops = ops.sort_values(["rank", "seq"], kind="stable").copy()
    n = ops.groupby(["rank", "phase", "op"], sort=False).cumcount()
    ops["key"] = ops["phase"] + "|" + ops["op"] + "|" + n.astype(str)
    ops["kind"] = "op"
    ops.loc[is_fallback(ops), "kind"] = "fallback"
    ops.loc[ops["exc_type"].notna(), "kind"] = "error"
    # the timeline's origin: the trace's first event
    ops["t_start_ms"] = (ops["t_start_ns"] - time_origin_ns(ops, trace.get_collectives())).astype(float) / 1e6
    ops["kind_order"] = ops["kind"].map(KIND_ORDER)
    ops["call_start"] = ops.groupby("key")["t_start_ns"].transform("min")  # one call's rows together, rank order
    ops = ops.sort_values(["kind_order", "call_start", "key", "rank", "seq"], kind="stable")
    return ops[ROW_FIELDS].reset_index(drop=True)


def _collectives(trace: Trace) -> pd.DataFrame:
    return trace.get_collectives()[COLL_FIELDS]


def op_detail(trace: Trace, rank: int, seq: int) -> dict:
    """What the detail panel shows for op ``seq`` of ``rank``: ``row`` (that call), ``per_rank`` (the same
    call on every rank, a DataFrame in rank order), ``collectives`` (those it caused, every rank)."""
    rows = explorer_frame(trace)
    hit = rows[(rows["rank"] == rank) & (rows["seq"] == seq)]
    if hit.empty:
        raise KeyError(f"no op with seq {seq} on rank {rank} in this trace")
    row = hit.iloc[0]
    per_rank = rows[rows["key"] == row["key"]].sort_values("rank").reset_index(drop=True)
    coll = _collectives(trace)
    pairs = set(zip(per_rank["rank"], per_rank["seq"]))
    mine = coll[[(r, s) in pairs or (r, o) in pairs for r, s, o in zip(coll["rank"], coll["op_seq"], coll["outer_op_seq"])]] \
        if len(coll) else coll
    return {"row": row.to_dict(), "per_rank": per_rank, "collectives": mine.reset_index(drop=True)}


def explorer_data(trace: Trace, max_rows: int = DEFAULT_MAX_ROWS) -> dict:
    """Everything the explorer front end needs, JSON-able: rows (column-wise fields + row arrays),
    collectives, the filter choices, and how many rows were left out (``max_rows``: errors and fallbacks
    are always kept, the rest in time order)."""
    rows = explorer_frame(trace)
    total = len(rows)
    shown = rows.iloc[:max_rows]
    coll = _collectives(trace)
    strings: list[str] = []
    index: dict[str, int] = {}
    coded = set(ROW_FIELDS.index(f) for f in TABLE_FIELDS)
    as_json = set(ROW_FIELDS.index(f) for f in JSON_FIELDS)

    def code(v):
        if not isinstance(v, str):
            return None
        i = index.get(v)
        if i is None:
            i = index[v] = len(strings)
            strings.append(v)
        return i

    out_rows = []
    for r in shown.itertuples(index=False, name=None):
        out_rows.append([code(v) if i in coded else
                         code(json.dumps(json_value(v), separators=(",", ":"))) if i in as_json and v is not None else
                         json_value(v) for i, v in enumerate(r)])
    return {
        "fields": ROW_FIELDS, "coded": sorted(TABLE_FIELDS), "json_coded": sorted(JSON_FIELDS), "strings": strings, "rows": out_rows,
        "total": total, "left_out": total - len(shown),
        "coll_fields": COLL_FIELDS,
        "collectives": [[json_value(v) for v in r] for r in coll.itertuples(index=False, name=None)],
        "has_collectives": trace.collectives_recorded,
        "ranks": [int(r) for r in trace.ranks],
        "paths": sorted(set(rows["path"])), "phases": sorted(set(rows["phase"])),
        "path_colors": PATH_COLORS,
        "counts": {k: int((rows["kind"] == k).sum()) for k in ("error", "fallback", "op")},
        "incomplete_ranks": [int(r) for r in trace.incomplete_ranks],
        "dropped": int(trace.dropped),
    }


def decode_rows(data: dict) -> list[dict]:
    """``explorer_data``'s rows back as dicts (what the front end reconstructs)."""
    coded, as_json, s = set(data["coded"]), set(data["json_coded"]), data["strings"]

    def one(f, v):
        if v is None:
            return None
        return s[v] if f in coded else json.loads(s[v]) if f in as_json else v

    return [{f: one(f, v) for f, v in zip(data["fields"], r)} for r in data["rows"]]


class TraceExplorer(anywidget.AnyWidget):
    """The trace explorer widget. ``selected`` (synced): [rank, seq] of the op whose detail is open."""

    _esm = static("explorer.js")
    _css = static("style.css")
    data = traitlets.Dict().tag(sync=True)
    selected = traitlets.List([]).tag(sync=True)

    def __init__(self, trace: Trace, max_rows: int = DEFAULT_MAX_ROWS, **kwargs):
        super().__init__(data=explorer_data(trace, max_rows=max_rows), **kwargs)
        self.trace = trace

    def detail(self) -> dict | None:
        """``op_detail`` of the op selected in the browser (None before a click)."""
        return op_detail(self.trace, *self.selected) if self.selected else None
