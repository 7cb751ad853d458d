"""The shard inspector widget: a block diagram of who holds which slice, the per-rank table, the checks.

``ShardInspector(layout)``: an anywidget over :class:`sharddbg.analysis.layout.ShardLayout`. The data it
draws is ``layout.to_json()`` (tested without a browser); the front end (``_static/inspector.js``)
only lays it out. ``pair`` (synced) is the index of the two tensor dims drawn. Displayed in a notebook
it leaves one output bundle (``sharddbg.views.bundle``): the widget, ``inspector_html`` (a static
rendering), the text grid (``text()``) and the snapshots it was built from.
"""

from __future__ import annotations

import anywidget
import pandas as pd
import traitlets

from ..analysis.formatting import format_bytes, format_shape
from ..analysis.layout import ShardLayout
from .bundle import output_bundle, view_payload
from .common import render, static, table_cells


def inspector_html(layout: ShardLayout) -> str:
    """The inspector as static HTML (no script): the header, the verdict (the warnings, or that spec and
    data agree), the block diagram as a character grid, the table of ranks, the notes."""
    s0 = layout.snapshots[0]
    ranks = layout.get_ranks().assign(ok=lambda d: d["ok"].map({True: "✓", False: "⚠ mismatch"}),
                                      memory=lambda d: d["local_bytes"].map(format_bytes))
    for c in ("local_shape", "spec_local_shape", "offsets"):
        ranks[c] = ranks[c].map(lambda v: format_shape(v) if v is not None else "—")
    columns = ["rank", "coordinate", "local_shape", "spec_local_shape", "offsets", "memory", "device", "ok"]
    titles = {"coordinate": "mesh coord", "local_shape": "local shape", "spec_local_shape": "spec says",
              "offsets": "global offsets", "ok": "check"}
    return render("inspector.html", kind=layout.kind, name=layout.name, global_shape=format_shape(layout.global_shape),
                  dtype=layout.dtype, mesh=layout.mesh_text(),
                  placements=", ".join(p["text"] for p in s0.get("placements") or []) or "—",
                  ranks=len(layout.ranks), grid=layout.text_grid(),
                  rank_columns=[(c, titles.get(c, c)) for c in columns], rank_rows=table_cells(ranks, columns),
                  verdict=layout.verdict, warnings=list(layout.warnings), notes=list(layout.notes))


class ShardInspector(anywidget.AnyWidget):
    """Shard inspector for one tensor on every rank. ``shard_layout``: the data (``get_ranks()`` etc.)."""

    _esm = static("inspector.js")
    _css = static("style.css")
    data = traitlets.Dict().tag(sync=True)
    pair = traitlets.Int(0).tag(sync=True)

    def __init__(self, layout: ShardLayout, **kwargs):
        data = layout.to_json()
        super().__init__(data=data, pair=data["default_pair"], **kwargs)
        self.shard_layout = layout

    def get_ranks(self) -> pd.DataFrame:
        """One row per rank (the table the widget shows)."""
        return self.shard_layout.get_ranks()

    @property
    def warnings(self) -> list[str]:
        return list(self.shard_layout.warnings)

    def text(self) -> str:
        """The inspector as plain text: header, the block diagram as a character grid, one line per rank,
        notes and warnings (``ShardLayout.text()``)."""
        return self.shard_layout.text()

    def __repr__(self) -> str:  # text/plain: terminals and plain IPython
        return self.text()

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, a static rendering, the text and the snapshots (see ``sharddbg.views.bundle``)."""
        lay = self.shard_layout
        payload = view_payload("inspector", {"name": lay.name, "snapshots": lay.snapshots, "world_mesh": lay.world_mesh},
                               {"name": lay.name, "kind": lay.kind, "global_shape": lay.global_shape,
                                "ranks": lay.ranks, "warnings": len(lay.warnings)},
                               "cl.inspect(name) on a running cluster", drawn=self.data)
        return output_bundle(super()._repr_mimebundle_(**kwargs), html=inspector_html(lay), text=self.text(),
                             payload=payload)
