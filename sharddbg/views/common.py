"""Shared by the views and the HTML report: static assets, colours, HTML escaping, safe JSON embedding, and
the Jinja2 templates every piece of HTML is written from (``templates/``, rendered by ``render``)."""

from __future__ import annotations

import html
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis.findings import CATEGORY_TITLES

if TYPE_CHECKING:
    import jinja2

_STATIC = Path(__file__).with_name("_static")
_TEMPLATES = Path(__file__).with_name("templates")

# Dispatch paths: greens/blues for handled paths, orange/red for the DTensor fallbacks.
PATH_COLORS = {
    "function_handler": "#2e8b57",
    "named_handler": "#17a2b8",
    "dispatch_handler": "#4e79a7",
    "autograd_passthrough": "#9aa0a6",
    "conversion": "#c7c7c7",
    "compile_tracing": "#b07aa1",
    "dtensor_fallback_function": "#f28e2b",
    "dtensor_fallback_dispatch": "#d62728",
    "python_method": "#8c6bb1",  # full_tensor, redistribute, backward, from_local (schema 2)
}
ERROR_COLOR = "#8b0000"
# A finding's mark, by its severity (analysis.findings.SEVERITIES): the explorer, the report and their text show it.
SEVERITY_MARKS = {"fail": "✖", "warn": "⚠", "info": "ℹ", "ok": "✔", "skip": "·"}
# A finding's category as the explorer, the report and their text name it (analysis.findings.CATEGORIES).
FINDING_CATEGORY_TITLES = CATEGORY_TITLES
SPEC_COLOR = "#b8860b"  # a result whose spec disagrees with its local tensor: amber, apart from errors and paths
# Collective kinds: blues, violets, greens and cyans only (hues 110-290 degrees), so that no collective
# shares a hue with the orange and red DTensor fallbacks; one colour per family, the same in every figure.
COLLECTIVE_KIND_COLORS = {
    "all_reduce": "#1f77b4", "all_reduce_coalesced": "#1f77b4",
    "all_to_all_single": "#0f9b8e", "all_to_all": "#0f9b8e",
    "all_gather_into_tensor": "#6cae3c", "all_gather": "#6cae3c", "all_gather_coalesced": "#6cae3c",
    "all_gather_into_tensor_coalesced": "#6cae3c",
    "reduce_scatter_tensor": "#5b4fcf", "reduce_scatter": "#5b4fcf", "reduce_scatter_tensor_coalesced": "#5b4fcf",
    "broadcast": "#4f5bd5", "reduce": "#3a7fa8", "gather": "#5c9e6e", "scatter": "#5c9e6e",
    "send": "#9a6fd6", "recv": "#6f5fb0", "barrier": "#7a8794",
}
OTHER_COLLECTIVE_COLORS = ["#46628a", "#5a4e9c", "#3f7f5f", "#2f7f9f"]


# Plotly figures on any background. A figure reaches JupyterLab through plotly's own renderer (no script of
# ours runs there to read the theme), the standalone report, nbconvert and GitHub: so one look for light and
# dark pages alike. Backgrounds are transparent (the page's own shows through); text, axes and grid are mid
# greys (#777 reads at about 4.5:1 on white and 4:1 on JupyterLab Dark's #111); lines drawn over the plot
# (rank separators, links) are translucent greys; menus are light buttons with dark text, readable on both.
FIGURE_BACKGROUND = "rgba(0,0,0,0)"
FIGURE_TEXT = "#777777"
FIGURE_GRID = "rgba(128,128,128,0.25)"
FIGURE_LINE = "rgba(128,128,128,0.7)"
FIGURE_ALERT = "#d62728"  # a red that reads on white (5:1) and on #111 (4:1)
FIGURE_TEMPLATE_NAME = "sharddbg"


