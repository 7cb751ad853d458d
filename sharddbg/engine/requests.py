"""What the client's execute requests carry for the ranks beside the code (torch-free: the client imports it).

``NOTEBOOK_CELL_KEY``: the request metadata key holding the notebook's execution count of the cell that sent
the code; each rank names the cell by it (``engine.recorder.cells``), not by its own count.
"""

from __future__ import annotations

NOTEBOOK_CELL_KEY = "sharddbg_notebook_cell"
