"""The replica check's view: the verdict, then one row per parameter and group of ranks, those that differ
first (which ranks, by how much), then the ones that are the same. Each takes the check it shows
(``analysis.replica_check.ReplicaCheck``) and reads its table (``TABLE_COLUMNS``: name, kind, group_ranks,
state, ranks_differing, reference_rank, max_abs_diff, shape, dtype, placements, detail), verdict and mesh dim.

The HTML is static (no script): it reads the same in a saved notebook, nbconvert or GitHub; its colours are
JupyterLab's theme variables, with light fallbacks (the template ``replicas.html``). Every string is escaped.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

from .common import StaticView, render

if TYPE_CHECKING:
    from ..analysis.replica_check import ReplicaCheck

MARKS = {"same": "✔", "sharded": "·", "differs": "✖", "mismatch": "✖"}
TINTS = {"same": "transparent", "sharded": "rgba(128, 128, 128, 0.10)", "differs": "rgba(220, 40, 40, 0.18)",
         "mismatch": "rgba(220, 40, 40, 0.18)"}
HEADERS = ["parameter", "ranks", "state", "differing ranks", "max |diff|", "shape", "dtype", "detail"]


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) else ""


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _row_cells(row) -> list[str]:
    diff = row["max_abs_diff"]
    return [str(row["name"]), _ranks(row["group_ranks"]), f"{MARKS.get(row['state'], '')} {row['state']}",
            _ranks(row["ranks_differing"]),
            "" if diff is None or (isinstance(diff, float) and math.isnan(diff)) else f"{diff:.3g}",
            _shape(row["shape"]), str(row["dtype"]), str(row["detail"] or "")]


def replica_check_text(check: ReplicaCheck) -> str:
    """The view as text: the verdict, then one aligned line per parameter and group."""
    lines = [_row_cells(row) for _, row in check.table.iterrows()]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(HEADERS)]
    out = [check.verdict, "  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def replica_check_html(check: ReplicaCheck) -> str:
    """The view as static HTML."""
    table, verdict, mesh_dim = check.table, check.verdict, check.mesh_dim
    bad = not table["state"].isin(("same", "sharded")).all()
    rows = [{"state": str(row["state"]), "tint": TINTS.get(str(row["state"]), "transparent"), "cells": _row_cells(row)}
            for _, row in table.iterrows()]
    return render("replicas.html", verdict=verdict, bad=bad, headers=HEADERS, rows=rows, mesh_dim=mesh_dim)


class ReplicaCheckView(StaticView):
    """The replica check as a view: HTML in a notebook, text in a terminal (``str(view)``)."""

    def __init__(self, check: ReplicaCheck):
        self.check = check

    def text(self) -> str:
        return replica_check_text(self.check)

    def html(self) -> str:
        return replica_check_html(self.check)