@lru_cache(maxsize=1)
def figure_template():
    """The plotly template of every sharddbg figure, readable on light and dark pages alike: plotly's
    ``plotly_white`` with transparent paper and plot backgrounds, mid-grey text, axes and grid.

    Returns
    -------
    plotly.graph_objects.layout.Template
        Pass it as ``template=`` to ``Figure.update_layout``.

    Examples
    --------
    >>> import plotly.graph_objects as go
    >>> fig = go.Figure(layout={"template": figure_template()})
    >>> fig.layout.template.layout.paper_bgcolor
    'rgba(0,0,0,0)'
    """
    import plotly.graph_objects as go
    import plotly.io as pio

    template = go.layout.Template(pio.templates["plotly_white"])
    axis = {"gridcolor": FIGURE_GRID, "linecolor": FIGURE_LINE, "zerolinecolor": FIGURE_LINE, "tickcolor": FIGURE_LINE,
            "title": {"font": {"color": FIGURE_TEXT}}, "tickfont": {"color": FIGURE_TEXT}}
    template.layout.update(
        paper_bgcolor=FIGURE_BACKGROUND, plot_bgcolor=FIGURE_BACKGROUND, font={"color": FIGURE_TEXT},
        title={"font": {"color": FIGURE_TEXT}}, xaxis=axis, yaxis=axis,
        legend={"bgcolor": FIGURE_BACKGROUND, "font": {"color": FIGURE_TEXT}},
        modebar={"bgcolor": FIGURE_BACKGROUND, "color": FIGURE_TEXT, "activecolor": "#4e79a7"},
        updatemenudefaults={"bgcolor": "#ececec", "bordercolor": "#999999", "font": {"color": "#222222"}},
        annotationdefaults={"font": {"color": FIGURE_TEXT}})
    return template


def path_color(path: str) -> str:
    return PATH_COLORS.get(path, "#7f7f7f")


def collective_colors(kinds) -> dict[str, str]:
    """{kind: colour} for the collective kinds a figure draws, in sorted order (a kind has the same colour
    in every figure; kinds outside ``COLLECTIVE_KIND_COLORS`` take cool colours in turn)."""
    out, other = {}, 0
    for k in sorted(set(kinds)):
        if k in COLLECTIVE_KIND_COLORS:
            out[k] = COLLECTIVE_KIND_COLORS[k]
        else:
            out[k] = OTHER_COLLECTIVE_COLORS[other % len(OTHER_COLLECTIVE_COLORS)]
            other += 1
    return out


@lru_cache(maxsize=None)
def static(name: str) -> str:
    return (_STATIC / name).read_text()


def esc(value) -> str:
    """HTML-escape anything that came from a trace (op names, messages, paths, module names)."""
    return html.escape("" if value is None else str(value), quote=True)


def json_for_script(obj) -> str:
    """JSON safe inside <script>: no '</script>', no '<!--' (every '<', '>', '&' as \\u escapes)."""
    return json_text_for_script(json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str))


def json_text_for_script(text: str) -> str:
    """JSON text (``json.dumps``'s or ``plotly.io.to_json``'s) made safe inside <script>, as ``json_for_script``."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def module_as_script(js: str, name: str) -> str:
    """An ES module's text as plain script defining ``name`` (for the standalone report)."""
    return js.replace("export function ", "function ").replace("export default", f"const {name} =")


