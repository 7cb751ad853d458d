"""The shard inspector widget: a block diagram of who holds which slice, the per-rank table, the checks.

``ShardInspector(layout)``: an anywidget over :class:`sharddbg.analysis.layout.ShardLayout`. The data it
draws is ``layout.to_json()`` (tested without a browser); the front end (``_static/inspector.js``)
only lays it out. ``pair`` (synced) is the index of the two tensor dims drawn.
"""

from __future__ import annotations

import anywidget
import pandas as pd
import traitlets

from ..analysis.layout import ShardLayout
from .common import static


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

    def __repr__(self) -> str:  # text/plain: terminals and plain IPython
        return self.shard_layout.text()
