"""The views of verification: the numerical check (``Cluster.check``) and the pitfall doctor (``Cluster.doctor``).

- ``check_html`` / ``check_text``: the verdict, then one row per tensor and rank (failures first, tinted),
  then, for each tensor that fails row by row, which rows fail and where the shard boundaries are;
- ``plot_row_errors``: the largest error per row along the sharded dim, one line per rank, the shard
  boundaries dashed, the failing rows in red: "wrong only near the boundaries" (a missing halo) shows as
  spikes at the dashed lines;
- ``doctor_html`` / ``doctor_text``: one row per check, ok / warn / fail / skip, what was found, the fix.

Each takes the result it shows (``analysis.check.CheckResult``, ``analysis.doctor.DoctorReport``) and reads
its data: the tables (``TABLE_COLUMNS``, ``ROW_COLUMNS``), the verdict, the boundary patterns. The HTML is static (no script), in JupyterLab's theme colours with
light fallbacks, from the templates ``check.html`` and ``doctor.html``; every string is escaped.
"""

from __future__ import annotations

import html
import math

from typing import TYPE_CHECKING

from .common import FIGURE_LINE, StaticView, empty_figure, figure_template, render, table_drawn

if TYPE_CHECKING:
    from ..analysis.check import CheckResult
    from ..analysis.doctor import DoctorReport

FAIL_TINT = "rgba(220, 40, 40, 0.18)"
WARN_TINT = "rgba(230, 160, 20, 0.20)"
SKIP_TINT = "rgba(128, 128, 128, 0.10)"
RANK_COLORS = ["#4e79a7", "#59a14f", "#b07aa1", "#76b7b2", "#9c755f", "#edc948", "#bab0ac", "#86bcb6"]
# The pass/fail column comes first: in a narrow output it stays in view whatever else must scroll.
CHECK_HEADERS = ["ok", "tensor", "kind", "rank", "max |diff|", "rel. to scale", "ratio", "tolerance", "bad",
                 "shape", "dtype", "compared", "note"]
# Columns whose text may be long: they wrap (their full text also on hover); the others stay on one line.
CHECK_WRAPPED = {"tensor", "tolerance", "compared", "note"}
STATUS_MARKS = {"ok": "✔", "warn": "⚠", "fail": "✖", "skip": "·"}
STATUS_TINTS = {"ok": "transparent", "warn": WARN_TINT, "fail": FAIL_TINT, "skip": SKIP_TINT}


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.3g}"


def _shape(shape) -> str:
    return "" if shape is None else "(" + ", ".join(str(s) for s in shape) + ")"


def _check_cells(row) -> list[str]:
    tolerance = "" if math.isnan(row["rtol"]) else f"rtol {row['rtol']:.0e}, atol {row['atol']:.2g}"
    return ["✔" if row["ok"] else "✖", str(row["tensor"]), str(row["kind"]), str(row["rank"]), _number(row["max_abs"]),
            _number(row["max_rel"]), _number(row["ratio"]), tolerance, f"{int(row['bad'])} of {int(row['numel'])}",
            _shape(row["shape"]), str(row["dtype"] or "").replace("torch.", ""), str(row["compared"]),
            str(row["note"] or "")]


def _pattern_lines(patterns) -> list[str]:
    lines = []
    several_groups = len({p.group for p in patterns}) > 1
    for p in patterns:
        rows = _row_ranges(p.failing_rows)
        where = (f"all within {p.max_distance} rows of a shard boundary: a missing halo?" if p.near_boundaries
                 else "not only near the shard boundaries")
        cuts = ", ".join(map(str, p.boundaries)) or "none"
        group = f" in domain group {p.group}" if several_groups else ""
        lines.append(f"{p.tensor}{group}: failing rows {rows} (shard boundaries at rows {cuts}); {where}")
    return lines


def _row_ranges(rows) -> str:
    """[14, 15, 16, 17, 18, 33] -> "14-18, 33" """
    out, start, prev = [], None, None
    for r in rows:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ", ".join(out)


def _ordered(table):
    """Failures first, then the rest, each in the table's order."""
    return table.iloc[sorted(range(len(table)), key=lambda i: (bool(table["ok"].iloc[i]), i))]


def _numbered_notes(lines: list[list[str]]) -> list[str]:
    """Each distinct note once: the rows' note cells become "[1]", "[2]" (a note is often the same on every
    rank and would otherwise stretch every row); the notes themselves, in that order."""
    notes: list[str] = []
    for line in lines:
        if line[-1]:
            if line[-1] not in notes:
                notes.append(line[-1])
            line[-1] = f"[{notes.index(line[-1]) + 1}]"
    return [f"[{i + 1}] {note}" for i, note in enumerate(notes)]


