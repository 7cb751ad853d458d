"""Replica consistency on one rank: digests of the tensors that claim Replicate, and the values behind them.

A tensor whose placement is ``Replicate`` on a mesh dim must be the same on every rank along that dim; a plain
tensor that ShardTensor promotes (a module's weight) is taken as Replicate over the op's mesh. Nothing checks
it: weights never broadcast over the domain axis, a random tensor drawn without a common seed, a reduction
applied on some ranks only, all train on quietly. With ``Recorder(replicas=True)`` every forward op's
Replicate results and promoted plain tensors, and the distributed parameters claiming Replicate that a call
from the user's code reads, are copied and digested on this rank (``ReplicaTracker``); the
client compares the digests across the ranks of each group and, for the first op where they differ, gathers
the values (``differences``) for the largest difference. It costs a copy and a hash per tensor: opt-in.

Stand-alone, for a model's parameters over a mesh dim: ``parameter_digests`` (no communication) and
``parameter_differences`` (a broadcast from the group's first rank, on every rank of the mesh).

Copies are kept up to ``keep_bytes`` per rank (the first ones: the first divergence is the one that
matters), until the next recording starts or ``release_kept()``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch

from .events import OpEvent
from .tensors import placements_str, result_tensors

KEEP_BYTES = 256 * 2**20  # copies kept per rank by default


class KeptValue:
    """A copy of a digested tensor, kept for the client's max-difference gather."""

    __slots__ = ("value", "group")

    def __init__(self, value: torch.Tensor, group: Any) -> None:
        self.value = value  # a CPU copy
        self.group = group  # the process group of its replicas; None where no single group holds them


class ReplicaDigest:
    """One tensor claiming Replicate, digested after an op (schema.REPLICA_FIELDS at export)."""

    __slots__ = ("what", "digest", "shape", "dtype", "group_ranks", "kept", "call", "copy")

    def __init__(self, what: str, digest: str, shape: tuple, dtype: Any, group_ranks: list[int],
                 copy: KeptValue | None) -> None:
        self.what = what  # "output 0", "parameter conv1.weight", "argument 1"
        self.digest = digest
        self.shape = shape
        self.dtype = dtype
        self.group_ranks = group_ranks
        self.kept = copy is not None
        self.call: int | None = None  # the k-th completed forward call of its op on this rank (set at its end)
        self.copy = copy  # until the op ends: then kept under the digest's key

    def key(self, op: str) -> str:
        return f"{op}#{self.call}/{self.what}"


class ReplicaGroup:
    """The ranks that must hold the same tensor, for a mesh and the mesh dims it is replicated over."""

    __slots__ = ("ranks", "process_group")

    def __init__(self, ranks: list[int], process_group: Any) -> None:
        self.ranks = ranks
        self.process_group = process_group


