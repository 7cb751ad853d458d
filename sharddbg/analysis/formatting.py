"""Plain-data formatting shared by the analyses, the views and the exporters: sizes, shapes, JSON values.

Pure functions, no torch, no plotting; one definition of each so that every view and file says the same.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..columnar import cyclic_gc_paused, numpy_huge_pages_unadvised  # noqa: F401 - the analyses' callers name them here


def is_missing(v) -> bool:
    """None, NaN or pandas NA (a scalar that was not measured); False for lists and other containers."""
    if v is None:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):  # lists, dicts, arrays: not a missing scalar
        return False


def format_bytes(n) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB; ``"—"`` when not measured."""
    if is_missing(n):
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_shape(shape) -> str:
    """``[1, 3, 16]`` -> ``"(1, 3, 16)"``, ``[5]`` -> ``"(5,)"``; ``"—"`` for no shape."""
    if shape is None or (isinstance(shape, float) and math.isnan(shape)):
        return "—"
    return "(" + ", ".join(str(int(x)) for x in shape) + ("," if len(shape) == 1 else "") + ")"


def json_value(v):
    """A DataFrame cell as strict JSON accepts it: NaN / pandas NA -> None, numpy scalars -> Python,
    containers converted element by element (dict keys as strings)."""
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    if is_missing(v):
        return None
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def format_location(user_frame, user_cell=None, user_code=None) -> str | None:
    """Where the user's code made a call, as a notebook reads it: ``"cell [6], line 5: `y = x + x`"`` for a
    line of a notebook cell (``user_cell``: the notebook's execution count), ``"cell sent by cl.run, line 5"``
    for code sent from a plain script, ``"model.py:12 in forward: `return self.conv(x)`"`` for a file; None
    when no user frame was recorded. ``user_frame`` is the recorder's ``"cell [6], line 5 in <module>"`` or
    ``"file:line in function"``."""
    if is_missing(user_frame) or not isinstance(user_frame, str):
        return None
    code = None if is_missing(user_code) else str(user_code)
    if user_frame.startswith("cell "):  # the recorder named the cell already
        text = user_frame.rpartition(" in ")[0] or user_frame
        return f"{text}: `{code}`" if code else text
    where = user_frame.rpartition(" in ")[0] or user_frame  # "file:line"
    line = where.rpartition(":")[2]
    code = None if is_missing(user_code) else str(user_code)
    if not is_missing(user_cell) and line.isdigit():
        text = f"cell [{int(user_cell)}], line {line}"
    else:
        text = user_frame
    return f"{text}: `{code}`" if code else text


def ranks_text(ranks) -> str:
    """``[0]`` -> ``rank 0``; ``[0, 1, 2, 3]`` -> ``ranks 0-3``; ``[0, 1, 3]`` -> ``ranks 0-1,3``."""
    ranks = sorted(int(r) for r in ranks)
    if not ranks:
        return "no rank"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"



