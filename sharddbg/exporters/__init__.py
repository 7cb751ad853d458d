"""Files written from a Trace, one module per format.

``perfetto`` (Chrome trace-event JSON for ui.perfetto.dev; ``Trace.to_perfetto``) needs only the data
layer; ``html_report`` (one standalone offline HTML file with every view; ``Trace.to_html``) draws the
views and imports plotly, so it is imported only when a report is written.
"""
