"""The smoke matrix's view: one row per configuration, its verdict first (matches the single-device run,
failed as expected, or what is wrong), then the first step whose loss is beyond the tolerance, how far its
losses (at the worst step) and gradients are from the single-device run's, its time per step, its fallbacks
and collectives per step. Each takes the result it shows (``analysis.smoke.SmokeResult``) and reads its
table (a DataFrame indexed by configuration, ``TABLE_COLUMNS``), its verdict and its tolerance.

The HTML is static (no script), so it reads the same in a saved notebook, nbconvert or GitHub; its colours
are JupyterLab's theme variables, with light fallbacks (the template ``smoke.html``).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import pandas as pd

from typing import TYPE_CHECKING

from .common import FIGURE_ALERT, FIGURE_LINE, StaticView, figure_template, render, table_drawn

if TYPE_CHECKING:
    from ..analysis.smoke import SmokeResult

# (column, header, how a value is written)
SHOWN = [
    ("mesh", "mesh", str),
    ("wrapper", "wrapper", lambda v: "" if v == "none" else {"ddp": "DDP", "fsdp2": "FSDP2"}.get(v, str(v))),
    ("compiled", "compiled", lambda v: "yes" if v else ""),
    ("loss_off_step", "loss off from step", lambda v: _step(v)),  # where the run departs, before the worst
    ("loss_error", "loss error", lambda v: _sci(v)),
    ("grad_error", "grad error", lambda v: _sci(v)),
    ("step_ms", "ms / step", lambda v: _fixed(v)),
    ("first_step_ms", "first step ms", lambda v: _fixed(v)),
    ("fallbacks", "fallbacks / step", lambda v: _fixed(v, 0)),
    ("collectives_per_step", "collectives / step", lambda v: _fixed(v, 0)),
]


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _sci(v) -> str:
    return "—" if _missing(v) else f"{v:.1e}"


def _step(v) -> str:
    return "—" if v is None or pd.isna(v) else str(int(v))


def _fixed(v, digits: int = 1) -> str:
    return "—" if _missing(v) else f"{v:.{digits}f}"


def row_state(row) -> str:
    """"ok" (matches, or is the reference), "expected" (failed as it must), "wrong"."""
    if not row["ok"]:
        return "wrong"
    return "expected" if row["expected_error"] else "ok"


MARKS = {"ok": "✔", "expected": "✔", "wrong": "✖"}
TINTS = {"ok": "rgba(40, 160, 60, 0.13)", "expected": "rgba(128, 128, 128, 0.13)", "wrong": "rgba(220, 40, 40, 0.18)"}


def smoke_text(result: SmokeResult) -> str:
    """The view as text: the verdict, then one line per configuration."""
    table, verdict = result.table, result.verdict
    headers = ["configuration"] + [h for _, h, _ in SHOWN] + ["verdict"]
    lines = []
    for name, row in table.iterrows():
        state = row_state(row)
        lines.append([str(name)] + [fmt(row[col]) for col, _, fmt in SHOWN] + [f"{MARKS[state]} {row['outcome']}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)]
    widths[-1] = len(headers[-1])  # the verdict is last and free to run on
    out = [verdict, "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def smoke_html(result: SmokeResult) -> str:
    """The view as static HTML (every string escaped)."""
    table, verdict, rtol = result.table, result.verdict, result.rtol
    bad = not bool(table["ok"].all())
    rows = []
    for name, row in table.iterrows():
        state = row_state(row)
        rows.append({"state": state, "tint": TINTS[state], "name": str(name), "about": str(row["about"] or ""),
                     "cells": [fmt(row[col]) for col, _, fmt in SHOWN], "mark": MARKS[state],
                     "outcome": str(row["outcome"])})
    return render("smoke.html", verdict=verdict, bad=bad, mark=MARKS["wrong" if bad else "ok"],
                  headers=[h for _, h, _ in SHOWN], rows=rows, rtol=f"{rtol:g}")


def smoke_drawn(result: SmokeResult) -> dict:
    """The smoke matrix as the JupyterLab extension draws it (``common.table_drawn``)."""
    table = result.table
    rows = []
    for name, row in table.iterrows():
        state = row_state(row)
        cells = [f"{MARKS[state]} {row['outcome']}", str(name)] + [fmt(row[col]) for col, _, fmt in SHOWN]
        titles = ["", f"{name}: {row['about']}" if row["about"] else ""] + ["" for _ in SHOWN]
        rows.append({"status": state, "ok": state != "wrong", "cells": cells, "titles": titles})
    bad = not bool(table["ok"].all())
    return table_drawn(result.verdict, "fail" if bad else "ok", ["verdict", "configuration"] + [h for _, h, _ in SHOWN],
                       rows)


class SmokeView(StaticView):
    """The smoke matrix's table as a view: HTML in a notebook, text in a terminal (``str(view)``), and the
    loss error per step as a plotly figure (``plot_losses()``)."""

    view = "smoke"

    def __init__(self, result: SmokeResult):
        self.result = result

    def text(self) -> str:
        return smoke_text(self.result)

    def html(self) -> str:
        return smoke_html(self.result)

    def drawn(self) -> dict:
        return smoke_drawn(self.result)

    def plot_losses(self):
        return plot_smoke_losses(self.result)


# Each configuration's line in its own dash and marker, the first drawn widest and densest, the later ones
# narrower and sparser on top, each moved a little along the step axis (DODGE, in steps, like grouped bars):
# two identical lines (DDP and FSDP2 often match the single device exactly) both stay visible.
DASHES = ["solid", "longdash", "dash", "longdashdot", "dashdot", "dot"]
DODGE = 0.03
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross", "star", "hexagon"]


@dataclass(frozen=True)
class LossErrorFloor:
    """Where a log axis draws an error of 0 (an exact match): ``value``, a decade below the smallest error
    that is not 0 and below the tolerance."""

    value: float

    @classmethod
    def of(cls, errors: list[float], rtol: float) -> LossErrorFloor:
        """The floor for these errors (all configurations' together) and this tolerance."""
        positive = [e for e in errors if e > 0 and math.isfinite(e)]
        low = min(positive + [rtol]) if positive else rtol
        return cls(10.0 ** (math.floor(math.log10(low)) - 1))


def _relative_error(loss: float, reference: float) -> float:
    return abs(loss - reference) / max(abs(reference), 1e-30)


def plot_smoke_losses(result: SmokeResult):
    """Each configuration's loss error against the single-device run, per step, on a log axis whose floor
    (a dotted line) draws the errors of 0, with the tolerance as a dashed line labelled on it: a
    configuration that is right stays far below it. Each line has its own dash and marker."""
    import plotly.graph_objects as go

    from .figure import view_figure

    table, rtol = result.table, result.rtol
    fig = go.Figure()
    runs = [(str(name), [_relative_error(a, b) for a, b in zip(row["losses"], row["reference_losses"])])
            for name, row in table.iterrows() if row["losses"] and row["reference_losses"]]
    floor = LossErrorFloor.of([e for _, errors in runs for e in errors], rtol).value
    for k, (name, errors) in enumerate(runs):
        label = html.escape(name)
        hover = [f"{label}<br>step {s}: " + (f"{e:.2e}" if e > 0 or not math.isfinite(e)
                                             else f"0 (exact, drawn at the floor {floor:.0e})")
                 for s, e in enumerate(errors)]
        fig.add_trace(go.Scatter(
            x=[step + DODGE * (k - (len(runs) - 1) / 2) for step in range(len(errors))], y=[max(e, floor) if math.isfinite(e) else None for e in errors],
            mode="lines+markers", name=name,
            line={"dash": DASHES[k % len(DASHES)], "width": max(5.0 - 0.9 * k, 1.2)},
            marker={"symbol": SYMBOLS[k % len(SYMBOLS)], "size": max(14 - 2 * k, 5)},
            hovertext=hover, hoverinfo="text"))
    top = max([e for _, errors in runs for e in errors if math.isfinite(e)] + [rtol])
    # Shapes take data values on a log axis, annotations its log10: the label sits on its line.
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=rtol, y1=rtol,
                  line={"dash": "dash", "color": FIGURE_ALERT, "width": 1.5})
    fig.add_annotation(text=f"rtol {rtol:g}", xref="paper", x=0, xanchor="left", y=math.log10(rtol), yanchor="bottom",
                       showarrow=False, font={"color": FIGURE_ALERT})
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=floor, y1=floor,
                  line={"dash": "dot", "color": FIGURE_LINE, "width": 1})
    fig.add_annotation(text=f"0 (exact) drawn at {floor:.0e}", xref="paper", x=1, xanchor="right",
                       y=math.log10(floor), yanchor="bottom", showarrow=False)
    fig.update_layout(title="loss error against the single-device run, per step", xaxis_title="step",
                      yaxis_title="relative error", height=360, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      xaxis={"dtick": 1, "zeroline": False},
                      yaxis={"type": "log", "range": [math.log10(floor) - 0.3, math.log10(top) + 0.5],
                             "exponentformat": "e"},
                      template=figure_template())
    if not runs:
        fig.add_annotation(text="no configuration ran to compare", showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5)
    return view_figure(fig, "smoke_losses")
