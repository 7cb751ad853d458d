"""The view of ``Cluster.diff``: the answer first (the first op that departs, where, how much, on which ranks and
rows), then one line per compared op output and gradient in the order they happened, departing ones tinted.

``diff_text`` and ``diff_html`` read a ``analysis.diff.DiffResult`` (its answer and ``get_ops()``). The HTML is
static (no script), in JupyterLab's theme colours with light fallbacks; every string is escaped.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from .common import StaticView

if TYPE_CHECKING:
    from ..analysis.diff import DiffResult

DEPART_TINT = "rgba(220, 40, 40, 0.18)"
FIRST_TINT = "rgba(220, 40, 40, 0.32)"
SKIP_TINT = "rgba(128, 128, 128, 0.10)"
DIFF_HEADERS = ["", "phase", "op", "call", "site", "module", "tensor", "max |diff|", "rel. to scale", "ranks", "rows",
                "note"]
MARKS = {"agrees": "✔", "departs": "✖", "not comparable": "·"}


def _number(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.3g}"


def _cells(row) -> list[str]:
    ranks = ", ".join(map(str, row["ranks"])) if len(row["ranks"]) else ""
    return [MARKS.get(row["verdict"], "?"), str(row["phase"]), str(row["op"]), str(row["call"]), str(row["site"]),
            str(row["module"] or ""), str(row["tensor"]), _number(row["max_abs"]), _number(row["max_rel"]), ranks,
            str(row["rows"] or ""), str(row["note"] or "")]


def explore_line(result: DiffResult) -> str:
    """Where the explorer opens: the first departing op's call on its first departing rank ("" without one)."""
    first = result.first
    if first is None or first.seq is None or not result.has_trace:
        return ""
    return (f"r.explore(): the trace explorer opened on this op's call on rank {first.rank} (seq {first.seq}), its "
            f"detail shown")


def diff_text(result: DiffResult) -> str:
    """The diff as text: the answer, where the explorer opens, then one aligned line per compared op output and
    gradient."""
    lines = [_cells(row) for _, row in result.get_ops().iterrows()]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(DIFF_HEADERS)]
    out = [result.answer] + ([explore_line(result)] if explore_line(result) else [])
    out += ["  ".join(h.ljust(w) for h, w in zip(DIFF_HEADERS, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def diff_html(result: DiffResult) -> str:
    """The diff as static HTML: the answer (tinted when an op departs), then the table."""
    first = result.first
    head = "".join(f"<th style='text-align:left;padding:2px 6px'>{html.escape(h)}</th>" for h in DIFF_HEADERS)
    body = []
    for _, row in result.get_ops().iterrows():
        is_first = first is not None and row["key"] == first.key and row["tensor"] == first.tensor \
            and row["phase"] == first.phase
        tint = FIRST_TINT if is_first else DEPART_TINT if row["verdict"] == "departs" else \
            SKIP_TINT if row["verdict"] == "not comparable" else "transparent"
        cells = "".join(f"<td style='padding:2px 6px;white-space:nowrap' title='{html.escape(c)}'>{html.escape(c)}</td>"
                        for c in _cells(row))
        body.append(f"<tr class='sd-diff-{row['verdict'].replace(' ', '-')}' style='background:{tint}'>{cells}</tr>")
    verdict_class = "sd-diff-ok" if first is None else "sd-diff-fail"
    explore = ""
    if first is not None and first.seq is not None and result.has_trace:
        explore = (f"<p class='sd-diff-explore' data-rank='{first.rank}' data-seq='{first.seq}' style='margin:0 0 8px "
                   f"0;padding:0 6px'>{html.escape(explore_line(result))}</p>")
    return (f"<div class='sd-diff' style='color:var(--jp-ui-font-color1,#222);font-size:var(--jp-code-font-size,13px)'>"
            f"<p class='{verdict_class}' style='margin:4px 0 8px 0;padding:4px 6px;background:"
            f"{'transparent' if first is None else DEPART_TINT}'>{html.escape(result.answer)}</p>{explore}"
            f"<table style='border-collapse:collapse'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
            f"</table></div>")


class DiffView(StaticView):
    """The diff's view: the answer, then the table (static HTML)."""

    def __init__(self, result: DiffResult):
        self.result = result

    def html(self) -> str:
        return diff_html(self.result)

    def text(self) -> str:
        return diff_text(self.result)
