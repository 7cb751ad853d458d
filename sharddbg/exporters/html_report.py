"""``to_html(trace, path)``: one standalone HTML file with every view of a trace, viewable offline.

plotly.js is inlined (no CDN: the file opens without internet), the explorer's front end and its data
are inlined too (it opens on the op summary, as in a notebook). Every string from the trace goes through ``html.escape`` (Python-built HTML) or is set
as text by the explorer's script; the embedded JSON has every ``<``, ``>`` and ``&`` as \\u escapes.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import TYPE_CHECKING

import pandas as pd

from ..files import write_file_atomically
from ..views.comm import plot_comm_by_op
from ..views.common import (errors_html, esc, fallbacks_html, json_for_script, module_as_script, path_color, static,
                            warnings_html)
from ..views.explorer import DEFAULT_MAX_ROWS, explorer_data, trace_findings
from ..views.imbalance import plot_imbalance
from ..views.timeline import plot_timeline

if TYPE_CHECKING:
    from ..trace import Trace


def to_html(trace: Trace, path: str | os.PathLike, *, title: str | None = None, max_rows: int = DEFAULT_MAX_ROWS) -> str:
    """Write the report for ``trace`` to ``path`` (one self-contained HTML file). Returns the path. The file
    appears whole or not at all (``sharddbg.files.write_file_atomically``)."""
    import plotly.io as pio

    path = os.fspath(path)
    ops = trace.get_ops()
    fb = trace.get_fallbacks()
    title = title or "sharddbg trace report"
    figs = [("timeline", plot_timeline(trace)), ("comm", plot_comm_by_op(trace)), ("imbalance", plot_imbalance(trace))]
    fig_html = {}
    for i, (name, fig) in enumerate(figs):
        fig_html[name] = pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), div_id=f"sd-fig-{name}",
                                     config={"displaylogo": False, "responsive": True})
    paths = ops["path"].value_counts() if len(ops) else pd.Series(dtype=int)
    path_summary = " ".join(f'<span class="sd-path" style="background:{path_color(p)}">{esc(p)}</span> {int(n)}'
                            for p, n in paths.items())
    facts = [f"{len(trace.ranks)} ranks", f"{len(ops)} op calls", f"{int((ops['exc_type'].notna()).sum()) if len(ops) else 0} op calls raised",
             f"{len(fb)} ops fell back to DTensor"]
    if trace.dropped:
        facts.append(f"{trace.dropped} events dropped (buffer full)")
    if trace.incomplete_ranks:
        facts.append(f"incomplete ranks {trace.incomplete_ranks}")
    findings = warnings_html(trace_findings(trace))
    code = trace.meta.get("code")
    explorer_js = module_as_script(static("explorer.js"), "_sdExplorer")
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{static("style.css")}
body {{ margin: 16px 24px; background: #fff; }} h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 26px; border-bottom: 1px solid #ddd; }}
details.sd-error {{ margin: 6px 0; }} pre.sd-code {{ background: #f6f8fa; padding: 8px; border-radius: 4px; }}
</style></head>
<body class="sd-root">
<h1>{esc(title)}</h1>
<p class="sd-meta">{esc(" · ".join(facts))} · generated {esc(_dt.datetime.now().isoformat(timespec="seconds"))} by sharddbg</p>
{findings}
<p>{path_summary}</p>
{f'<details><summary>recorded code</summary><pre class="sd-code">{esc(code)}</pre></details>' if code else ""}
<h2>Errors</h2>
{errors_html(trace)}
<h2>DTensor fallbacks</h2>
{fallbacks_html(trace)}
<h2>Timeline</h2>
{fig_html["timeline"]}
<h2>Communication per op</h2>
{fig_html["comm"]}
<h2>Imbalance</h2>
{fig_html["imbalance"]}
<h2>Explorer</h2>
<div id="sd-explorer"></div>
<script type="application/json" id="sd-explorer-data">{json_for_script(explorer_data(trace, max_rows=max_rows))}</script>
<script>
{explorer_js}
(function () {{
  const data = JSON.parse(document.getElementById("sd-explorer-data").textContent);
  const state = {{ data: data, selected: [] }};
  const model = {{ get: (k) => state[k], set: (k, v) => {{ state[k] = v; }}, on: () => {{}}, save_changes: () => {{}} }};
  _sdExplorer.render({{ model: model, el: document.getElementById("sd-explorer") }});
}})();
</script>
</body></html>
"""
    return write_file_atomically(path, lambda f: f.write(doc))
