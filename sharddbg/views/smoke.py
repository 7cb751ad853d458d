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

import pandas as pd

from typing import TYPE_CHECKING

from .common import StaticView, render

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


class SmokeView(StaticView):
    """The smoke matrix's table as a view: HTML in a notebook, text in a terminal (``str(view)``), and the
    loss error per step as a plotly figure (``plot_losses()``)."""

    def __init__(self, result: SmokeResult):
        self.result = result

    def text(self) -> str:
        return smoke_text(self.result)

    def html(self) -> str:
        return smoke_html(self.result)

    def plot_losses(self):
        return plot_smoke_losses(self.result)


def plot_smoke_losses(result: SmokeResult):
    """Each configuration's loss error against the single-device run, per step, on a log scale, with the
    tolerance as a dashed line: a configuration that is right stays far below it."""
    import plotly.graph_objects as go

    table, rtol = result.table, result.rtol
    fig = go.Figure()
    floor = 1e-12  # an exact match (error 0) is drawn here: a log axis has no 0
    shown = 0
    for name, row in table.iterrows():
        losses, reference = row["losses"], row["reference_losses"]
        if not losses or not reference:
            continue
        errors = [max(abs(a - b) / max(abs(b), 1e-30), floor) for a, b in zip(losses, reference)]
        fig.add_trace(go.Scatter(x=list(range(len(errors))), y=errors, mode="lines+markers", name=str(name),
                                 hovertemplate=f"{html.escape(str(name))}<br>step %{{x}}: %{{y:.2e}}<extra></extra>"))
        shown += 1
    fig.add_hline(y=rtol, line_dash="dash", line_color="#b00020", annotation_text=f"rtol {rtol:g}",
                  annotation_position="top left")
    fig.update_layout(title="loss error against the single-device run, per step", xaxis_title="step",
                      yaxis_title="relative error", yaxis_type="log", height=360, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      xaxis={"dtick": 1}, template="plotly_white")
    if not shown:
        fig.add_annotation(text="no configuration ran to compare", showarrow=False, xref="paper", yref="paper",
                           x=0.5, y=0.5)
    return fig