def digest_of(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(hex digest of the bytes, shape and dtype of ``t``, a contiguous CPU copy of it)."""
    copy = t.detach().to("cpu", copy=True).contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(copy.shape), str(copy.dtype))).encode())
    if copy.numel():
        h.update(copy.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest(), copy


def replica_group(mesh: Any, replicated: tuple[bool, ...]) -> ReplicaGroup | None:
    """The ranks of ``mesh`` that share this rank's coordinates on every mesh dim not replicated; None when
    this rank is not in the mesh. Its process group: the mesh's own for a 1-d mesh, the mesh dim's when one
    dim of several is replicated, the world's when every rank is in it, else None (its values cannot be
    gathered)."""
    import torch.distributed as dist

    coord = mesh.get_coordinate()
    if coord is None:
        return None
    index = tuple(slice(None) if rep else c for rep, c in zip(replicated, coord))
    ranks = [int(r) for r in mesh.mesh[index].reshape(-1).tolist()]
    dims = [m for m, rep in enumerate(replicated) if rep]
    if mesh.ndim == 1:
        pg = mesh.get_group()
    elif len(dims) == 1:
        pg = mesh.get_group(dims[0])
    elif sorted(ranks) == list(range(dist.get_world_size())):
        pg = dist.group.WORLD
    else:
        pg = None
    return ReplicaGroup(ranks, pg)


def arguments(args: tuple, kwargs: dict | None) -> list:
    """The positional and keyword arguments of a call, lists and tuples among them opened one level."""
    out = []
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            out.extend(a[:64])
        else:
            out.append(a)
    return out


class ReplicaTracker:
    """Digests (and copies, up to ``keep_bytes``) of the Replicate tensors of every recorded forward op on
    this rank."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self.kept_bytes = 0
        self.kept: dict[str, KeptValue] = {}  # digest key -> copy
        self.calls: dict[str, int] = {}  # op name -> its forward calls that digested something so far
        self.groups: dict[tuple[int, tuple[bool, ...]], ReplicaGroup | None] = {}
        self.meshes: list[Any] = []  # the meshes of ``groups``, kept alive so that their ids are not reused

    def _group(self, mesh: Any, replicated: tuple[bool, ...]) -> ReplicaGroup | None:
        k = (id(mesh), replicated)
        try:
            return self.groups[k]
        except KeyError:
            g = self.groups[k] = replica_group(mesh, replicated)
            self.meshes.append(mesh)
            return g

    def _digest(self, ev: OpEvent, what: str, local: torch.Tensor, group: ReplicaGroup) -> None:
        digest, copy = digest_of(local)
        size = copy.numel() * copy.element_size()
        kept = None
        if self.kept_bytes + size <= self.keep_bytes:
            self.kept_bytes += size
            kept = KeptValue(copy, group.process_group)
        d = ReplicaDigest(what, digest, tuple(copy.shape), copy.dtype, group.ranks, kept)
        if ev.replicas is None:
            ev.replicas = []
        ev.replicas.append(d)

    def promoted(self, ev: OpEvent, tensor: torch.Tensor, mesh: Any, name: str | None, position: int) -> None:
        """A plain tensor (the ``position``-th promoted in this op) promoted to Replicate over ``mesh``
        during ``ev``."""
        g = self._group(mesh, (True,) * mesh.ndim)
        if g is not None:
            self._digest(ev, f"parameter {name}" if name else f"argument {position}", tensor, g)

    def after_op(self, ev: OpEvent, res: Any, shard_tensor_cls: type, call: tuple | None = None,
                 name_of: Callable[[Any], str | None] | None = None) -> None:
        """``ev`` (a forward call) returned ``res``: digest its results that claim Replicate and, with ``call``
        (its ``(args, kwargs)``, a call from the user's code), the distributed parameters claiming Replicate it
        read (``name_of`` names a module's parameter or buffer, else None; a plain one is digested where
        ShardTensor promotes it); number the call and keep the copies under their keys."""
        from torch.distributed.tensor import DTensor

        if call is not None and name_of is not None:
            seen = set()
            for t in arguments(*call):
                if isinstance(t, (shard_tensor_cls, DTensor)) and id(t) not in seen:
                    seen.add(id(t))
                    replicated = tuple(p.is_replicate() for p in t._spec.placements)
                    name = name_of(t) if any(replicated) else None
                    if name is not None:
                        g = self._group(t._spec.mesh, replicated)
                        if g is not None:
                            self._digest(ev, f"parameter {name}", t._local_tensor, g)
        for i, t in enumerate(result_tensors(res)):
            if isinstance(t, (shard_tensor_cls, DTensor)):
                replicated = tuple(p.is_replicate() for p in t._spec.placements)
                if any(replicated):
                    g = self._group(t._spec.mesh, replicated)
                    if g is not None:
                        self._digest(ev, f"output {i}", t._local_tensor, g)
        if ev.replicas is None:
            return
        k = self.calls.get(ev.op, 0)
        self.calls[ev.op] = k + 1
        for d in ev.replicas:
            d.call = k
            if d.copy is not None:
                self.kept[d.key(ev.op)] = d.copy
                d.copy = None


# ---- after the recording: the values behind the digests --------------------------------------------------

_last: ReplicaTracker | None = None  # the tracker of the last recording, until the next one or release_kept()


def remember(tracker: ReplicaTracker | None) -> None:
    """Keep ``tracker``'s copies for :func:`differences` (the previous recording's are dropped)."""
    global _last
    _last = tracker


def release_kept() -> None:
    """Drop the copies kept by the last recording."""
    remember(None)


