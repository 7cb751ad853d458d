"""Views: widgets and plotly figures over a Trace or a ShardLayout. They never touch an engine.

One module per view: ``inspector.ShardInspector`` (the shard inspector widget), ``explorer.TraceExplorer``
(the trace explorer widget), ``timeline.plot_timeline``, ``comm.plot_comm_by_op``,
``imbalance.plot_imbalance`` (plotly figures); ``common`` holds what they share (colours, escaping,
static assets, and the Jinja2 environment that renders ``templates/``: one template per view's HTML and
the report's page, their shared pieces in ``macros.html``), ``bundle`` what a widget leaves in a notebook (the
widget, a static HTML rendering, text and a versioned payload). The data each draws comes from
``Trace.get_*()`` and ``sharddbg.analysis`` (pure, tested on golden traces without a browser); a view
only lays it out. The standalone HTML report is ``sharddbg.exporters.html_report``.
"""
