"""Where in the notebook a frame lies: the IPython cell a file holds, the text of a line, and tracebacks that
name cells the way IPython does.

IPython compiles each cell to a file of its own (ipykernel: ``/tmp/ipykernel_<pid>/<hash>.py``) and keeps its
source in ``linecache``; its compiler's ``format_code_name`` says which execution count (``In[n]``) a file
belongs to. Everything here reads those on this rank, after the fact (export, an error being recorded):
nothing runs on the recorder's hot path.

A rank's own execution count means nothing to the user (each engine counts the cells it was sent): the client
sends the notebook's execution count of the cell that sent the code in the execute request's metadata
(``NOTEBOOK_CELL_KEY``), and ``install_notebook_cells`` makes this rank's compiler name each cell file by that
number, so that IPython's own tracebacks ("Cell In[7], line 5") and everything here name the notebook's cell.
Code sent without one (``cl.run`` from a plain script) is "the cell sent by cl.run" (``SENT_CELL``), never a
rank's count.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import traceback
from types import FrameType
from typing import Any

from ..frames import HIDE_FRAMES, is_library_file
from ..requests import NOTEBOOK_CELL_KEY

_CELL_NAME = re.compile(r"In\s*\[\s*(\d+)\s*\]")
_cells: dict[str, int | None] = {}  # file name -> the notebook's count of the cell compiled to it (None: a file)

# how a cell that came without a notebook count (cl.run from a plain script) is named
SENT_CELL = "cell sent by cl.run"
# this rank's cell files -> the notebook's execution count of the cell that sent each (None: none was sent)
_notebook_cells: dict[str, int | None] = {}


def install_notebook_cells(shell: Any) -> bool:
    """Make ``shell``'s compiler name every cell file by the notebook's execution count sent with it.

    Parameters
    ----------
    shell : IPython.core.interactiveshell.InteractiveShell
        This rank's shell (ipyparallel's engine kernel sets its ``parent_header`` to the execute request).

    Returns
    -------
    bool
        True when installed now, False when it already was.

    Examples
    --------
    >>> from IPython.core.interactiveshell import InteractiveShell
    >>> install_notebook_cells(InteractiveShell.instance()) in (True, False)
    True
    """
    compiler = shell.compile
    if getattr(compiler, "_sharddbg_notebook_cells", False):
        return False
    cache, format_code_name = compiler.cache, compiler.format_code_name

    def cache_with_notebook_cell(transformed_code, number=0, raw_code=None):
        name = cache(transformed_code, number, raw_code)
        parent = getattr(shell, "parent_header", None) or {}
        sent = (parent.get("metadata") or {}).get(NOTEBOOK_CELL_KEY) if isinstance(parent, dict) else None
        _notebook_cells[name] = int(sent) if isinstance(sent, int) and not isinstance(sent, bool) else None
        _cells.pop(name, None)
        return name

    def notebook_code_name(name):
        if name in _notebook_cells:  # never the rank's own count
            number = _notebook_cells[name]
            return ("Cell", f"In[{number}]") if number is not None else ("Cell", SENT_CELL.removeprefix("cell "))
        return format_code_name(name)

    compiler.cache = cache_with_notebook_cell
    compiler.format_code_name = notebook_code_name
    compiler._sharddbg_notebook_cells = True
    return True


def is_cell_file(filename: str | None) -> bool:
    """True for a file IPython compiled a cell of this process to (numbered or not)."""
    if not filename:
        return False
    if filename in _notebook_cells:
        return True
    try:
        shell = _shell()
        return shell is not None and shell.compile.format_code_name(filename) is not None
    except Exception:  # noqa: BLE001 - another compiler
        return False


def cell_name(filename: str | None) -> str | None:
    """How a user reads the cell compiled to ``filename``: "cell [7]" (the notebook's count), "cell sent by
    cl.run" (code sent without one); None for any other file."""
    number = cell_number(filename)
    if number is not None:
        return f"cell [{number}]"
    return SENT_CELL if is_cell_file(filename) else None


def cell_number(filename: str | None) -> int | None:
    """The notebook's execution count (``In[n]``) of the IPython cell compiled to ``filename``; None for any
    other file, for a cell sent without one, or when this process runs no IPython shell."""
    if not filename:
        return None
    if filename in _notebook_cells:
        return _notebook_cells[filename]
    try:
        return _cells[filename]
    except KeyError:
        pass
    number = None
    shell = _shell()
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


def _shell() -> Any:
    """This process's IPython shell, or None. Read from the module IPython keeps it in, without importing
    anything: a process that never imported IPython runs no shell, and a recorded job's stream asks this for
    every event it writes."""
    getipython = sys.modules.get("IPython.core.getipython")
    if getipython is None:
        return None
    try:
        return getipython.get_ipython()
    except Exception:  # noqa: BLE001 - a half-imported IPython: no shell
        return None


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
    cell = cell_name(filename)
    text = line_text(filename, line)
    where = f"{cell}, line {line}" if cell is not None else f"{filename}:{line}" + (
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
        if cell is not None:
            head = f"  Cell In[{cell}], line {fs.lineno}, in {fs.name}\n"
        elif is_cell_file(fs.filename):
            head = f"  Cell {SENT_CELL.removeprefix('cell ')}, line {fs.lineno}, in {fs.name}\n"
        else:
            head = f'  File "{fs.filename}", line {fs.lineno}, in {fs.name}\n'
        # a library's frame is one line: the user's own lines stand out (SHARDDBG_DEBUG=1: every line)
        shown = fs.line and not (HIDE_FRAMES and is_library_file(fs.filename))
        out.append(head + (f"    {fs.line.strip()}\n" if shown else ""))
    return out


def frame_label(frame: Any) -> str | None:
    """'cell [7], line 5 in <module>' for a recorder frame tuple (file, line, function) in a cell, 'model.py:12
    in forward' for a file; None for no frame."""
    if not isinstance(frame, tuple):
        return frame if isinstance(frame, str) else None
    cell = cell_name(frame[0])
    return f"{cell}, line {frame[1]} in {frame[2]}" if cell is not None else f"{frame[0]}:{frame[1]} in {frame[2]}"


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