def check_text(result: CheckResult) -> str:
    """The check as text: the verdict, the failing rows' patterns, then one aligned line per tensor and rank,
    then the notes they refer to."""
    lines = [_check_cells(row) for _, row in _ordered(result.table).iterrows()]
    notes = _numbered_notes(lines)
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(CHECK_HEADERS)]
    out = [result.verdict] + _pattern_lines(result.patterns())
    out.append("  ".join(h.ljust(w) for h, w in zip(CHECK_HEADERS, widths)).rstrip())
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out + notes)


def check_html(result: CheckResult) -> str:
    """The check as static HTML."""
    ordered = _ordered(result.table)
    lines = [_check_cells(row) for _, row in ordered.iterrows()]
    full = [list(line) for line in lines]  # each cell's whole text, its tooltip (a note's too, before it is numbered)
    notes = _numbered_notes(lines)
    rows = [{"status": "ok" if row["ok"] else "fail", "tint": "transparent" if row["ok"] else FAIL_TINT,
             "cells": [{"text": text, "title": title, "wrap": head in CHECK_WRAPPED}
                       for head, text, title in zip(CHECK_HEADERS, cells, titles)]}
            for (_, row), cells, titles in zip(ordered.iterrows(), lines, full)]
    return render("check.html", verdict=result.verdict, ok=result.ok, patterns=_pattern_lines(result.patterns()),
                  headers=CHECK_HEADERS, rows=rows, notes=notes)


def check_drawn(result: CheckResult) -> dict:
    """The check as the JupyterLab extension draws it (``common.table_drawn``)."""
    ordered = _ordered(result.table)
    lines = [_check_cells(row) for _, row in ordered.iterrows()]
    full = [list(line) for line in lines]
    notes = _numbered_notes(lines)
    rows = [{"status": "ok" if row["ok"] else "fail", "ok": bool(row["ok"]), "cells": cells, "titles": titles}
            for (_, row), cells, titles in zip(ordered.iterrows(), lines, full)]
    return table_drawn(result.verdict, "ok" if result.ok else "fail", CHECK_HEADERS, rows,
                       _pattern_lines(result.patterns()), notes)


def plot_row_errors(result: CheckResult, tensor: str | None = None, group: int = 0):
    """Plotly Figure: for one tensor at a time (a menu picks it), the largest |sharded - reference| of each row
    along its sharded dim in domain group ``group``, one line per rank, failing rows marked red, shard boundaries
    dashed, the absolute tolerance dotted. ``tensor``: the one shown first (default: the first failing one with
    rows, else the first with rows)."""
    import plotly.graph_objects as go

    from .figure import view_figure

    rows = result.rows[result.rows["group"] == group]
    tensors = [t for t in dict.fromkeys(rows["tensor"])]
    boundaries = {t: result.boundaries(t, group) for t in tensors}
    tolerances = {t: float(result.table.loc[result.table["tensor"] == t, "atol"].max()) for t in tensors}
    failing = [t for t in dict.fromkeys(result.failures()["tensor"]) if t in tensors]
    if not tensors:
        return view_figure(empty_figure("Error per row", "no tensor was compared row by row (none is sharded)"),
                           "check_rows")
    shown = tensor if tensor in tensors else next((t for t in failing if t in tensors), tensors[0])
    fig = go.Figure()
    traces_of: dict[str, list[int]] = {}
    for t in tensors:
        part = rows[rows["tensor"] == t]
        positive = part.loc[part["max_abs"] > 0, "max_abs"]
        floor = float(positive.min()) / 10 if len(positive) else 1e-12
        traces_of[t] = []
        for i, (rank, ranked) in enumerate(part.groupby("rank")):
            ranked = ranked.sort_values("row")
            y = [max(v, floor) if not math.isinf(v) else None for v in ranked["max_abs"]]
            traces_of[t].append(len(fig.data))
            fig.add_trace(go.Scatter(
                x=list(ranked["row"]), y=y, mode="lines+markers", name=f"rank {rank}", visible=t == shown,
                line={"color": RANK_COLORS[i % len(RANK_COLORS)], "width": 1},
                marker={"size": [7 if not ok else 3 for ok in ranked["ok"]],
                        "color": ["#d62728" if not ok else RANK_COLORS[i % len(RANK_COLORS)] for ok in ranked["ok"]]},
                hovertemplate=f"{html.escape(t)}<br>row %{{x}} (rank {rank})<br>max |diff| %{{y:.3g}}<extra></extra>"))
    n = len(fig.data)

    def layout_for(t: str) -> dict:
        shapes = [{"type": "line", "x0": b - 0.5, "x1": b - 0.5, "yref": "paper", "y0": 0, "y1": 1,
                   "line": {"dash": "dash", "color": FIGURE_LINE, "width": 1}} for b in boundaries.get(t, [])]
        atol = tolerances.get(t)
        if atol and atol > 0:
            shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": atol, "y1": atol,
                           "line": {"dash": "dot", "color": "#d62728", "width": 1}})
        cuts = ", ".join(map(str, boundaries.get(t, []))) or "none"
        return {"shapes": shapes, "title.text": f"Error per row · {html.escape(t)} · shard boundaries at {cuts} "
                                                f"(dashed), atol dotted"}

    buttons = []
    for t in tensors:
        visible = [False] * n
        for k in traces_of[t]:
            visible[k] = True
        buttons.append({"label": html.escape(t) + (" ✖" if t in failing else ""), "method": "update",
                        "args": [{"visible": visible}, layout_for(t)]})
    first = layout_for(shown)
    fig.update_layout(template=figure_template(), height=360, shapes=first["shapes"],
                      title={"text": first["title.text"], "x": 0.01, "font": {"size": 13}},
                      xaxis={"title": {"text": "row along the sharded dim"}},
                      yaxis={"title": {"text": "max |sharded - reference|"}, "type": "log"},
                      updatemenus=[{"buttons": buttons, "active": tensors.index(shown), "x": 1.0, "xanchor": "right",
                                    "y": 1.25, "yanchor": "top"}],
                      margin={"l": 70, "r": 20, "t": 90, "b": 50})
    return view_figure(fig, "check_rows")


