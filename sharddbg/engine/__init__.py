"""What runs inside each rank. In a %px cell: ``sharddbg.engine.scatter(...)``, ``without_patches(...)``.

Attributes are loaded on first use so that importing the client side never imports torch.
"""

_LAZY = {
    "scatter": ("_scatter", "scatter"),
    "ScatterError": ("_scatter", "ScatterError"),
    "BatchPerDomainGroupWarning": ("_scatter", "BatchPerDomainGroupWarning"),
    "domain_mesh": ("_scatter", "domain_mesh"),
    "without_patches": ("patches", "without_patches"),
    "Recorder": ("recorder", "Recorder"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
