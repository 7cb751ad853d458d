"""A view's plotly figure that leaves the sharddbg payload in its output bundle beside plotly's own: the
JupyterLab extension (``extension/``) draws it live from the saved payload (hover, zoom, legend toggles) in a
notebook reopened without its kernel or opened elsewhere, with no plotly extension of JupyterLab's needed.

``view_figure(fig, view)`` marks a figure as a view's (``timeline``, ``comm``, ``check_rows``, ``smoke_losses``)
without copying it: it stays a ``plotly.graph_objects.Figure`` in every other respect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import plotly.graph_objects as go

from .bundle import VIEW_MIMETYPE, view_payload

# how to keep a figure too large for the payload, said in its note
KEEP_FIGURE = "fig.write_html('figure.html')"


def figure_drawn(fig: go.Figure) -> dict:
    """What the extension draws of ``fig``: plotly's own JSON of it (``data``, ``layout``).

    Parameters
    ----------
    fig : plotly.graph_objects.Figure
        Any figure.

    Returns
    -------
    dict
        ``{"figure": {"data": [...], "layout": {...}}}``, JSON-able.

    Examples
    --------
    >>> sorted(figure_drawn(go.Figure())["figure"])
    ['data', 'layout']
    """
    import plotly.io as pio

    return {"figure": json.loads(pio.to_json(fig, validate=False))}


@dataclass
class DrawnWithoutZoom:
    """What a big timeline draws where its payload is kept without the spans it carries for the page's zoom
    (``layout.meta.sd_zoom``): ``traces`` added to it (its slowest windows drawn op by op) and its ``title``."""

    traces: list
    title: str


def _meta_without_zoom(meta: dict | None) -> dict | None:
    """A figure's ``layout.meta`` without the spans it carries for the page's zoom (``sd_zoom``); None if empty."""
    return {k: v for k, v in (meta or {}).items() if k != "sd_zoom"} or None


class ViewFigure(go.Figure):
    """A plotly Figure shown with its view's payload (``view_figure`` makes one)."""

    _sd_view = "figure"
    _sd_without_zoom: DrawnWithoutZoom | None = None  # a big timeline's windows, where its sd_zoom cannot go

    def sharddbg_payload(self) -> dict:
        """The versioned payload of this figure's view (``views.bundle.view_payload``).

        Returns
        -------
        dict
            ``format``, ``version``, ``view``, ``summary`` and ``drawn`` (``figure_drawn``).

        Examples
        --------
        >>> view_figure(go.Figure(), "timeline").sharddbg_payload()["view"]
        'timeline'
        """
        title = self.layout.title.text if self.layout.title and self.layout.title.text else ""
        drawn = figure_drawn(self)
        payload = view_payload(self._sd_view, {}, {"title": title, "traces": len(self.data)}, KEEP_FIGURE, drawn=drawn)
        meta = drawn["figure"]["layout"].get("meta")
        if payload["drawn"] is None and isinstance(meta, dict) and "sd_zoom" in meta:
            # a big timeline too large with the spans it carries for its zoom: kept without them, its slowest windows
            # drawn op by op instead (zoomed in elsewhere, it shows the overview's bins; the report keeps every span,
            # plot_timeline(time_range=...) draws any window)
            drawn["figure"]["layout"]["meta"] = _meta_without_zoom(meta)
            instead = self._sd_without_zoom
            if instead is not None:
                layout = drawn["figure"]["layout"]
                with_windows = {"figure": {
                    "data": drawn["figure"]["data"] + figure_drawn(go.Figure(data=instead.traces))["figure"]["data"],
                    "layout": {**layout, "title": {**layout.get("title", {}), "text": instead.title}}}}
                payload = view_payload(self._sd_view, {}, {"title": title, "traces": len(self.data)}, KEEP_FIGURE,
                                       drawn=with_windows)
            if payload["drawn"] is None:  # too large with them too: the overview alone
                payload = view_payload(self._sd_view, {}, {"title": title, "traces": len(self.data)}, KEEP_FIGURE,
                                       drawn=drawn)
        return payload

    def _repr_mimebundle_(self, include=None, exclude=None, validate=True, **kwargs):
        instead = self._sd_without_zoom
        if instead is None:
            bundle = dict(super()._repr_mimebundle_(include, exclude, validate, **kwargs) or {})
        else:
            # plotly's own renderers cannot draw a zoomed window from the spans: they get the windows drawn op by op
            # (and not the spans, which only the sharddbg payload needs)
            alt = go.Figure(self)
            alt.layout.meta = _meta_without_zoom(alt.layout.meta)
            alt.add_traces(instead.traces)
            alt.layout.title.text = instead.title
            bundle = dict(go.Figure._repr_mimebundle_(alt, include, exclude, validate, **kwargs) or {})
        bundle[VIEW_MIMETYPE] = self.sharddbg_payload()
        return bundle

    def _ipython_display_(self) -> None:
        import plotly.io as pio
        from IPython.display import display

        if pio.renderers.render_on_display and pio.renderers.default:
            display(self._repr_mimebundle_(), raw=True)
        else:
            print(repr(self))


def view_figure(fig: go.Figure, view: str, without_zoom: DrawnWithoutZoom | None = None) -> go.Figure:
    """``fig`` (the same object) shown as the view ``view``: its output bundle carries the payload too.

    Parameters
    ----------
    fig : plotly.graph_objects.Figure
        The figure a view made.
    view : str
        The view's name in the payload (``timeline``, ``comm``, ``check_rows``, ``smoke_losses``).
    without_zoom : DrawnWithoutZoom or None
        A big timeline's: what it draws instead where the spans of its ``sd_zoom`` cannot go (plotly's own
        renderers, a notebook payload too large with them).

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig`` itself, now a ``ViewFigure``.

    Examples
    --------
    >>> view_figure(go.Figure(), "timeline")._sd_view
    'timeline'
    """
    if type(fig) is go.Figure:
        fig.__class__ = ViewFigure
    if isinstance(fig, ViewFigure):
        fig._sd_view = view
        fig._sd_without_zoom = without_zoom
    return fig
