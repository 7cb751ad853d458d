"""The trace explorer: every op call of every rank, errors and fallbacks first, filters, and a detail
panel for the clicked op (the same call on every rank: inputs/outputs, placements, time; its
collectives; module, handler, user source line; traceback for errors).

``explorer_frame(trace)`` is the list the widget shows, ``op_detail(trace, rank, seq)`` what its detail
panel shows: both pure and tested on golden traces. ``TraceExplorer`` (anywidget) ships the rows to
the browser once; filtering and the detail panel then run there without the kernel (so the same front
end works inside the standalone HTML report). Strings are set as text in the browser, never as HTML.
Displayed in a notebook, the explorer leaves one output bundle (``sharddbg.views.bundle``): the widget,
``explorer_html`` (a static rendering), ``explorer_text`` and the trace itself.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import anywidget
import pandas as pd
import traitlets

from ..analysis.formatting import format_shape, json_value
from ..analysis.ops import is_fallback
from ..analysis.timeline import time_origin_ns
from .bundle import output_bundle, view_payload
from .common import ERROR_COLOR, PATH_COLORS, errors_html, esc, fallbacks_html, path_color, static, static_view

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
STATIC_ROWS = 200  # op calls in the static rendering (errors and fallbacks first)
# The list's columns: (field, title, width in px or None). Short columns have fixed widths, the others share
# the rest of the box, so the list never grows wider than its box (a long cell ends in "…").
LIST_COLUMNS = [("kind", "", 100), ("rank", "rank", 54), ("seq", "seq", 58), ("op", "op", None), ("path", "path", None),
                ("phase", "phase", 82), ("module", "module", None), ("out_local_shape", "output (local)", None),
                ("host_ms", "host ms", 78), ("user_frame", "source", None)]


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
        "summary": op_summary(trace),
        "list_columns": [list(c) for c in LIST_COLUMNS],
    }


def explorer_summary(trace: Trace) -> dict:
    """What the explorer's header says, as data: ranks, op calls, errors, fallbacks, collectives."""
    ops = trace.get_ops()
    return {"ranks": [int(r) for r in trace.ranks], "op_calls": len(ops),
            "errors": int(ops["exc_type"].notna().sum()) if len(ops) else 0,
            "fallback_calls": int(is_fallback(ops).sum()) if len(ops) else 0,
            "collectives": len(trace.get_collectives()), "incomplete_ranks": [int(r) for r in trace.incomplete_ranks],
            "dropped": int(trace.dropped)}


def explorer_text(trace: Trace) -> str:
    """The explorer in words: what was recorded, each distinct error, the ops that fell back."""
    f = explorer_summary(trace)
    lines = [f"Trace explorer: {f['op_calls']} op calls on {len(f['ranks'])} ranks, {f['errors']} raised, "
             f"{f['fallback_calls']} through a DTensor fallback, {f['collectives']} collectives"]
    if f["incomplete_ranks"]:
        lines.append(f"  incomplete ranks: {f['incomplete_ranks']}")
    if f["dropped"]:
        lines.append(f"  {f['dropped']} events dropped (buffer full)")
    errs = trace.get_errors()
    for (exc, msg, op), g in (errs.groupby(["exc_type", "message", "op"], sort=False) if len(errs) else ()):
        first = str(msg).splitlines()[0] if isinstance(msg, str) else msg
        lines.append(f"  error: {exc}: {first} (in {op}, ranks {sorted(int(r) for r in g['rank'])})")
    for fb in trace.get_fallbacks().itertuples(index=False):
        lines.append(f"  fallback: {fb.op} ({fb.path}, {fb.calls} calls)")
    lines.append("  (live: filters and each call on every rank, in the widget or t.to_html(path))")
    return "\n".join(lines)


def _flag(kind: str, in_flight) -> str:
    return "✖ error" if kind == "error" else "⚠ fallback" if kind == "fallback" else "⏳ running" if in_flight is True else ""


def explorer_html(trace: Trace, max_rows: int = STATIC_ROWS) -> str:
    """The explorer as static HTML (no script): the header, the errors, the fallbacks, and the first
    ``max_rows`` op calls in the explorer's order (errors, fallbacks, then time)."""
    f = explorer_summary(trace)
    rows = explorer_frame(trace)
    head = (f'<div class="sd-title"><span class="sd-kind">Trace explorer</span> <span class="sd-meta">'
            f'{f["op_calls"]} op calls on {len(f["ranks"])} ranks · {f["errors"]} raised · {f["fallback_calls"]} '
            f'DTensor fallback calls · {f["collectives"]} collectives</span></div>')
    body = [head, "<h4>Errors</h4>", errors_html(trace), "<h4>DTensor fallbacks</h4>", fallbacks_html(trace),
            f"<h4>Op calls{f' (the first {max_rows} of {len(rows)})' if len(rows) > max_rows else ''}</h4>"]
    cells = []
    for r in rows.iloc[:max_rows].itertuples(index=False):
        chip = f'<span class="sd-path" style="background-color:{path_color(r.path)};color:#fff">{esc(r.path)}</span>'
        if r.kind == "error":
            chip = f'<span class="sd-chip-error" style="background-color:{ERROR_COLOR};color:#fff">✖ raised</span> ' + chip
        host = "—" if r.host_ms is None or r.host_ms != r.host_ms else f"{r.host_ms:.3f}"
        source = r.user_frame.split("/")[-1] if isinstance(r.user_frame, str) else ""
        cells.append(f'<tr class="sd-op sd-kind-{esc(r.kind)}"><td class="sd-col-flag">{_flag(r.kind, r.in_flight)}</td>'
                     f"<td>{int(r.rank)}</td><td>{int(r.seq)}</td><td>{esc(r.op)}</td><td>{chip}</td><td>{esc(r.phase)}</td>"
                     f"<td>{esc(r.module) if isinstance(r.module, str) else ''}</td>"
                     f'<td class="sd-col-out_local_shape" style="white-space:nowrap">{esc(format_shape(r.out_local_shape))}</td>'
                     f"<td>{host}</td>"
                     f"<td>{esc(source)}</td></tr>")
    cols = "".join(f'<col style="width:{w}px">' if w else "<col>" for _, _, w in LIST_COLUMNS)
    body.append(f'<table class="sd-table sd-op-list"><colgroup>{cols}</colgroup><thead><tr>' +
                "".join(f"<th>{t}</th>" for _, t, _ in LIST_COLUMNS) + f'</tr></thead><tbody>{"".join(cells)}</tbody></table>')
    return static_view("sd-explorer", "".join(body))


def op_summary(trace: Trace) -> list[dict] | None:
    """Rows of the op summary for the explorer to open on (one per op / path / phase, each expanding to its
    per-rank calls, identical per-rank rows as one "ranks 0-3"), from ``Trace.get_op_summary()``;
    ``explorer_data`` passes them to the front end as ``summary``. None: the explorer opens on the list
    of calls."""
    return None


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

    def text(self) -> str:
        """The explorer in words (``explorer_text``): what ``str(widget)`` and a terminal show."""
        return explorer_text(self.trace)

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, a static rendering, the text and the trace (see ``sharddbg.views.bundle``)."""
        payload = view_payload("explorer", self.trace.to_dict(), explorer_summary(self.trace),
                               "t.save('run.sdtrace.json')")
        return output_bundle(super()._repr_mimebundle_(**kwargs), html=explorer_html(self.trace),
                             text=self.text(), payload=payload)
