"""The seam between sharddbg's data and its views and files.

Every ``show()``, ``plot_*()``, ``to_html()``, ``to_perfetto()`` and rich display of a Trace or a result object,
and every widget the cluster hands back, goes through one function here. Each imports its view or exporter
when it is called (as pandas' ``DataFrame.plot`` reaches its plotting backend), so the data layer (trace,
analysis, the results, the cluster) never imports plotly, widgets or templates, and no view is imported by
anything below the front ends but this module.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .analysis.check import CheckResult
    from .analysis.diff import DiffResult
    from .analysis.doctor import DoctorReport
    from .analysis.layout import ShardLayout
    from .analysis.patch_check import PatchCheck
    from .analysis.replica_check import ReplicaCheck
    from .analysis.smoke import SmokeResult
    from .trace import Trace


# ---- a trace ---------------------------------------------------------------------------------------------
def explorer(trace: Trace, **kwargs) -> Any:
    """The trace explorer widget (``views.explorer.TraceExplorer``)."""
    from .views.explorer import TraceExplorer

    return TraceExplorer(trace, **kwargs)


def timeline(trace: Trace, **kwargs) -> Any:
    """The all-rank timeline, a plotly Figure (``views.timeline.plot_timeline``)."""
    from .views.timeline import plot_timeline

    return plot_timeline(trace, **kwargs)


def comm_by_op(trace: Trace, **kwargs) -> Any:
    """Bytes and time per op, a plotly Figure (``views.comm.plot_comm_by_op``)."""
    from .views.comm import plot_comm_by_op

    return plot_comm_by_op(trace, **kwargs)


def imbalance(trace: Trace, **kwargs) -> Any:
    """Per-rank shard volume beside per-rank time, a plotly Figure (``views.imbalance.plot_imbalance``)."""
    from .views.imbalance import plot_imbalance

    return plot_imbalance(trace, **kwargs)


def html_report(trace: Trace, path: str | os.PathLike, **kwargs) -> str:
    """The standalone HTML report written to ``path`` (``exporters.html_report.to_html``); the path."""
    from .exporters.html_report import to_html

    return to_html(trace, path, **kwargs)


def perfetto(trace: Trace, path: str | os.PathLike) -> str:
    """The Chrome trace-event file written to ``path`` (``exporters.perfetto.write_perfetto``); the path."""
    from .exporters.perfetto import write_perfetto

    return write_perfetto(trace, path)


# ---- the shard inspector ---------------------------------------------------------------------------------
def inspector(layout: ShardLayout) -> Any:
    """The shard inspector widget over ``layout`` (``views.inspector.ShardInspector``)."""
    from .views.inspector import ShardInspector

    return ShardInspector(layout)


# ---- verification results --------------------------------------------------------------------------------
def check_view(result: CheckResult) -> Any:
    """The numerical check's view: its verdict and table, then the error per row (``views.check.CheckView``)."""
    from .views.check import CheckView

    return CheckView(result)


def check_html(result: CheckResult) -> str:
    """The numerical check as static HTML (``views.check.check_html``)."""
    from .views.check import check_html as html

    return html(result)


def patch_check_html(result: PatchCheck) -> str:
    """``Cluster.check_patch``'s result as static HTML (``views.patch_check.patch_check_html``)."""
    from .views.patch_check import patch_check_html as html

    return html(result)


def patch_check_view(result: PatchCheck) -> Any:
    """``Cluster.check_patch``'s view: verdict, the two sides, each side's check (``views.patch_check``)."""
    from .views.patch_check import PatchCheckView

    return PatchCheckView(result)


def diff_view(result: DiffResult) -> Any:
    """The op-by-op diff's view: the answer, then the table (``views.diff.DiffView``)."""
    from .views.diff import DiffView

    return DiffView(result)


def diff_html(result: DiffResult) -> str:
    """The op-by-op diff as static HTML (``views.diff.diff_html``)."""
    from .views.diff import diff_html as html

    return html(result)


def check_rows_figure(result: CheckResult, tensor: str | None = None, group: int = 0) -> Any:
    """The largest error per row along the sharded dim, a plotly Figure (``views.check.plot_row_errors``)."""
    from .views.check import plot_row_errors

    return plot_row_errors(result, tensor, group)


def doctor_view(report: DoctorReport) -> Any:
    """The pitfall doctor's view (``views.check.DoctorView``)."""
    from .views.check import DoctorView

    return DoctorView(report)


def smoke_view(result: SmokeResult) -> Any:
    """The smoke matrix's view (``views.smoke.SmokeView``)."""
    from .views.smoke import SmokeView

    return SmokeView(result)


def smoke_losses_figure(result: SmokeResult) -> Any:
    """Each configuration's loss error per step, a plotly Figure (``views.smoke.plot_smoke_losses``)."""
    from .views.smoke import plot_smoke_losses

    return plot_smoke_losses(result)


def replica_check_view(check: ReplicaCheck) -> Any:
    """The replica check's view (``views.replicas.ReplicaCheckView``)."""
    from .views.replicas import ReplicaCheckView

    return ReplicaCheckView(check)
