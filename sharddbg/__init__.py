"""sharddbg: see inside domain-parallel PyTorch (PhysicsNeMo ShardTensor, DTensor) from one notebook.

Public surface: ``Cluster``, ``engine`` (helpers for code running on the ranks), ``record``,
``last_trace``, ``load_trace``, ``inspect``, and ``%load_ext sharddbg``. Importing this package is cheap:
torch is imported only where tensors live (the engines).
"""

__version__ = "0.1.0"

_LAZY = {
    "Cluster": ("sharddbg.cluster", "Cluster"),
    "active_cluster": ("sharddbg.cluster", "active_cluster"),
    "load_trace": ("sharddbg.trace", "load_trace"),
    "Trace": ("sharddbg.trace", "Trace"),
}


def __getattr__(name):
    import importlib

    if name == "engine":
        return importlib.import_module("sharddbg.engine")
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'sharddbg' has no attribute {name!r}")


def record(*args, **kwargs):
    """On one rank, in a plain script: ``with sharddbg.record() as rec: ...``; ``rec.events`` afterwards."""
    from .engine.recorder import Recorder

    return Recorder(*args, **kwargs)


def last_trace():
    """The Trace of the last ``%%shard_trace`` / ``Cluster.trace`` on the active cluster."""
    from .cluster import active_cluster

    return active_cluster().last_trace()


def inspect(name: str, **kwargs):
    """The shard inspector for the ShardTensor named ``name`` on the active cluster's ranks."""
    from .cluster import active_cluster

    return active_cluster().inspect(name, **kwargs)


def load_ipython_extension(ipython):
    from .magics import load_ipython_extension as _load

    _load(ipython)


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + ["engine"])