def max_difference(value: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Largest |value - reference| over every element, in float64; None (not a number to report) when a
    NaN or an infinity sits where the other side holds something else."""
    a = value.to(torch.float64) if not value.is_complex() else value.to(torch.complex128)
    b = reference.to(a.dtype)
    both_nan = torch.isnan(a) & torch.isnan(b)
    same = (a == b) | both_nan  # an infinity equal on both sides is no difference
    if bool(same.all()):
        return 0.0
    d = (a - b).abs()[~same]
    m = float(d.max())
    return m if math.isfinite(m) else None


def gather_differences(values: list[torch.Tensor | None], group: Any, src: int) -> list[dict]:
    """On every rank of ``group`` (a collective): broadcast ``src``'s value of each entry of ``values`` (None:
    not held here) and compare; per entry {"shape", "dtype", "held", "max_abs_diff", "note"}, the same
    decisions on every rank (shapes and dtypes are exchanged first)."""
    import torch.distributed as dist

    described = [None if v is None else (tuple(v.shape), str(v.dtype)) for v in values]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, described, group=group)
    src_index = dist.get_group_rank(group, src) if group is not None else src
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    out = []
    for i, v in enumerate(values):
        ref = everyone[src_index][i]
        missing = [r for r, d in enumerate(everyone) if d[i] is None]
        row = {"shape": list(v.shape) if v is not None else None, "dtype": str(v.dtype) if v is not None else None,
               "held": v is not None, "max_abs_diff": None, "note": None}
        if ref is None or missing:
            row["note"] = "not kept on every rank of the group"
        elif any(d[i] != ref for d in everyone):
            row["note"] = f"shapes or dtypes differ across the group: {sorted({str(d[i]) for d in everyone})}"
        else:
            buf = v.to(device, copy=True) if dist.get_rank() == src else torch.empty(ref[0], dtype=v.dtype,
                                                                                      device=device)
            dist.broadcast(buf, src=src, group=group)
            row["max_abs_diff"] = max_difference(v.to(device), buf)
            if row["max_abs_diff"] is None:
                row["note"] = "NaN or infinity against a number"
        out.append(row)
    return out


def differences(keys: list[str], src: int, group_ranks: list[int]) -> list[dict]:
    """For each key of the last recording (the same list on every rank of the replica group ``group_ranks``,
    every one of which kept a copy of each), this rank's largest difference to rank ``src``'s copy
    (``gather_differences``); a collective over the group."""
    tracker = _last
    if tracker is None:
        raise RuntimeError("no recording with replicas=True kept copies on this rank (released, or a new "
                           "recording started since)")
    group = next((g.process_group for g in tracker.groups.values() if g is not None and g.ranks == list(group_ranks)),
                 None)
    if group is None:
        raise RuntimeError(f"no process group holds the replica group {list(group_ranks)}: its values cannot be "
                           "gathered")
    kept = [tracker.kept.get(k) for k in keys]
    return gather_differences([k.value if k is not None else None for k in kept], group, src)


# ---- stand-alone: a model's parameters over a mesh dim ---------------------------------------------------

def _named_tensors(model: Any) -> list[tuple[str, str, torch.Tensor]]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return ([("parameter", n, p) for n, p in model.named_parameters()]
            + [("buffer", n, b) for n, b in model.named_buffers()])


def _local_part(t: torch.Tensor, shard_tensor_cls: type) -> tuple[torch.Tensor, Any]:
    """(the tensor this rank holds, the spec of a distributed tensor or None)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, (DTensor, shard_tensor_cls)):
        return t._local_tensor, t._spec
    return t, None


def parameter_digests(model: Any, shard_tensor_cls: type) -> list[dict]:
    """One row per parameter and buffer of ``model`` on this rank: name, kind, shape, dtype, placements and
    ``sharded_over`` (a distributed parameter's: the mesh dim names it is not Replicate over; its local part is
    digested), digest. No communication."""
    rows = []
    for kind, name, t in _named_tensors(model):
        local, spec = _local_part(t, shard_tensor_cls)
        sharded_over = []
        if spec is not None:
            names = spec.mesh.mesh_dim_names or tuple(str(m) for m in range(spec.mesh.ndim))
            sharded_over = [str(n) for n, p in zip(names, spec.placements) if not p.is_replicate()]
        digest, copy = digest_of(local)
        rows.append({"name": name, "kind": kind, "shape": list(copy.shape),
                     "dtype": str(copy.dtype).removeprefix("torch."),
                     "placements": placements_str(spec.placements) if spec is not None else None,
                     "sharded_over": sharded_over, "digest": digest})
    return rows


def parameter_differences(model: Any, names: list[str], group: Any, src: int, shard_tensor_cls: type) -> list[dict]:
    """For each of ``names`` (the same list on every rank of ``group``), this rank's largest difference to rank
    ``src``'s value (a collective over ``group``)."""
    tensors = {name: t for _kind, name, t in _named_tensors(model)}
    values = []
    for n in names:
        t = tensors.get(n)
        values.append(_local_part(t, shard_tensor_cls)[0].detach() if t is not None else None)
    return gather_differences(values, group, src)
