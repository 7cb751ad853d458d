"""Names of modules and parameters, from the outermost modules a recording has seen, and the gradient
reductions they explain: which parameter a backward node accumulates into, which parameter's deferred
(Partial) gradient a collective outside every op reduces, which DDP bucket an all_reduce carries.

Names are taken when a new outermost module is first called (``name_tree``). A module whose parameters are
replaced after that (``distribute_module`` after a first call, as physicsnemo's convolution example does)
gets its new parameters named on the first lookup that misses (``refresh``), so the names never go stale.
Nothing here runs per op: only when a module tree is new, or when a gradient reduction is issued.
"""

from __future__ import annotations

import itertools
from typing import Any

from .state import RecordingState


def name_tree(rec: RecordingState, root: Any) -> None:
    """Name ``root``'s modules and parameters (a new outermost module): first names win, as before."""
    rec.roots.append(root)
    root_name = type(root).__name__
    for n, sub in root.named_modules():
        rec.module_names.setdefault(id(sub), n or root_name)
    _name_parameters(rec, root, root_name)
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001
        return
    if isinstance(root, DistributedDataParallel):
        rec.ddp_modules.append(root)


def _name_parameters(rec: RecordingState, root: Any, root_name: str) -> None:
    for n, p in itertools.chain(root.named_parameters(), root.named_buffers()):
        if rec.params.setdefault(id(p), n) == n:
            rec.param_objects[id(p)] = p  # kept: an id stays this parameter's while the name is held
            owner = n.rpartition(".")[0]
            rec.param_modules.setdefault(n, owner or root_name)


def refresh(rec: RecordingState) -> None:
    """Name the parameters the known module trees hold now (some were replaced since they were named):
    the map is rebuilt, so a replaced parameter's id (which Python may reuse) names nothing."""
    rec.params.clear()
    rec.param_objects.clear()
    for root in rec.roots:
        _name_parameters(rec, root, type(root).__name__)


def name_of(rec: RecordingState, tensor: Any) -> str | None:
    """The name of a parameter (or buffer) of a module tree the recording has seen; a miss renames once per
    backward pass (parameters replaced after their module was named)."""
    name = rec.params.get(id(tensor))
    if name is not None and rec.param_objects.get(id(tensor)) is tensor:
        return name
    if rec.params_named_at != rec.backward_events and rec.roots:
        rec.params_named_at = rec.backward_events
        refresh(rec)
        name = rec.params.get(id(tensor))
        if name is not None and rec.param_objects.get(id(tensor)) is tensor:
            return name
    return None


def parameter_of(rec: RecordingState, node: Any) -> str | None:
    """The parameter a backward node's output accumulates into: the node itself when it is an AccumulateGrad
    (its ``variable``), else an AccumulateGrad among its next functions (or one single-input node further)."""
    var = getattr(node, "variable", None)
    if var is not None:
        return name_of(rec, var)
    try:
        nexts = node.next_functions
    except Exception:  # noqa: BLE001
        return None
    for fn, _ in nexts:
        # follow a chain of single-input nodes (a promoted weight: to_local / from_local backward ...)
        for _depth in range(6):
            if fn is None:
                break
            var = getattr(fn, "variable", None)
            if var is not None:
                name = name_of(rec, var)
                if name is not None:
                    return name
                break
            try:
                nn = [f for f, _ in fn.next_functions if f is not None]
            except Exception:  # noqa: BLE001
                break
            fn = nn[0] if len(nn) == 1 else None
    return None


def _local(t: Any) -> Any:
    """The local data of a DTensor / ShardTensor gradient (slot reads, no dispatch); the tensor itself else."""
    return getattr(t, "_local_tensor", t)


def deferred_gradient_owner(rec: RecordingState, tensor: Any) -> str | None:
    """The parameter whose (Partial) gradient ``tensor`` holds: a collective outside every op reducing it is
    that gradient's reduction, deferred past the backward pass (a DTensor parameter: the first use of its
    gradient, e.g. the optimizer's step, reduces it). The map of gradients is rebuilt when backward events were recorded since."""
    if not rec.roots:
        return None
    owners = rec.gradient_owners
    if rec.gradients_seen_at != rec.backward_events:
        rec.gradients_seen_at = rec.backward_events
        owners.clear()
        for root in rec.roots:
            for n, p in root.named_parameters():
                g = p.grad
                if g is not None and g is not _local(g):  # a distributed gradient: only those are reduced late
                    owners.setdefault(id(_local(g)), (n, _local(g)))
    hit = owners.get(id(tensor))
    return hit[0] if hit is not None and hit[1] is tensor else None


class DdpBucket:
    """One gradient bucket of a DDP module: its index, its parameters (names from the DDP module, as every
    parameter of a recording is named from its outermost module, and ids), its size in elements."""

    __slots__ = ("index", "params", "param_ids", "numel")

    def __init__(self, index: int, params: list[str], param_ids: set[int], numel: int) -> None:
        self.index = index
        self.params = params
        self.param_ids = param_ids
        self.numel = numel


def ddp_buckets(rec: RecordingState, ddp: Any) -> list[DdpBucket]:
    """The buckets of a DDP module as its reducer holds them now (after its first step DDP may rebuild them in
    the order gradients became ready), with the parameters named from the module tree. Read once per module
    at export; the reducer's only accessor copies each bucket as zeros, so this allocates one gradient's worth
    of memory for a moment."""
    key = id(ddp)
    if key in rec.ddp_bucket_cache:
        return rec.ddp_bucket_cache[key]
    out: list[DdpBucket] = []
    try:
        names = {id(p): n for n, p in ddp.named_parameters()}
        for b in ddp.reducer._get_zeros_like_grad_buckets():
            ps = list(b.parameters())
            out.append(DdpBucket(int(b.index()), [names.get(id(p), "?") for p in ps], {id(p) for p in ps},
                                 int(b.buffer().numel())))
    except Exception:  # noqa: BLE001 - another torch layout: the bucket stays unnamed
        out = []
    rec.ddp_bucket_cache[key] = out
    return out


def ddp_bucket_of(rec: RecordingState, group_name: str, trigger: Any, numel: int | None) -> tuple[bool, DdpBucket | None]:
    """(issued by a DDP module of this recording, its bucket): the DDP module whose process group the
    all_reduce ran on and that holds the ``trigger`` parameter (whose AccumulateGrad hook issued it), and the
    bucket holding that parameter with ``numel`` elements (or the only bucket of that size)."""
    for ddp in rec.ddp_modules:
        try:
            if ddp.process_group.group_name != group_name:
                continue
        except Exception:  # noqa: BLE001
            continue
        buckets = ddp_buckets(rec, ddp)
        hit = [b for b in buckets if id(trigger) in b.param_ids and (numel is None or b.numel == numel)]
        if not hit and numel is not None:
            hit = [b for b in buckets if b.numel == numel]
        owns = any(p is trigger for p in ddp.parameters())
        if not hit and owns and buckets and numel == sum(b.numel for b in buckets):
            # DDP's first step reduces every gradient in one bucket (it buckets by the order gradients become
            # ready only from the second step on)
            hit = [DdpBucket(0, [n for b in buckets for n in b.params], {i for b in buckets for i in b.param_ids},
                             numel)]
        if hit or owns:
            return True, hit[0] if len(hit) == 1 else None
    return False, None
