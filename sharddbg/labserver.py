"""The Jupyter server side of the JupyterLab extension (``extension/``): a front end, like the magics and the
command line, that reads what the user has saved and answers the extension's requests.

``GET <base_url>sharddbg/trace?path=<a file under the server's root>``: the explorer's drawn data and its
static HTML for a trace file (``*.sdtrace.json``) opened as a document, or the ``TraceFileError`` text of one
that fails validation. The file is only read.

``GET <base_url>sharddbg/clusters``: this user's clusters (the state files their owning processes keep under
``SHARDDBG_HOME``, ``sharddbg.cluster.state_file``), each running or gone with the reason.
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
from .trace import load_trace
from .views.explorer import explorer_data, explorer_html, explorer_text

TRACE_SUFFIX = ".sdtrace.json"


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
        """Answer ``{"drawn", "html", "text"}``, or ``{"error"}`` naming why the file is not shown."""
        rel = self.get_query_argument("path", "")
        root = Path(self.settings["server_root_dir"]).expanduser().resolve()
        path = (root / rel.lstrip("/")).resolve()
        if root != path and root not in path.parents:
            raise web.HTTPError(403, "the path is outside the server's root")
        try:
            trace = load_trace(path)
        except TraceFileError as exc:
            self.finish(json.dumps({"error": str(exc)}))
            return
        except OSError as exc:
            self.finish(json.dumps({"error": f"{rel} could not be read: {exc.strerror or exc}"}))
            return
        self.finish(json.dumps({"drawn": explorer_data(trace), "html": explorer_html(trace),
                                "text": explorer_text(trace)}, default=str))


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
            state_file.state_path(cluster_id).unlink(missing_ok=True)
            raise web.HTTPError(404, f"no cluster {cluster_id} (stopped already?)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise web.HTTPError(409, f"the record of cluster {cluster_id} is corrupt ({exc})") from None
        pids = registry.reap(record)
        state_file.state_path(cluster_id).unlink(missing_ok=True)
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
    ])
