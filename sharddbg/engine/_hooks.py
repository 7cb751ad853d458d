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

    def replace_global_everywhere(self, original: Any, replacement: Any, package: str = "physicsnemo") -> list[str]:
        """Rebind every module-global name in ``package`` that holds ``original`` (by identity).

        Needed because functions are called through the module they were imported into: e.g.
        ``linear_patches`` did ``from ..shard_tensor import _torch_function_fallback_via_dtensor``,
        so patching only ``shard_tensor`` would miss its calls.
        """
        where = []
        for modname, mod in list(sys.modules.items()):
            if mod is None or not (modname == package or modname.startswith(package + ".")):
                continue
            d = getattr(mod, "__dict__", None)
            if not d:
                continue
            for name, val in list(d.items()):
                if val is original:
                    self.setattr(mod, name, replacement)
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
