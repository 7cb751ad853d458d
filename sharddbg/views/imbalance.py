"""Imbalance per rank: each rank's shard volume beside its host, comm and wait time, per op.

The figure draws ``Trace.get_imbalance()`` as it is (``sharddbg.analysis.comm.imbalance``: the volume
is ``shard_elems``, the elements of every distributed argument of the op's forward calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import empty_figure, esc, figure_template

if TYPE_CHECKING:
    from ..trace import Trace

VOLUME = "shard_elems"
TIMES = ("host_ms", "comm_ms", "wait_ms")
TIME_COLORS = {"host_ms": "#4e79a7", "comm_ms": "#6a3d9a", "wait_ms": "#e15759"}
ALL_OPS = "(all ops)"
MAX_OP_CHOICES = 12  # ops in the menu besides ALL_OPS: those with the largest spread of host time


def plot_imbalance(trace: Trace, op: str | None = None):
    """Plotly Figure: per-rank shard volume (left) beside per-rank times side by side (right: host time
    includes the op's own collectives, so they are not stacked), for all ops together and, through the
    menu, for each op (the ops with the largest spread of host time first). ``op``: the one shown first."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    df = trace.get_imbalance()
    if df.empty:
        return empty_figure("Imbalance per rank", "no ops recorded")
    ranks = sorted(df["rank"].unique())
    labels = [f"rank {r}" for r in ranks]
    spread = df.groupby("op")[TIMES[0]].agg(lambda s: s.max() - s.min()).sort_values(ascending=False)
    choices = [ALL_OPS] + list(spread.index[:MAX_OP_CHOICES])
    active = choices.index(op) if op in choices else 0
    fig = make_subplots(rows=1, cols=2, subplot_titles=("shard volume (elements)", "time (ms)"), horizontal_spacing=0.1)
    for k, choice in enumerate(choices):
        part = df if choice == ALL_OPS else df[df["op"] == choice]
        per = part.groupby("rank")[[VOLUME, *TIMES]].sum().reindex(ranks).fillna(0)
        fig.add_trace(go.Bar(x=labels, y=per[VOLUME], name="shard volume", marker_color="#9c755f", visible=k == active,
                             legendgroup="vol", hovertemplate="%{x}: %{y:,.0f} elements<extra></extra>"), 1, 1)
        for t in TIMES:
            fig.add_trace(go.Bar(x=labels, y=per[t], name=t.replace("_ms", " ms"), visible=k == active,
                                 marker_color=TIME_COLORS[t], legendgroup=t,
                                 hovertemplate="%{x}: %{y:.3f} ms<extra></extra>"), 1, 2)
    n_per = 1 + len(TIMES)
    buttons = []
    for k, choice in enumerate(choices):
        visible = [False] * (n_per * len(choices))
        visible[k * n_per:(k + 1) * n_per] = [True] * n_per
        buttons.append({"label": esc(choice), "method": "update", "args": [{"visible": visible},
                        {"title.text": f"Imbalance per rank · {esc(choice)}"}]})
    fig.update_layout(barmode="group", template=figure_template(), height=340,
                      title={"text": f"Imbalance per rank · {esc(choices[active])}", "x": 0.01, "font": {"size": 14}},
                      updatemenus=[{"buttons": buttons, "active": active,
                                    "x": 1.0, "xanchor": "right", "y": 1.22, "yanchor": "top"}],
                      margin={"l": 60, "r": 20, "t": 90, "b": 40})
    return fig
