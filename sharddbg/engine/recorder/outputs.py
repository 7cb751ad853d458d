"""Kept outputs: what ``Cluster.diff`` compares, taken from the recorder while the statement runs.

Off unless a diff sets ``RecordingState.outputs`` to an ``OutputKeeper``; then ``ops.end`` hands it every
forward op the user's code called itself (depth 0, the recording's first thread). The keeper keeps a copy
of each output (the local data of a ShardTensor or DTensor, with its spec; a plain tensor whole), the
earlier outputs and parameters among the op's arguments, and, through a pre-hook on the autograd node
behind the output, the gradient the backward brings to it. Ops nested inside another op (a handler's own
ops, its collectives) have no single-device partner: they are counted, not kept.

Memory is counted as it goes: past ``max_bytes`` on this rank the keeper keeps no more data, only the
sizes, so that the diff can say what it would need and refuse before anything else moves.
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .tensors import result_tensors

STATEMENT_SITE = "<statement>"  # how a site in the diffed statement is named on both sides
# Tests only: (op name, rank or None) makes the keeper add 1 to that op's output on that rank after it ran, a
# result sharddbg itself breaks (what ``blame=True`` must tell apart from the user's own failures).
TEST_CORRUPTION: tuple | None = None


CELL_SITE = "cell"  # code with no file on disk: a notebook cell's, or a function carried by value


def site_of(frame: tuple | None, stmt: str) -> tuple[str, int, str] | None:
    """A call site both sides name alike: (file, line, function) with the statement's own lines as
    ``STATEMENT_SITE`` (a cell on the ranks, ``<statement>`` in the reference), a file by its name, and code
    with no file on disk as ``CELL_SITE`` (a cell's functions reach the reference by value, under another
    file name: their function name and line tell them apart)."""
    if not frame:
        return None
    filename, line, function = frame
    if filename == STATEMENT_SITE:
        return (STATEMENT_SITE, int(line), function)
    if "".join(linecache.getlines(filename)).strip() == stmt.strip():
        return (STATEMENT_SITE, int(line), function)
    if not os.path.isfile(filename):
        return (CELL_SITE, int(line), function)
    return (os.path.basename(filename), int(line), function)


@dataclass
class KeptTensor:
    """One tensor as the keeper holds it: the local data (a copy), the spec it had (None: a plain tensor),
    and the distributed tensor itself where its value is a sum over ranks (Partial)."""

    local: Any
    spec: Any = None
    partial: Any = None


@dataclass
class KeptOp:
    """One op call of the user's code, forward: where, what, its outputs, and its gradient once the
    backward reached it."""

    seq: int
    op: str
    frame: tuple | None  # the user's frame as the recorder found it (file, line, function)
    site: tuple | None  # the same as both sides name it (``site_of``)
    module: str | None
    occurrence: int  # 1 for the first call of this op at this site
    outputs: list[KeptTensor]
    sources: list[str]  # the earlier kept ops ("op:<key>") and parameters ("param:<name>") among its arguments
    grad: KeptTensor | None = None
    nbytes: int = 0
    global_bytes: int = 0
    caller: int | None = None  # the statement's line that led to a call made in a function of the user's

    @property
    def key(self) -> str:
        """How both sides name this call: site, op and occurrence."""
        return op_key(self.site, self.op, self.occurrence)


def op_key(site: tuple | None, op: str, occurrence: int) -> str:
    """'<statement>:1:<module>|torch.conv2d|2': the key matched between the ranks and the reference."""
    where = ":".join(str(s) for s in site) if site else "?"
    return f"{where}|{op}|{occurrence}"


def _spec_of(t: Any, shard_tensor_cls: type | None) -> Any:
    from torch.distributed.tensor import DTensor

    if shard_tensor_cls is not None and isinstance(t, shard_tensor_cls):
        return t._spec
    if isinstance(t, DTensor):
        return t._spec
    return None


def keep_tensor(t: Any, shard_tensor_cls: type | None) -> tuple[KeptTensor, int, int]:
    """(the kept copy, its bytes on this rank, the bytes of the whole tensor)."""
    from torch.distributed.tensor import Partial

    spec = _spec_of(t, shard_tensor_cls)
    with torch.no_grad():
        if spec is None:
            local = t.detach().clone()
            return KeptTensor(local), local.numel() * local.element_size(), local.numel() * local.element_size()
        local = t._local_tensor.detach().clone()
        partial = t.detach() if any(isinstance(p, Partial) for p in spec.placements) else None
    whole = 1
    for s in (spec.tensor_meta.shape if spec.tensor_meta is not None else local.shape):
        whole *= int(s)
    return KeptTensor(local, spec, partial), local.numel() * local.element_size(), whole * local.element_size()


@dataclass
class OutputKeeper:
    """Kept outputs of one diff on this rank (see the module docstring). ``select``: which ops to keep, by
    name (None: all); ``params``: id of a parameter -> its name; ``stmt``: the statement, to name its sites;
    ``corrupt``: a test's way to make the recorder itself break a result (op name, rank or None for every
    rank): the op's local output is changed in place after it ran, as a recorder bug would."""

    select: Callable[[str], bool] | None
    params: dict
    stmt: str
    max_bytes: int
    rank: int = 0
    corrupt: tuple | None = None
    kept: list[KeptOp] = field(default_factory=list)
    seen: dict = field(default_factory=dict)  # op name -> calls seen at depth 0 (kept or not)
    nested: dict = field(default_factory=dict)  # op name -> calls inside other ops (no single-device partner)
    counts: dict = field(default_factory=dict)  # (site, op) -> calls so far
    produced: dict = field(default_factory=dict)  # id(output) -> (weakref to it, key of its op)
    nbytes: int = 0  # what is kept here
    needed: int = 0  # what keeping everything selected would take here
    global_bytes: int = 0  # the whole tensors of everything selected (what the reference keeps)
    over_limit: bool = False
    handles: list = field(default_factory=list)
    shard_tensor_cls: type | None = None
    statement_files: dict = field(default_factory=dict)  # file name -> whether it holds the statement

    def _is_statement(self, filename: str) -> bool:
        known = self.statement_files.get(filename)
        if known is None:
            known = self.statement_files[filename] = filename == STATEMENT_SITE or \
                "".join(linecache.getlines(filename)).strip() == self.stmt.strip()
        return known

    def statement_line(self) -> int | None:
        """The line of the statement that the running op was reached from: its outermost frame in the statement
        (a call inside a function of the user's has the function's own line as its site; this says which line of
        the statement called it)."""
        line = None
        f = sys._getframe(1)
        while f is not None:
            if self._is_statement(f.f_code.co_filename):
                line = f.f_lineno
            f = f.f_back
        return line

    def after_op(self, ev: Any, res: Any, args: tuple | None, kwargs: dict | None) -> None:
        """``ops.end`` for the event ``ev`` of a call that returned ``res``."""
        if ev.parent is not None or ev.phase != "forward" or ev.thread != 0:
            if ev.phase == "forward":
                self.nested[ev.op] = self.nested.get(ev.op, 0) + 1
            return
        outs = result_tensors(res)
        if not outs or ev.path == "python_method":  # ShardTensor's own methods: no single-device partner
            if ev.path == "python_method":
                self.nested[ev.op] = self.nested.get(ev.op, 0) + 1
            return
        self.seen[ev.op] = self.seen.get(ev.op, 0) + 1
        site = site_of(ev.frame, self.stmt)
        count = self.counts[(site, ev.op)] = self.counts.get((site, ev.op), 0) + 1
        if self.select is not None and not self.select(ev.op):
            return
        if self.corrupt is not None and self.corrupt[0] == ev.op and self.corrupt[1] in (None, self.rank):
            with torch.no_grad():
                target = outs[0]._local_tensor if self.shard_tensor_cls and isinstance(
                    outs[0], self.shard_tensor_cls) else outs[0]
                target.add_(1.0)
        kept = KeptOp(ev.seq, ev.op, ev.frame, site, ev.module, count, [], self._sources(args, kwargs))
        if site is not None and (site[0] != STATEMENT_SITE or site[2] != "<module>"):
            kept.caller = self.statement_line()
        total = whole = 0
        copies = []
        for t in outs:
            copy, size, global_size = keep_tensor(t, self.shard_tensor_cls) if not self.over_limit else (None, 0, 0)
            if copy is None:
                size, global_size = _sizes(t, self.shard_tensor_cls)
            copies.append(copy)
            total += size
            whole += global_size
        self.needed += total
        self.global_bytes += whole
        if self.over_limit or self.nbytes + total > self.max_bytes:
            self.over_limit = True
            return
        kept.outputs = copies
        kept.nbytes, kept.global_bytes = total, whole
        self.nbytes += total
        self.kept.append(kept)
        for t in outs:
            self.produced[id(t)] = (weakref.ref(t), kept.key)
        self._hook_gradient(kept, outs[0])

    def _sources(self, args: tuple | None, kwargs: dict | None) -> list[str]:
        found = []
        for a in list(args or ()) + list((kwargs or {}).values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if not isinstance(t, torch.Tensor):
                    continue
                produced = self.produced.get(id(t))
                if produced is not None and produced[0]() is t:
                    found.append("op:" + produced[1])
                elif id(t) in self.params:
                    found.append("param:" + self.params[id(t)])
        return list(dict.fromkeys(found))

    def _hook_gradient(self, kept: KeptOp, out: Any) -> None:
        node = out.grad_fn
        if node is None:
            return
        index = out.output_nr
        keeper = self

        def pre_hook(grad_outputs):
            grad = grad_outputs[index] if index < len(grad_outputs) else None
            if grad is not None and kept.grad is None and not keeper.over_limit:
                kept.grad, size, _ = keep_tensor(grad, keeper.shard_tensor_cls)
                keeper.nbytes += size
            return None

        self.handles.append(node.register_prehook(pre_hook))

    def close(self) -> None:
        """Remove the gradient hooks and forget the outputs' identities (the copies stay)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.produced.clear()


def _sizes(t: Any, shard_tensor_cls: type | None) -> tuple[int, int]:
    """(bytes on this rank, bytes of the whole tensor) of ``t``, without copying."""
    spec = _spec_of(t, shard_tensor_cls)
    local = t._local_tensor if spec is not None else t
    size = local.numel() * local.element_size()
    if spec is None or spec.tensor_meta is None:
        return size, size
    whole = 1
    for s in spec.tensor_meta.shape:
        whole *= int(s)
    return size, whole * local.element_size()