def empty_figure(title: str, message: str):
    """A plotly Figure that only says ``message`` (a figure with nothing to draw)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 14}}, template=figure_template(), height=260,
                      xaxis={"visible": False}, yaxis={"visible": False})
    fig.add_annotation(text=message, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font={"size": 13, "color": FIGURE_TEXT})
    return fig


# ---- HTML from templates --------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def template_environment() -> jinja2.Environment:
    """The one Jinja2 environment of sharddbg's templates, built on first use: autoescape everywhere,
    an undefined name an error, templates read once (they ship with the package)."""
    import jinja2
    from markupsafe import Markup

    @jinja2.pass_eval_context
    def escaped(eval_ctx, value):
        # What ``{{ value }}`` prints. With autoescape on (every template's default): ``esc``'s escaping
        # (``html.escape``: quotes as &quot; and &#x27;, None as nothing), the spelling sharddbg's HTML has
        # always had, instead of markupsafe's; HTML a template or sharddbg made (``|safe``, a macro's output)
        # as it is. With autoescape off, the value as it is.
        if not eval_ctx.autoescape or hasattr(value, "__html__"):
            return value
        return Markup(esc(value))

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, finalize=escaped, trim_blocks=True,
                             lstrip_blocks=True, auto_reload=False)
    env.globals.update(static=static, error_color=ERROR_COLOR, spec_color=SPEC_COLOR)
    return env


def render(template: str, **values) -> str:
    """``templates/<template>`` rendered with ``values`` (data: every string in it is escaped)."""
    return template_environment().get_template(template).render(**values)


# ---- static HTML (the standalone report and the static rendering a view leaves in a notebook) --------
def cell_text(v) -> str:
    """A table cell as text: floats to 3 decimals, lists joined, missing values as a dash."""
    import pandas as pd

    if isinstance(v, float):
        return "—" if pd.isna(v) else f"{v:.3f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    return "—" if v is None else str(v)


def table_cells(df, cols: list[str]) -> list[list[str]]:
    """``df[cols]``, row by row, as ``cell_text``."""
    return [[cell_text(r[c]) for c in cols] for _, r in df.iterrows()]


def table_drawn(verdict: str, outcome: str, headers: list[str], rows: list[dict], lines: list[str] | None = None,
                notes: list[str] | None = None) -> dict:
    """What the JupyterLab extension draws of a verification view (check, doctor, smoke): the verdict (``outcome``:
    ok, warn or fail), ``lines`` under it, the table (each row ``{"status", "ok", "cells", "titles"}``, in the
    order the static view has them) and the notes under it. Every value is text; the extension sets it as text."""
    return {"verdict": verdict, "outcome": outcome, "lines": list(lines or []), "headers": list(headers),
            "rows": rows, "notes": list(notes or [])}


def error_entries(trace) -> list[dict]:
    """The trace's exceptions as the error blocks show them: one per distinct (type, message, op), with the
    ranks that raised it, the first call's source line and traceback, whether the recorder unmasked it and
    whether the user's code handled it (``handled``: those come last)."""
    errs = trace.get_errors()
    entries = []
    for (exc, msg, op), g in (errs.groupby(["exc_type", "message", "op"], sort=False) if len(errs) else ()):
        r0 = g.iloc[0]
        entries.append({"exc_type": exc, "message": msg, "op": op, "ranks": str(sorted({int(r) for r in g["rank"]})),
                        "user_frame": r0["user_frame"], "unmasked": bool(g["unmasked"].any()),
                        "handled": bool(g["handled"].fillna(False).astype(bool).all()),
                        "traceback": r0["traceback"]})
    return sorted(entries, key=lambda e: e["handled"])


def fallback_table(trace) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """The ops that took a DTensor fallback (``Trace.get_fallbacks()``): the table's (column, title) pairs
    and its rows of cell texts; no rows when none did."""
    fb = trace.get_fallbacks()
    cols = [c for c in ("op", "path", "calls", "ranks", "host_ms_total", "bwd_host_ms_total", "family", "locations")
            if c in fb]
    return [(c, c) for c in cols], ([] if fb.empty else table_cells(fb, cols))


class StaticView:
    """A view that is static HTML and its text twin (the verification results): ``html()`` in a notebook
    (saved with it, no widget), ``text()`` for ``str`` / ``repr`` (terminals, logs). Subclasses define both, and
    those the JupyterLab extension draws live from a saved notebook (a status filter on the rows) also ``view``
    and ``drawn()``: the payload's (``bundle.view_payload``) table, ``table_drawn``."""

    view: str | None = None  # the payload's view name; None: no payload (the HTML is the whole view)

    def html(self) -> str:
        raise NotImplementedError

    def text(self) -> str:
        raise NotImplementedError

    def drawn(self) -> dict:
        raise NotImplementedError

    def _repr_mimebundle_(self, include=None, exclude=None):
        from .bundle import VIEW_MIMETYPE, view_payload

        bundle = {"text/plain": self.text(), "text/html": self.html()}
        if self.view is not None:
            drawn = self.drawn()
            bundle[VIEW_MIMETYPE] = view_payload(self.view, {}, {"verdict": drawn["verdict"]}, "str(view)", drawn=drawn)
        return bundle

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return self.html()
