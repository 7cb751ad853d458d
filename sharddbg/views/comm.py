"""Communication per op: bytes and time of the collectives each op caused, split by collective kind.

The figure draws ``sharddbg.analysis.comm.comm_by_op_kind(trace.get_collectives(), trace.get_ops())`` as it is
(all ranks together; collectives outside any recorded op under ``analysis.comm.NO_OP``). Each collective is
drawn under the op it belongs to as ``analysis.comm.collective_calls`` decides for every view: the user's own
call it was issued in, the op the explorer's op summary shows it under; the hover names the op inside that
issued it (the all_reduce of a ``ShardTensor.backward()`` is drawn under ``ShardTensor.backward``, via
``ShardTensor.redistribute``).
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

    from .figure import view_figure

    df = comm_by_op_kind(trace.get_collectives(), trace.get_ops())
    if df.empty:
        return view_figure(empty_figure("Communication per op", "no collectives recorded in this trace<br>"
                            "(its ops did not communicate, or it was recorded without collective recording)"), "comm")
    ops = list(df.groupby("op", sort=False)["bytes"].sum().sort_values(ascending=False).index)
    names = [esc(o) for o in ops]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=("bytes sent + received", "time in collectives (ms, summed over ranks)"),
                        horizontal_spacing=0.04)
    for kind, color in collective_colors(df["kind"]).items():
        part = df[df["kind"] == kind].set_index("op").reindex(ops)
        # where the op did not issue them itself, the ops inside it that did
        via = [f"<br>issued via {esc(v)}" if isinstance(v, str) and v else "" for v in part["via"]]
        fig.add_trace(go.Bar(y=names, x=part["bytes"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, customdata=list(zip(part["calls"].fillna(0), via)),
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:,.0f} B in %{customdata[0]} calls"
                                           "%{customdata[1]}<extra></extra>"), 1, 1)
        fig.add_trace(go.Bar(y=names, x=part["comm_ms"].fillna(0), orientation="h", name=esc(kind), marker_color=color,
                             legendgroup=kind, showlegend=False, customdata=list(zip(part["calls"].fillna(0), via)),
                             hovertemplate="%{y}<br>" + esc(kind) + ": %{x:.3f} ms, summed over ranks"
                                           "%{customdata[1]}<extra></extra>"), 1, 2)
    fig.update_layout(barmode="stack", template=figure_template(), height=max(260, 120 + 28 * len(ops)),
                      title={"text": "Communication per op (all ranks; each collective under the user's call it was "
                                     "issued in, as in the op summary)", "x": 0.01, "font": {"size": 14}},
                      yaxis={"autorange": "reversed"}, legend={"title": {"text": "collective"}},
                      margin={"l": 10, "r": 20, "t": 70, "b": 40})
    return view_figure(fig, "comm")
