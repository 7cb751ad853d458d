"""The Jupyter server side of the JupyterLab extension (``extension/``): a front end, like the magics and the
command line, that reads what the user has saved and answers the extension's requests.

``GET <base_url>sharddbg/trace?path=<a file under the server's root>``: what the trace's views draw (the
explorer's data, the timeline's and the communication-per-op figure's plotly JSON) and the explorer's static
HTML, for a trace file (``*.sdtrace.json``) or a recorded job (its ``job.json`` or one of its
``rank-NNNNN.arrows`` (``.jsonl``) files: the whole folder ``sharddbg record`` wrote, read by ``load_trace`` as the notebook
reads it) opened as a document; or the ``TraceFileError`` text of one that fails validation. Nothing is written.

``GET <base_url>sharddbg/clusters``: this user's clusters (the state files their owning processes keep under
``SHARDDBG_HOME``, ``sharddbg.cluster.state_file``), each running (every rank idle, busy, stuck in a collective
or dead) or gone with the reason.
``GET <base_url>sharddbg/clusters/<id>/trace``: the same as ``trace`` for the last trace of that cluster, which
its owner saved under ``SHARDDBG_HOME``.
``POST <base_url>sharddbg/clusters/<id>/stop``: kill every process of that cluster and forget it (its owner's
``Cluster`` finds its ranks dead); for a cluster whose owner has ended, the same reaps it.

The handlers are Jupyter's own ``APIHandler``: they go through the server's authentication and XSRF
protection and open no port of their own. The extension is enabled by
``jupyter-config/jupyter_server_config.d/sharddbg.json``, which the wheel installs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .cluster import registry, state_file
from .errors import TraceFileError
from .job_files import JOB_FILE, RANK_FILE_PATTERN
from .trace import Trace, load_trace
from .views.comm import plot_comm_by_op
from .views.explorer import explorer_data, explorer_html, explorer_text
from .views.figure import figure_drawn
from .views.timeline import plot_timeline

TRACE_SUFFIX = ".sdtrace.json"


def trace_answer(trace: Trace) -> dict:
    """What a trace document draws: each view's drawn data (the explorer's, then the timeline's and the
    communication per op's plotly figures), the explorer's static HTML and its text.

    Parameters
    ----------
    trace : Trace
        A loaded trace.

    Returns
    -------
    dict
        ``views`` (a list of ``{"view", "drawn"}``), ``html`` and ``text``.

    Examples
    --------
    >>> [v["view"] for v in trace_answer(load_trace("tests/data/conv4.sdtrace.json"))["views"]]
    ['explorer', 'timeline', 'comm']
    """
    return {"views": [{"view": "explorer", "drawn": explorer_data(trace)},
                      {"view": "timeline", "drawn": figure_drawn(plot_timeline(trace))},
                      {"view": "comm", "drawn": figure_drawn(plot_comm_by_op(trace))}],
            "html": explorer_html(trace), "text": explorer_text(trace)}


def trace_source(path: Path) -> Path:
    """What to load for a file opened as a trace document: a recorded job's ``job.json`` or rank file stands
    for its folder (the job is read whole); any other file is itself.

    Parameters
    ----------
    path : pathlib.Path
        The file opened.

    Returns
    -------
    pathlib.Path
        The file, or its job folder.

    Examples
    --------
    >>> trace_source(Path("run/rank-00001.jsonl"))
    PosixPath('run')
    """
    if path.name == JOB_FILE or RANK_FILE_PATTERN.match(path.name):
        return path.parent
    return path


def _answer_trace(handler: APIHandler, path: Path, shown: str) -> None:
    """Finish ``handler`` with ``trace_answer`` of the trace at ``path``, or ``{"error"}`` naming why not."""
    try:
        trace = load_trace(path)
    except TraceFileError as exc:
        handler.finish(json.dumps({"error": str(exc)}))
        return
    except OSError as exc:
        handler.finish(json.dumps({"error": f"{shown} could not be read: {exc.strerror or exc}"}))
        return
    handler.finish(json.dumps(trace_answer(trace), default=str))


def _jupyter_server_extension_points() -> list[dict]:
    """The server extension this module is (what ``jupyter server extension list`` finds).

    Returns
    -------
    list of dict
        One entry naming this module.

    Examples
    --------
    >>> _jupyter_server_extension_points()[0]["module"]
    'sharddbg.labserver'
    """
    return [{"module": "sharddbg.labserver"}]


def _jupyter_labextension_paths() -> list[dict]:
    """Where the built JupyterLab extension lies in the package (for ``jupyter labextension develop``).

    Returns
    -------
    list of dict
        ``src`` (the folder, relative to the package) and ``dest`` (the extension's name).

    Examples
    --------
    >>> _jupyter_labextension_paths()[0]["dest"]
    'sharddbg-jupyterlab'
    """
    return [{"src": "labextension", "dest": "sharddbg-jupyterlab"}]


class TraceHandler(APIHandler):
    """A trace file under the server's root, as the explorer draws it (read only)."""

    @web.authenticated
    def get(self) -> None:
        """Answer ``trace_answer``, or ``{"error"}`` naming why the file is not shown."""
        rel = self.get_query_argument("path", "")
        root = Path(self.settings["server_root_dir"]).expanduser().resolve()
        path = (root / rel.lstrip("/")).resolve()
        if root != path and root not in path.parents:
            raise web.HTTPError(403, "the path is outside the server's root")
        _answer_trace(self, trace_source(path), rel)


class ClusterTraceHandler(APIHandler):
    """The last trace of one of this user's clusters, as its owner saved it (read only)."""

    @web.authenticated
    def get(self, cluster_id: str) -> None:
        """Answer ``trace_answer`` of the cluster's last trace; 404 when it has none (or is gone)."""
        path = state_file.last_trace_path(cluster_id)
        if not path.exists():
            raise web.HTTPError(404, f"cluster {cluster_id} has no saved trace (nothing traced yet, or stopped)")
        _answer_trace(self, path, f"the last trace of cluster {cluster_id}")


class ClustersHandler(APIHandler):
    """This user's clusters as their state files tell them."""

    @web.authenticated
    def get(self) -> None:
        """Answer ``{"clusters": [...]}``: each a running cluster's state, or ``{"gone": reason}``."""
        clusters = []
        for entry in state_file.read_states():
            if isinstance(entry, state_file.GoneCluster):
                clusters.append({"cluster_id": entry.cluster_id, "gone": entry.reason, "owner_pid": entry.owner_pid})
            else:
                clusters.append(asdict(entry))
        self.finish(json.dumps({"clusters": clusters}))


class StopClusterHandler(APIHandler):
    """Stop (kill and forget) one of this user's clusters."""

    @web.authenticated
    def post(self, cluster_id: str) -> None:
        """Answer ``{"stopped": cluster_id, "pids": [...]}``; 404 for a cluster this user has no record of."""
        path = registry.clusters_dir() / f"{cluster_id}.json"
        try:
            record = registry.ClusterRecord.load(path)
        except FileNotFoundError:
            state_file.forget(cluster_id)
            raise web.HTTPError(404, f"no cluster {cluster_id} (stopped already?)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise web.HTTPError(409, f"the record of cluster {cluster_id} is corrupt ({exc})") from None
        pids = registry.reap(record)
        state_file.forget(cluster_id)
        self.finish(json.dumps({"stopped": cluster_id, "pids": pids}))


def _load_jupyter_server_extension(serverapp) -> None:
    """Add the handlers under the server's base URL.

    Parameters
    ----------
    serverapp : jupyter_server.serverapp.ServerApp
        The running server.

    Returns
    -------
    None

    Examples
    --------
    >>> # run by Jupyter Server itself when the extension is enabled
    """
    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [
        (url_path_join(base, "sharddbg", "trace"), TraceHandler),
        (url_path_join(base, "sharddbg", "clusters"), ClustersHandler),
        (url_path_join(base, "sharddbg", "clusters", r"([0-9a-zA-Z_-]+)", "stop"), StopClusterHandler),
        (url_path_join(base, "sharddbg", "clusters", r"([0-9a-zA-Z_-]+)", "trace"), ClusterTraceHandler),
    ])
