"""Where in the notebook a frame lies: the IPython cell a file holds, the text of a line, and tracebacks that
name cells the way IPython does.

IPython compiles each cell to a file of its own (ipykernel: ``/tmp/ipykernel_<pid>/<hash>.py``) and keeps its
source in ``linecache``; its compiler's ``format_code_name`` says which execution count (``In[n]``) a file
belongs to. Everything here reads those on this rank, after the fact (export, an error being recorded):
nothing runs on the recorder's hot path.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from types import FrameType
from typing import Any

from ..frames import HIDE_FRAMES, is_library_file

_CELL_NAME = re.compile(r"In\s*\[\s*(\d+)\s*\]")
_cells: dict[str, int | None] = {}  # file name -> the execution count of the cell compiled to it (None: a file)


def cell_number(filename: str | None) -> int | None:
    """The execution count (``In[n]``) of the IPython cell compiled to ``filename``; None for any other file
    or when this process runs no IPython shell."""
    if not filename:
        return None
    try:
        return _cells[filename]
    except KeyError:
        pass
    number = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception:  # noqa: BLE001 - no IPython: no cells
        shell = None
    if shell is None:
        return None  # not cached: a shell may exist later
    try:
        label = shell.compile.format_code_name(filename)
    except Exception:  # noqa: BLE001 - another compiler without the method
        label = None
    if label:
        m = _CELL_NAME.search(str(label[1]))
        if m:
            number = int(m.group(1))
    _cells[filename] = number
    return number


def line_text(filename: str | None, line: int | None) -> str | None:
    """The stripped text of a source line (cells included: IPython keeps their source in linecache)."""
    if not filename or not line:
        return None
    text = linecache.getline(filename, int(line)).strip()
    return text or None


def position(filename: str | None, line: int | None, function: str | None = None) -> str | None:
    """'cell [6], line 5: `y = x + x`' for a line of a cell, 'model.py:12 in forward: `return self.conv(x)`'
    for a file, None when there is no frame."""
    if not filename:
        return None
    cell = cell_number(filename)
    text = line_text(filename, line)
    where = f"cell [{cell}], line {line}" if cell is not None else f"{filename}:{line}" + (
        f" in {function}" if function else "")
    return f"{where}: `{text}`" if text else where


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))) + os.sep  # sharddbg/


def _is_own_or_hidden(filename: str) -> bool:
    """sharddbg's own frames (left out of the tracebacks a user reads, unless SHARDDBG_DEBUG=1)."""
    return bool(HIDE_FRAMES) and os.path.realpath(filename).startswith(_OWN_DIR)


def _frame_lines(frames: list[traceback.FrameSummary]) -> list[str]:
    out = []
    for fs in frames:
        cell = cell_number(fs.filename)
        head = f"  Cell In[{cell}], line {fs.lineno}, in {fs.name}\n" if cell is not None else \
            f'  File "{fs.filename}", line {fs.lineno}, in {fs.name}\n'
        out.append(head + (f"    {fs.line.strip()}\n" if fs.line else ""))
    return out


def traceback_with_callers(exc: BaseException, caller: FrameType | None) -> str:
    """The exception's traceback as the user would read it once it reached their code: the user's frames that
    led to the call (from the outermost frame of the user's own code, ``caller`` and up), then the frames it
    was raised through; cells named ``Cell In[n]`` as IPython does, sharddbg's own frames left out."""
    stack: list[traceback.FrameSummary] = []
    if caller is not None:
        summary = traceback.StackSummary.extract(traceback.walk_stack(caller), capture_locals=False)
        stack = list(reversed(summary))  # outermost first
        first_user = next((i for i, fs in enumerate(stack) if not is_library_file(fs.filename)), len(stack))
        stack = stack[first_user:]
    raised = list(traceback.extract_tb(exc.__traceback__))
    frames = [fs for fs in stack + raised if not _is_own_or_hidden(fs.filename)]
    tail = "".join(traceback.format_exception_only(type(exc), exc))
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    head = ""
    if cause is not None and cause is not exc:
        link = ("The above exception was the direct cause of the following exception:" if exc.__cause__ is not None
                else "During handling of the above exception, another exception occurred:")
        head = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)) + f"\n{link}\n\n"
    return head + "Traceback (most recent call last):\n" + "".join(_frame_lines(frames)) + tail


def cell_and_code(frame: Any) -> tuple[int | None, str | None]:
    """(cell, line text) of a recorder frame tuple (file, line, function); (None, None) for no frame."""
    if not isinstance(frame, tuple):
        return None, None
    return cell_number(frame[0]), line_text(frame[0], frame[1])


def frame_position(frame: Any) -> str | None:
    """``position`` of a recorder frame tuple (file, line, function)."""
    if not isinstance(frame, tuple):
        return None
    return position(frame[0], frame[1], frame[2])
