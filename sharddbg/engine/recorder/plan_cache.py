"""DTensor's redistribution plan cache, watched while recording.

DTensor keeps the plan of each redistribution in ``torch.distributed.tensor._redistribute._gen_transform_infos``,
a ``functools.cache`` keyed on the source and target specs. A cached key must not change: a spec changed
after its call (physicsnemo's ``ShardTensor.redistribute`` fills in the target spec's ``_sharding_shapes``
and ``_local_shape`` once the data has moved) no longer equals the next call's fresh spec, so the next call
misses and adds an entry. The entries keep one hash (it does not cover ``_sharding_shapes``), so every lookup
compares against all of them: a loop that redistributes each step (a Partial loss's ``backward()`` does)
slows down step after step, with or without sharddbg.

How a miss is seen at no cost to a hit: on a miss the cache calls the planner
``_gen_transform_infos_non_cached`` through its module's global; that global is rebound while recording to a
function that notes the two specs and the fields their equality reads, then plans as before. Calls of the
planner that do not come from the cache (torch calls it directly where it must not cache) are not misses.
At export a miss whose spec no longer equals what it was at the call is *stale*: the cached key changed.
"""

from __future__ import annotations

import sys
from typing import Any

from .state import RecordingState
from .undo import UndoLog

MAX_MISSES = 10_000  # kept per recording; further misses are counted only
# the fields a DTensorSpec's equality reads, and the one ShardTensorSpec adds
SPEC_FIELDS = ("placements", "tensor_meta", "shard_order", "_sharding_shapes")


class PlanCacheMiss:
    """One call that missed the plan cache: the specs (references) and their compared fields at the call."""

    __slots__ = ("source", "target", "source_fields", "target_fields", "op", "outer_op", "entries")

    def __init__(self, source: Any, target: Any, op: Any, outer_op: Any, entries: int | None) -> None:
        self.entries = entries  # the cache's size just before this call's entry went in
        self.source = source
        self.target = target
        self.source_fields = fields_of(source)
        self.target_fields = fields_of(target)
        self.op = op  # the innermost recorded OpEvent on the calling thread, or None
        self.outer_op = outer_op  # the outermost one


class PlanCacheWatch:
    """The misses of one recording (``rec.plan_cache``) and the cache's size at start and stop."""

    def __init__(self) -> None:
        self.misses: list[PlanCacheMiss] = []
        self.uncounted = 0  # misses beyond MAX_MISSES
        self.entries_start: int | None = None
        self.entries_end: int | None = None
        self.cache: Any = None  # the functools.cache object, when this torch has one
        self._record: dict | None = None

    def entries(self) -> int | None:
        return cache_entries(self.cache) if self.cache is not None else None

    def stop(self) -> None:
        self.entries_end = self.entries()

    def record(self) -> dict:
        """``meta["plan_cache"]``: made from the misses until ``release``, then the record made then."""
        return self._record if self._record is not None else export(self)

    def release(self) -> None:
        """Make the record and let go of the specs (called once the recording's events are formatted)."""
        self._record = export(self)
        self.misses = []


def cache_entries(cache: Any = None) -> int | None:
    """Entries in DTensor's plan cache (``cache``, else the one torch has) now; None where this torch has none."""
    try:
        if cache is None:
            from torch.distributed.tensor._redistribute import _gen_transform_infos as cache
        return int(cache.cache_info().currsize)
    except Exception:  # noqa: BLE001 - another torch layout or cache object
        return None


def fields_of(spec: Any) -> tuple:
    """The compared fields' values; a dict copied (a change in place must show as a change)."""
    out = []
    for name in SPEC_FIELDS:
        v = getattr(spec, name, None)
        out.append(dict(v) if type(v) is dict else v)
    return tuple(out)


