"""Views: widgets and plotly figures over a Trace or a ShardLayout. They never touch an engine.

``inspector.ShardInspector`` (the shard inspector widget), ``explorer.TraceExplorer`` (the trace
explorer widget), ``timeline`` (plotly figures: timeline, comm by op, imbalance), ``report.to_html``
(one standalone offline HTML file). Each view's data comes from a pure function next to it
(``*_data`` / ``*_frame``), tested on golden traces without a browser.
"""
