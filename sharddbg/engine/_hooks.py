"""Install / restore attribute patches, always in reverse order and always completely.

Every change the recorder makes to torch or physicsnemo goes through one ``Patches`` object, so that
"restore on exit, also after an exception" is one loop in one place.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

_MISSING = object()


class Patches:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
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

    def add_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def replace_globals(self, replacements: dict[int, tuple[Any, Any]], package: str) -> list[str]:
        """Rebind every module-global name in ``package`` that holds one of the originals (by identity).

        ``replacements``: id(original) -> (original, replacement). Needed because functions are called
        through the module they were imported into: ``linear_patches`` did ``from ..shard_tensor import
        _torch_function_fallback_via_dtensor``, so patching only ``shard_tensor`` would miss its calls.
        """
        where = []
        for modname, mod in _modules_of(package):
            d = getattr(mod, "__dict__", None)
            if not d:
                continue
            for name, val in list(d.items()):
                hit = replacements.get(id(val))
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


_mod_cache: dict[str, tuple[int, list]] = {}


def _modules_of(package: str) -> list:
    """(name, module) of ``package`` and its submodules; rescans sys.modules only when it grew
    (a full scan of ~4000 modules costs milliseconds, paid at every recorder start otherwise)."""
    n = len(sys.modules)
    hit = _mod_cache.get(package)
    if hit is not None and hit[0] == n:
        return hit[1]
    pre = package + "."
    mods = [(k, m) for k, m in list(sys.modules.items()) if m is not None and (k == package or k.startswith(pre))]
    _mod_cache[package] = (n, mods)
    return mods
