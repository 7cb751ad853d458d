"""Exceptions that end a cell on this rank, recorded while a cluster's recording runs.

A cell can fail outside every recorded op (an IndexError in the user's own code, a collective that fails
in a plain ``dist.all_reduce``): no op hook sees that. IPython reports every exception that ends a cell
through ``shell.showtraceback``; while a recording started by ``recorder.start()`` runs, that method is
wrapped (on the shell instance, put back at stop) to record a ``CellErrorEvent`` first: the exception, the
line of the cell where it surfaced, and the recorded op where it was first seen, if any. The op errors in
that exception's chain escaped the cell; every other op error the recording saw was handled by the user's code
(``RecordingState.escaped_origins``).
"""

from __future__ import annotations

import sys
from typing import Any

from .. import clock
from ..frames import is_library_file
from .cells import cell_number, line_text
from .events import CellErrorEvent
from .state import RecordingState
from .undo import UndoLog


def cell_position(exc: BaseException) -> tuple[int | None, int | None, str | None]:
    """(cell, line, source text) of the cell statement the exception went through: the outermost frame of its
    traceback that is the user's module-level code (the cell; ``cell`` is its execution count, None when the
    code is not an IPython cell), else (None, None, None)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "<module>" and not is_library_file(code.co_filename):
            line = tb.tb_lineno
            return cell_number(code.co_filename), line, line_text(code.co_filename, line)
        tb = tb.tb_next
    return None, None, None


def innermost_user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of the user's code in the exception's traceback."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_library_file(code.co_filename):
            found = (code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


def mark_escaped(rec: RecordingState, exc: BaseException) -> None:
    """``exc`` left the user's code (it ended the cell, or the recording's ``with`` block): every recorded op
    error in its chain (``exc``, what it was raised from or while handling, and so on) escaped; the others
    were handled."""
    seen_ids: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen_ids:
            continue
        seen_ids.add(id(e))
        seen = rec.errors_seen.get(id(e))
        if seen is not None and seen.exception is e:
            rec.escaped_origins.add(seen.record["origin_seq"])
        todo += [e.__cause__, e.__context__]


def record(rec: RecordingState, exc: BaseException) -> None:
    """Keep a CellErrorEvent for ``exc`` (once per exception object) and mark the op errors it carries as
    escaped."""
    mark_escaped(rec, exc)
    seen = rec.errors_seen.get(id(exc))
    origin = seen.record["origin_seq"] if seen is not None and seen.exception is exc else None
    if any(type(ev) is CellErrorEvent and ev.exception is exc for ev in rec.buffer[-8:]):
        return
    cell, line, text = cell_position(exc)
    rec.keep(CellErrorEvent(next(rec.seq), clock.now_ns(), exc, origin, cell, line, text, rec.thread().tid,
                            innermost_user_frame(exc)))


def install(rec: RecordingState, undo: UndoLog) -> bool:
    """Wrap the IPython shell's ``showtraceback`` to record the exception that ends a cell; False when this
    process has no IPython shell (a plain script: nothing to hook)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    original = shell.showtraceback

    def showtraceback(exc_tuple: Any = None, *args, **kwargs):
        try:
            exc = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
            if isinstance(exc, BaseException) and rec.running:
                record(rec, exc)
        except Exception:  # noqa: BLE001 - recording must never hide the user's traceback
            import traceback

            rec.internal_errors.append(traceback.format_exc())
        return original(exc_tuple, *args, **kwargs)

    undo.setattr(shell, "showtraceback", showtraceback)
    return True
