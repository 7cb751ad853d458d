"""Pre-flight for collectives: before a collective inside a recorded op is issued, the ranks of its group
compare what each is about to send, through the rendezvous store, so that a mismatch is named instead of
hanging.

Ranks that issue one collective with different sizes hang in it (gloo, NCCL) or fail with a message that
names neither the op nor the ranks. With ``Recorder(preflight=True)`` each rank writes a short description of
the collective (kind, dtype, shape of its buffer, bytes to and from each peer) to the store under the
collective's place in the trace (process group, ``group_seq``), waits at most ``PREFLIGHT_TIMEOUT_S`` for the
other ranks' descriptions and compares them all (``compare``, a pure function). Every rank of the group sees
the same descriptions, so every rank reaches the same verdict: on a mismatch each raises
``CollectiveMismatchError`` naming the ranks and the sizes ("rank 2 sends (1, 4, 16, 64), the others (1, 4,
17, 64)") and the collective is never issued. A rank whose description is late does not stop the others:
they issue the collective unchecked (status "late"), and the late rank, which finds every description
there, still reaches its verdict. The check waits on the store only, with a time limit: it cannot hang.

Point-to-point send / recv are not compared (their pairing is not by group_seq): status "unchecked".
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from ...errors import ShardDbgError
from .events import CollectiveEvent

PREFLIGHT_TIMEOUT_S = 2.0  # the longest a rank waits for the others' descriptions

# kinds whose buffer has the same shape on every rank of the group
SAME_SHAPE_KINDS = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather",
                              "all_gather_into_tensor_coalesced", "all_gather_coalesced", "reduce_scatter_tensor",
                              "reduce_scatter", "reduce_scatter_tensor_coalesced", "reduce", "broadcast", "gather",
                              "scatter"})
SPLIT_KINDS = frozenset({"all_to_all_single", "all_to_all"})
UNCHECKED_KINDS = frozenset({"send", "recv"})


class CollectiveMismatchError(ShardDbgError):
    """The ranks of a group were about to issue one collective with sizes, dtypes or kinds that do not match
    (raised by every rank of the group, before the collective, when preflight is on)."""


class PreflightResult:
    """What this rank found (schema.PREFLIGHT_FIELDS at export)."""

    __slots__ = ("status", "ms", "detail", "late_ranks")

    def __init__(self, status: str, ms: float, detail: str | None = None, late_ranks: list[int] | None = None) -> None:
        self.status = status  # schema.PREFLIGHT_STATUSES
        self.ms = ms
        self.detail = detail
        self.late_ranks = late_ranks or []


def shape_text(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _odd_ones(values: dict[int, Any], verb: str, show=str) -> str | None:
    """'rank 2 sends (16,), the others (17,)' when the ranks disagree on a value (the most common value is the
    others'; on a tie, the lowest rank's), else None."""
    counts = Counter(json.dumps(v) for v in values.values())
    if len(counts) < 2:
        return None
    top = max(counts.values())
    usual = next(json.dumps(values[r]) for r in sorted(values) if counts[json.dumps(values[r])] == top)
    parts = []
    for text in sorted(set(counts) - {usual}, key=lambda t: min(r for r in values if json.dumps(values[r]) == t)):
        ranks = sorted(r for r in values if json.dumps(values[r]) == text)
        v = json.loads(text)
        parts.append(f"{_ranks_text(ranks)} {verb if len(ranks) == 1 else verb.removesuffix('s')} {show(v)}")
    others = json.loads(usual)
    return ", ".join(parts) + f", the others {show(others)}"


def compare(descriptions: dict[int, dict], group_ranks: list[int]) -> str | None:
    """What the ranks' descriptions of one collective disagree on, in one line; None when they match.
    ``descriptions``: global rank -> {"kind", "dtype", "shape", "splits_sent", "splits_recv"} (splits in bytes
    per group rank, all_to_all only)."""
    problem = _odd_ones({r: d["kind"] for r, d in descriptions.items()}, "issues")
    if problem:
        return problem
    kind = next(iter(descriptions.values()))["kind"]
    problem = _odd_ones({r: d["dtype"] for r, d in descriptions.items()}, "sends")
    if problem:
        return problem
    if kind in SAME_SHAPE_KINDS:
        shapes = {r: d["shape"] for r, d in descriptions.items() if d["shape"] is not None}
        return _odd_ones(shapes, "sends", shape_text)
    if kind in SPLIT_KINDS:
        index = {r: i for i, r in enumerate(group_ranks)}
        for src in group_ranks:
            sent = descriptions[src]["splits_sent"]
            if sent is None:
                continue
            for dst in group_ranks:
                recv = descriptions[dst]["splits_recv"]
                if recv is None:
                    continue
                if sent[index[dst]] != recv[index[src]]:
                    return (f"rank {src} sends {sent[index[dst]]} bytes to rank {dst}, which expects "
                            f"{recv[index[src]]} bytes from rank {src}")
    return None


def describe(ev: CollectiveEvent, counted: Any) -> dict:
    """This rank's description of the collective ``ev`` about to be issued (``counted``: its CommBytes)."""
    t = counted.first_tensor
    return {"kind": ev.spec.kind,
            "dtype": str(t.dtype).removeprefix("torch.") if t is not None else None,
            "shape": [int(d) for d in t.shape] if t is not None else None,
            "splits_sent": counted.splits_sent, "splits_recv": counted.splits_recv}


