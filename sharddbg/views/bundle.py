"""What a sharddbg view leaves in a notebook: one output bundle per view, so a saved or shared notebook
still shows it.

Every view's bundle holds

- the live widget (``application/vnd.jupyter.widget-view+json``), while its kernel runs;
- ``text/html``: a static rendering of the same view (tables, the block diagram as text), for
  front ends without the kernel or the widget (a notebook opened elsewhere, nbconvert, GitHub);
- ``text/plain``: a summary in words (terminals, logs, ``print``);
- ``application/vnd.sharddbg.trace+json``: the data behind the view, versioned (``format``,
  ``version``, ``view``), and ``drawn``: what the widget's front end draws (the same dict its ``data``
  trait holds), so that the JupyterLab extension (``extension/``) draws the view live without the kernel,
  with the widget's own script. Above ``PAYLOAD_MAX_BYTES`` it holds ``drawn`` without the data where ``drawn``
  fits (a big trace's bounded view), else a summary and a note instead of both.
"""

from __future__ import annotations

import json

VIEW_MIMETYPE = "application/vnd.sharddbg.trace+json"
PAYLOAD_FORMAT = "sharddbg.view"
PAYLOAD_VERSION = 1
PAYLOAD_MAX_BYTES = 5 * 1024 * 1024


def view_payload(view: str, data: dict, summary: dict, keep_it: str, drawn: dict | None = None) -> dict:
    """The versioned payload of ``view``: ``data`` (JSON-able), a ``summary`` and ``drawn`` (what the
    view's front end draws); when ``data`` and ``drawn`` together are larger than ``PAYLOAD_MAX_BYTES``
    as JSON, ``drawn`` alone (where it fits: a big trace's bounded view) or only the summary, with the size and
    ``note`` (``keep_it``: how to keep the whole data, e.g. "t.save('run.sdtrace.json')")."""
    size = len(json.dumps(data, separators=(",", ":"), allow_nan=False, default=str))
    drawn_size = len(json.dumps(drawn, separators=(",", ":"), allow_nan=False, default=str))
    head = {"format": PAYLOAD_FORMAT, "version": PAYLOAD_VERSION, "view": view, "summary": summary}
    if size + drawn_size > PAYLOAD_MAX_BYTES and drawn is not None and drawn_size <= PAYLOAD_MAX_BYTES:
        # a big trace: what the view draws is bounded (a sample, an overview) and kept; the trace itself is not
        return head | {"data": None, "drawn": drawn, "data_bytes": size,
                       "note": f"the trace behind this view is {size / 2**20:.1f} MB, more than the "
                               f"{PAYLOAD_MAX_BYTES / 2**20:.0f} MB a notebook keeps: the view is kept, the trace is "
                               f"not; {keep_it} keeps all of it"}
    if size + drawn_size > PAYLOAD_MAX_BYTES:
        total = size + drawn_size
        return head | {"data": None, "drawn": None, "data_bytes": size,
                       "note": f"the data behind this view is {total / 2**20:.1f} MB, more than the "
                               f"{PAYLOAD_MAX_BYTES / 2**20:.0f} MB a notebook keeps; {keep_it} keeps all of it"}
    return head | {"data": data, "drawn": drawn, "data_bytes": size}


def output_bundle(widget_bundle, *, html: str, text: str, payload: dict) -> tuple[dict, dict]:
    """The widget's own bundle (data, metadata) with the static HTML, the text and the payload added."""
    data, metadata = widget_bundle if isinstance(widget_bundle, tuple) else (widget_bundle, {})
    data = dict(data)
    data["text/plain"] = text
    data["text/html"] = html
    data[VIEW_MIMETYPE] = payload
    return data, dict(metadata or {})
