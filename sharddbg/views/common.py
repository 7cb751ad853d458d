"""Shared by the views and the HTML report: static assets, colours, HTML escaping, safe JSON embedding."""

from __future__ import annotations

import html
import json
from functools import lru_cache
from pathlib import Path

_STATIC = Path(__file__).with_name("_static")

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
COLLECTIVE_COLORS = ["#1f78b4", "#b15928", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666", "#7570b3"]


def path_color(path: str) -> str:
    return PATH_COLORS.get(path, "#7f7f7f")


def collective_colors(kinds) -> dict[str, str]:
    """{kind: colour} for the collective kinds a figure draws, in sorted order (same kinds, same colours)."""
    return {k: COLLECTIVE_COLORS[i % len(COLLECTIVE_COLORS)] for i, k in enumerate(sorted(set(kinds)))}


@lru_cache(maxsize=None)
def static(name: str) -> str:
    return (_STATIC / name).read_text()


def esc(value) -> str:
    """HTML-escape anything that came from a trace (op names, messages, paths, module names)."""
    return html.escape("" if value is None else str(value), quote=True)


def json_for_script(obj) -> str:
    """JSON safe inside <script>: no '</script>', no '<!--' (every '<', '>', '&' as \\u escapes)."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def module_as_script(js: str, name: str) -> str:
    """An ES module's text as plain script defining ``name`` (for the standalone report)."""
    return js.replace("export function ", "function ").replace("export default", f"const {name} =")


def empty_figure(title: str, message: str):
    """A plotly Figure that only says ``message`` (a figure with nothing to draw)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 14}}, template="plotly_white", height=260,
                      xaxis={"visible": False}, yaxis={"visible": False})
    fig.add_annotation(text=message, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font={"size": 13, "color": "#555"})
    return fig
