"""The view of ``Cluster.check_patch``: the verdict first, then the op without and with the handler side by
side (path, time per call, collectives per call, the check), then each side's numerical check.

Static HTML (no script) in JupyterLab's theme colours, every string escaped, and its text twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .check import FAIL_TINT, check_html, check_text
from .common import StaticView, esc

if TYPE_CHECKING:
    from ..analysis.patch_check import PatchCheck


def patch_check_text(result: PatchCheck) -> str:
    """The verdict, the side-by-side table, then each side's check verdict."""
    table = result.table
    width = max(len(str(i)) for i in table.index)
    cols = [max(len(c), *(len(str(v)) for v in table[c])) for c in table.columns]
    lines = [result.verdict, "",
             (" " * width + "  " + "  ".join(c.ljust(w) for c, w in zip(table.columns, cols))).rstrip()]
    for name, row in table.iterrows():
        lines.append(str(name).ljust(width) + "  " + "  ".join(str(v).ljust(w) for v, w in zip(row, cols)).rstrip())
    if result.before is not None:
        lines += ["", f"before: {result.before.check.verdict}"]
    elif result.before_error:
        lines += ["", f"before: {result.before_error}"]
    lines += [f"after:  {result.after.check.verdict}"]
    return "\n".join(lines)


def patch_check_html(result: PatchCheck) -> str:
    """The verdict, the side-by-side table (the after column tinted when the patch is wrong), then the after
    side's check in full."""
    table = result.table
    tint = "transparent" if result.ok else FAIL_TINT
    head = "".join(f"<th style='text-align:left;padding:2px 10px'>{esc(c)}</th>" for c in ["", *table.columns])
    body = "".join(
        "<tr>" + f"<th style='text-align:left;padding:2px 10px'>{esc(name)}</th>"
        + "".join(f"<td style='padding:2px 10px;{'background:' + tint if col == 'after' else ''}'>{esc(v)}</td>"
                  for col, v in row.items()) + "</tr>"
        for name, row in table.iterrows())
    mark = "✔" if result.ok else "✖"
    return (f"<div class='sharddbg-patch-check' style='color:var(--jp-ui-font-color1, #222)'>"
            f"<p style='font-weight:600'>{mark} {esc(result.verdict)}</p>"
            f"<p style='font-family:var(--jp-code-font-family, monospace)'>{esc(result.stmt)}</p>"
            f"<table style='border-collapse:collapse'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<details><summary>the check with the handler</summary>{check_html(result.after.check)}</details>"
            + (f"<details><summary>the check without it</summary>{check_html(result.before.check)}</details>"
               if result.before is not None else "") + "</div>")


class PatchCheckView(StaticView):
    """``PatchCheck.show()``: static HTML and its text twin."""

    def __init__(self, result: PatchCheck):
        self.result = result

    def html(self) -> str:
        return patch_check_html(self.result)

    def text(self) -> str:
        return patch_check_text(self.result)


__all__ = ["PatchCheckView", "patch_check_html", "patch_check_text", "check_text"]