def install(rec: RecordingState, undo: UndoLog) -> None:
    """Rebind the planner's global in torch's redistribute module for this recording (in ``undo``)."""
    watch = rec.plan_cache
    try:
        from torch.distributed.tensor import _redistribute as module
    except ImportError:  # another torch layout: nothing watched, nothing reported
        return
    planner = getattr(module, "_gen_transform_infos_non_cached", None)
    cache = getattr(module, "_gen_transform_infos", None)
    cached_code = getattr(getattr(cache, "__wrapped__", None), "__code__", None)
    if planner is None or cached_code is None or not callable(getattr(cache, "cache_info", None)):
        return
    watch.cache = cache
    watch.entries_start = watch.entries()

    def plan(src_spec, dst_spec, *args, **kwargs):
        # the cache's own function is the caller only on a miss
        if rec.running and sys._getframe(1).f_code is cached_code:
            if len(watch.misses) < MAX_MISSES:
                stack = rec.thread().op_stack
                watch.misses.append(PlanCacheMiss(src_spec, dst_spec, stack[-1] if stack else None,
                                                  stack[0] if stack else None, watch.entries()))
            else:
                watch.uncounted += 1
        return planner(src_spec, dst_spec, *args, **kwargs)

    plan.__wrapped__ = planner  # type: ignore[attr-defined]
    plan.__doc__ = planner.__doc__
    undo.setattr(module, "_gen_transform_infos_non_cached", plan)
    rec.installed_at.append(f"{module.__name__}._gen_transform_infos_non_cached")


def _placements_text(placements: Any) -> str:
    try:
        return ", ".join(repr(p) for p in placements)
    except TypeError:
        return str(placements)


def _changed(side: str, spec: Any, then: tuple) -> list[str]:
    now = fields_of(spec)
    out = []
    for name, a, b in zip(SPEC_FIELDS, then, now):
        try:
            same = a == b
        except Exception:  # noqa: BLE001 - values that cannot be compared: compared by identity
            same = a is b
        if not same:
            out.append(f"{side}.{name}")
    return out


def _shape_at_call(fields: tuple) -> list[int] | None:
    shape = getattr(fields[1], "shape", None)  # tensor_meta.shape when the call was made
    return [int(d) for d in shape] if shape is not None else None


def _op_name(ev: Any) -> str | None:
    if ev is None:
        return None
    return ev.op if ev.op is not None else (ev.forward.op if ev.forward is not None else None)


def _kept(watch: PlanCacheWatch) -> tuple[list[bool], int]:
    """Whether each miss's entry is still in the cache at stop, and how many clears were seen. The cache
    only grows (no eviction), so a size below the last one plus its entry means ``cache_clear()`` ran."""
    sizes = [m.entries for m in watch.misses] + [watch.entries_end]
    if any(v is None for v in sizes):
        return [True] * len(watch.misses), 0
    cleared_after = [sizes[i + 1] < sizes[i] + 1 for i in range(len(watch.misses))]
    kept = [True] * len(watch.misses)
    later_clear = False
    for i in range(len(watch.misses) - 1, -1, -1):
        later_clear = later_clear or cleared_after[i]
        kept[i] = not later_clear
    return kept, sum(cleared_after)


def export(watch: PlanCacheWatch) -> dict:
    """The payload's ``meta["plan_cache"]`` (schema.PLAN_CACHE_FIELDS): the misses grouped by (op, specs,
    changed fields) with their counts, first seen first."""
    groups: dict[tuple, dict] = {}
    stale = 0
    kept, clears = _kept(watch)
    for m, still_cached in zip(watch.misses, kept):
        changed = _changed("source", m.source, m.source_fields) + _changed("target", m.target, m.target_fields)
        if changed:
            stale += 1
        src_placements = _placements_text(m.source_fields[0])
        dst_placements = _placements_text(m.target_fields[0])
        shape = _shape_at_call(m.target_fields)
        key = (_op_name(m.op), _op_name(m.outer_op), src_placements, dst_placements,
               tuple(shape) if shape is not None else None, tuple(changed), type(m.target).__name__)
        g = groups.get(key)
        if g is None:
            groups[key] = {"op": key[0], "outer_op": key[1], "source": src_placements, "target": dst_placements,
                           "shape": shape, "spec_type": key[6], "changed": changed,
                           "first_op_seq": m.op.seq if m.op is not None else None, "count": 1,
                           "kept": int(still_cached)}
        else:
            g["count"] += 1
            g["kept"] += int(still_cached)
    return {"entries_start": watch.entries_start, "entries_end": watch.entries_end,
            "misses": len(watch.misses) + watch.uncounted, "stale_misses": stale, "clears": clears,
            "groups": list(groups.values())}