class Preflight:
    """The pre-flight of one recording: its store keys start with ``sharddbg/preflight/<token>`` (the same
    token on every rank of one recording)."""

    def __init__(self, token: str, rank: int, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
        self.prefix = f"sharddbg/preflight/{token}"
        self.rank = rank
        self.timeout_s = min(float(timeout_s), PREFLIGHT_TIMEOUT_S)
        self._store = None
        self.written: dict[str, list[int]] = {}  # group name -> group_seqs of this rank's keys still in the store

    def store(self):
        if self._store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        return self._store

    @staticmethod
    def arrived(store, keys: list[str], deadline: float) -> bool:
        """Every key is in the store before ``deadline`` (``time.perf_counter()``). Polled, with a pause that
        doubles from 20 us to 2 ms: the store's own wait logs a warning on every rank when its time runs out."""
        pause = 20e-6
        while not store.check(keys):
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 2e-3)
        return True

    def release(self) -> None:
        """Delete this rank's keys still in the store (the recording stopped: the group's checks are over)."""
        if self._store is None:
            return
        for name, seqs in self.written.items():
            for seq in seqs:
                self._store.delete_key(self.key(name, seq, self.rank))
        self.written.clear()

    def key(self, group: str, group_seq: int, rank: int) -> str:
        return f"{self.prefix}/{group}/{group_seq}/{rank}"

    def check(self, ev: CollectiveEvent, args: tuple, kwargs: dict) -> PreflightResult:
        """Describe ``ev`` (about to be issued with ``args`` / ``kwargs``) to the group, wait for the others'
        descriptions and compare."""
        t0 = time.perf_counter()
        s = ev.spec
        ranks = ev.group.ranks
        if s.kind in UNCHECKED_KINDS or not ranks:
            why = "point-to-point" if s.kind in UNCHECKED_KINDS else "the group's ranks are unknown"
            return PreflightResult("unchecked", 0.0, why)
        values = dict(zip(s.arg_names, args))
        values.update(kwargs)
        counted = s.count_bytes(values, ranks, self.rank)
        store = self.store()
        name, seq = ev.group.name, ev.group_seq
        store.set(self.key(name, seq, self.rank), json.dumps(describe(ev, counted)))
        written = self.written.setdefault(name, [])
        written.append(seq)
        keys = [self.key(name, seq, r) for r in ranks]
        if not self.arrived(store, keys, t0 + self.timeout_s):
            late = [r for r, k in zip(ranks, keys) if not store.check([k])]
            return PreflightResult("late", (time.perf_counter() - t0) * 1e3,
                                   f"{_ranks_text(late)} had not described it within {self.timeout_s:g} s; "
                                   "issued unchecked", late)
        found = {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
        # Every rank of the group wrote this collective's key, so each has finished reading the one before the
        # previous: this rank's keys up to that one can go (not the previous one's: an async collective lets a
        # rank run ahead while a peer still reads it).
        while len(written) > 2:
            store.delete_key(self.key(name, written.pop(0), self.rank))
        problem = compare(found, ranks)
        ms = (time.perf_counter() - t0) * 1e3
        if problem is None:
            return PreflightResult("ok", ms)
        return PreflightResult("mismatch", ms, problem)


def mismatch_message(ev: CollectiveEvent, detail: str) -> str:
    """The error every rank of the group raises for a mismatch found before ``ev``."""
    where = f" in {ev.op.op}" if ev.op is not None else ""
    group = ev.group.mesh_dim or ev.group.name
    return (f"{ev.spec.kind} on process group '{group}' (collective {ev.group_seq} of this trace on it){where}: "
            f"{detail}. sharddbg's pre-flight stopped it before it was issued: with these sizes it would hang "
            f"or fail on every rank of the group {ev.group.ranks}.")
