"""Run a callback once a module has been imported by someone else, without importing it ourselves.

A recorded job hooks physicsnemo's ShardTensor only if the user's code imports it: a finder first in
``sys.meta_path`` lets the normal finders find the module, and wraps its loader's ``exec_module`` so that the
callback runs right after the module's code ran (before the importer gets the module).
"""

from __future__ import annotations

import importlib.abc
import sys
import traceback
from typing import Callable

from .undo import UndoLog


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``name``, asks the finders after it and wraps the loader they return."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self.done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        watch = self

        def exec_module(module):
            original(module)
            if not watch.done:
                watch.done = True
                try:
                    watch.callback()
                except Exception:  # noqa: BLE001 - never break the user's import
                    traceback.print_exc()

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader whose attributes are read-only: not watched
            return spec
        return spec


def when_imported(name: str, callback: Callable[[], None], undo: UndoLog) -> None:
    """``callback()`` now if module ``name`` is imported already, else right after it is; the watch is
    removed by ``undo``."""
    if name in sys.modules:
        callback()
        return
    finder = _AfterImport(name, callback)
    sys.meta_path.insert(0, finder)

    def remove() -> None:
        finder.done = True
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass

    undo.add(remove)
