"""Communication per op: bytes and time of the collectives each op caused, split by collective kind.

The figure draws ``sharddbg.analysis.comm.comm_by_op_kind(trace.get_collectives())`` as it is (all
ranks together; collectives outside any recorded op under ``analysis.comm.NO_OP``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..analysis.comm import comm_by_op_kind
from .common import collective_colors, empty_figure, esc, figure_template

if TYPE_CHECKING:
    from ..trace import Trace


def plot_comm_by_op(trace: Trace):
    """Plotly Figure: bytes (left) and time (right) per op, stacked by collective kind."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    df = comm_by_op_kind(trace.get_collectives())
    if df.empty:
        return empty_figure("Communication per op", "no collectives recorded in this trace<br>"
                            "(its ops did not communicate, or it was recorded without collective recording)")
    ops = list(df.groupby("op", sort=False)["bytes"].sum().sort_values(ascending=False).index)
    names = [esc(o) for o in ops]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=("bytes sent + received", "time in collectives (ms)"),
                        horizontal_spacing=0.04)
    for kind, color in collective_colors(df["kind"]).items():
        part = df[df["kind"] == kind].set_index("op").reindex(ops)
        fig.add_trace(go.Bar(y=names, x=part["bytes"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, customdata=part["calls"].fillna(0),
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:,.0f} B in %{customdata} calls<extra></extra>"), 1, 1)
        fig.add_trace(go.Bar(y=names, x=part["comm_ms"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, showlegend=False,
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:.3f} ms<extra></extra>"), 1, 2)
    fig.update_layout(barmode="stack", template=figure_template(), height=max(260, 120 + 28 * len(ops)),
                      title={"text": "Communication per op (all ranks)", "x": 0.01, "font": {"size": 14}},
                      yaxis={"autorange": "reversed"}, legend={"title": {"text": "collective"}},
                      margin={"l": 10, "r": 20, "t": 70, "b": 40})
    return fig
