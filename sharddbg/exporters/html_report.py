"""``to_html(trace, path)``: one standalone HTML file with every view of a trace, viewable offline.

plotly.js is inlined (no CDN: the file opens without internet) as text that the page's script evaluates
once a figure comes near the screen: plotly's partial bundle (cartesian: bar, heatmap, scatter and more, 1.5 MB)
when it registers every trace type of the report's figures, else the full bundle (``exporters.plotly_bundle``;
the page names the one it carries in a comment and in ``data-plotly-bundle`` / ``data-plotly-version``); each
figure is inlined as JSON and drawn then (figures below the fold wait until they are scrolled to, each box saying
so meanwhile). The explorer's front end and its data are inlined
too (it opens on the op summary, as in a notebook) and are drawn first. The page is the template
``sharddbg/views/templates/report.html``: every string from the trace is escaped there (autoescape) or set
as text by the explorer's script; the embedded JSON has every ``<``, ``>`` and ``&`` as \\u escapes.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import TYPE_CHECKING

import pandas as pd

from ..columnar import numpy_huge_pages_unadvised
from ..files import refuse_folder, write_file_atomically
from ..views.comm import plot_comm_by_op
from ..views.common import (FINDING_CATEGORY_TITLES, SEVERITY_MARKS, error_entries, fallback_table, json_for_script, json_text_for_script,
                            module_as_script,
                            path_color, render, static)
from ..views.explorer import explorer_data
from ..views.imbalance import plot_imbalance
from ..views.timeline import plot_timeline
from .plotly_bundle import plotly_bundle_for

if TYPE_CHECKING:
    from ..trace import Trace


def to_html(trace: Trace, path: str | os.PathLike, *, title: str | None = None, max_rows: int | None = None) -> str:
    """Write the report for ``trace`` to ``path`` (one self-contained HTML file). Returns the path. The file
    appears whole or not at all (``sharddbg.files.write_file_atomically``). ``max_rows``: the explorer's calls
    (``views.explorer.explorer_data``: by default all of a small trace's, a bounded sample of a big one's)."""
    path = refuse_folder(path, "report.html")  # before the seconds spent making the report
    with numpy_huge_pages_unadvised():  # a big trace's report makes many big arrays: see there
        return _write_report(trace, path, title, max_rows)


def _write_report(trace: Trace, path: str, title: str | None, max_rows: int | None) -> str:
    import plotly.io as pio

    ops = trace.get_ops()
    title = title or "sharddbg trace report"
    figs = [("timeline", plot_timeline(trace)), ("comm", plot_comm_by_op(trace)), ("imbalance", plot_imbalance(trace))]
    # each figure as JSON data, drawn by the page's script (report.js) once it comes near the screen: the page's
    # text and its explorer are on screen before plotly.js is evaluated, and a figure below the fold costs
    # nothing until it is scrolled to
    fig_html = {name: {"json": json_text_for_script(pio.to_json(fig, validate=False)),
                       "height": int(fig.layout.height or 450)} for name, fig in figs}
    plotly_js = plotly_bundle_for(t.type for _, fig in figs for t in fig.data)
    plotly_comment = plotly_js.why  # said in an HTML comment: no "--" (it would end the comment)
    while "--" in plotly_comment:
        plotly_comment = plotly_comment.replace("--", "- -")
    paths = ops["path"].value_counts() if len(ops) else pd.Series(dtype=int)
    fallback_columns, fallback_rows = fallback_table(trace)
    doc = render("report.html", title=title, headline=trace.overview.headline(),
                 generated=_dt.datetime.now().isoformat(timespec="seconds"),
                 findings=[f.as_dict() for f in trace.findings], marks=SEVERITY_MARKS,
                 categories=FINDING_CATEGORY_TITLES,
                 paths=[{"path": p, "color": path_color(p), "calls": int(n)} for p, n in paths.items()],
                 code=trace.meta.get("code"), errors=error_entries(trace), fallback_columns=fallback_columns,
                 fallback_rows=fallback_rows, figures=fig_html,
                 explorer_json=json_for_script(explorer_data(trace, max_rows=max_rows)),
                 explorer_js=module_as_script(static("explorer.js"), "_sdExplorer"), report_js=static("report.js"),
                 plotly_js=plotly_js, plotly_comment=plotly_comment,
                 timeline_zoom_js=module_as_script(static("timeline_zoom.js"), "_sdTimelineZoom"))
    return write_file_atomically(path, lambda f: f.write(doc), example_name="report.html")