class CheckView(StaticView):
    """The check's view: the verdict and table (static HTML), then the error per row (plotly, when a tensor was
    compared row by row)."""

    view = "check"

    def __init__(self, result: CheckResult):
        self.result = result
        self.figure = plot_row_errors(result) if len(result.rows) else None

    def html(self) -> str:
        return check_html(self.result)

    def text(self) -> str:
        return check_text(self.result)

    def drawn(self) -> dict:
        return check_drawn(self.result)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)
        if self.figure is not None:
            display(self.figure)


# ---- the doctor ------------------------------------------------------------------------------------------
DOCTOR_HEADERS = ["check", "status", "found", "fix"]


def _doctor_cells(row) -> list[str]:
    return [str(row["check"]), f"{STATUS_MARKS.get(row['status'], '')} {row['status']}", str(row["found"]),
            str(row["fix"] or "")]


def doctor_text(report: DoctorReport) -> str:
    """The doctor as text: the verdict, then one block per check."""
    out = [report.verdict]
    for _, row in report.table.iterrows():
        check, status, found, fix = _doctor_cells(row)
        out.append(f"{status:<7} {check}: {found}" + (f"\n        fix: {fix}" if fix and row["status"] in ("fail", "warn") else ""))
    return "\n".join(out)


def doctor_html(report: DoctorReport) -> str:
    """The doctor as static HTML: one row per check, tinted by status."""
    table = report.table
    outcome = "fail" if (table["status"] == "fail").any() else "warn" if (table["status"] == "warn").any() else "ok"
    rows = []
    for _, row in table.iterrows():
        cells = _doctor_cells(row)
        if row["status"] not in ("fail", "warn"):  # a fix for what passed or was not examined is noise
            cells[3] = ""
        rows.append({"status": str(row["status"]), "tint": STATUS_TINTS.get(row["status"], "transparent"), "cells": cells})
    return render("doctor.html", verdict=report.verdict, outcome=outcome, headers=DOCTOR_HEADERS, rows=rows)


def doctor_drawn(report: DoctorReport) -> dict:
    """The doctor as the JupyterLab extension draws it (``common.table_drawn``)."""
    table = report.table
    outcome = "fail" if (table["status"] == "fail").any() else "warn" if (table["status"] == "warn").any() else "ok"
    rows = []
    for _, row in table.iterrows():
        cells = _doctor_cells(row)
        if row["status"] not in ("fail", "warn"):
            cells[3] = ""
        rows.append({"status": str(row["status"]), "ok": row["status"] not in ("fail", "warn"), "cells": cells,
                     "titles": ["" for _ in cells]})
    return table_drawn(report.verdict, outcome, DOCTOR_HEADERS, rows)


class DoctorView(StaticView):
    """The doctor's view: the verdict, then one row per check tinted by status (static HTML)."""

    view = "doctor"

    def __init__(self, report: DoctorReport):
        self.report = report

    def drawn(self) -> dict:
        return doctor_drawn(self.report)

    def html(self) -> str:
        return doctor_html(self.report)

    def text(self) -> str:
        return doctor_text(self.report)
