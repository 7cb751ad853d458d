"""The undo stack of one recording: every change the recorder makes to torch or physicsnemo is logged here, so
that "put everything back on exit, also after an exception" is one loop in one place, newest change first."""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

_MISSING = object()


class UndoLog:
    """Changes to undo, newest last. ``restore()`` undoes all of them, whatever fails on the way."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, undone by putting back what ``obj`` itself held (or deleting it)."""
        # Read from __dict__ (not getattr) so a classmethod object is restored as the classmethod,
        # not as a bound method.
        d = obj.__dict__ if isinstance(obj, type) else vars(obj)
        old = d.get(name, _MISSING)
        setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(undo)

    def add(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` at restore time (removing a hook handle, a library, ...)."""
        self._undo.append(undo)

    def replace_globals(self, replacements: Iterable[tuple[Any, Any]], package: str) -> list[str]:
        """Rebind every module-global name in ``package`` that holds one of the originals (by identity).

        ``replacements``: (original, replacement) pairs. Needed because functions are called through the
        module they were imported into: ``linear_patches`` did ``from ..shard_tensor import
        _torch_function_fallback_via_dtensor``, so patching only ``shard_tensor`` would miss its calls.
        Returns the rebound names, ``module.name``.
        """
        by_id = {id(orig): (orig, repl) for orig, repl in replacements}
        where = []
        for modname, mod in _modules_of(package):
            d = getattr(mod, "__dict__", None)
            if not d:
                continue
            for name, val in list(d.items()):
                hit = by_id.get(id(val))
                if hit is not None and hit[0] is val:
                    self.setattr(mod, name, hit[1])
                    where.append(f"{modname}.{name}")
        return where

    def restore(self) -> list[BaseException]:
        """Undo everything (newest first). Keeps going past failures and returns them."""
        errors = []
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - restoring must not stop half way
                errors.append(e)
        return errors


_modules_seen: dict[str, tuple[int, list]] = {}  # package -> (len(sys.modules) when scanned, its modules)


def _modules_of(package: str) -> list:
    """(name, module) of ``package`` and its submodules; rescans sys.modules only when it grew
    (a full scan of ~4000 modules costs milliseconds, paid at every recorder start otherwise)."""
    n = len(sys.modules)
    hit = _modules_seen.get(package)
    if hit is not None and hit[0] == n:
        return hit[1]
    pre = package + "."
    mods = [(k, m) for k, m in list(sys.modules.items()) if m is not None and (k == package or k.startswith(pre))]
    _modules_seen[package] = (n, mods)
    return mods
