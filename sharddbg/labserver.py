"""The Jupyter server side of the JupyterLab extension (``extension/``): a front end, like the magics and the
command line, that reads what the user has saved and answers the extension's requests.

``GET <base_url>sharddbg/trace?path=<a file under the server's root>``: the explorer's drawn data and its
static HTML for a trace file (``*.sdtrace.json``) opened as a document, or the ``TraceFileError`` text of one
that fails validation. The file is only read.

The handlers are Jupyter's own ``APIHandler``: they go through the server's authentication and XSRF
protection and open no port of their own. The extension is enabled by
``jupyter-config/jupyter_server_config.d/sharddbg.json``, which the wheel installs.
"""

from __future__ import annotations

import json
from pathlib import Path

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

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
    web_app.add_handlers(".*$", [(url_path_join(base, "sharddbg", "trace"), TraceHandler)])
