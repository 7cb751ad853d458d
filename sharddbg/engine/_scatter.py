"""``scatter``: one sample (or a batch of them) in, one ShardTensor on the "domain" sub-mesh out (runs on every
rank).

Every rank checks its own arguments, then the ranks of the domain group exchange, in one collective,
each rank's arguments and verdict together with the source's tensor metadata. From that same list every
rank decides the same way, so a bad request raises the same ``ScatterError`` on every rank and no rank is
left waiting in a collective its peers never join. A batch larger than 1 is sharded like one sample, with a
``BatchPerDomainGroupWarning`` (once per process and shape) naming its cost and its risk.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ShardDbgError, ShardDbgWarning
from .rank_state import STATE, current_rank

if TYPE_CHECKING:
    from physicsnemo.domain_parallel import ShardTensor


class ScatterError(ShardDbgError, ValueError):
    """The tensor cannot be scattered as asked (raised on every rank alike, so none is left waiting)."""


class BatchPerDomainGroupWarning(ShardDbgWarning):
    """A domain group was handed a batch larger than 1: right for ops that keep the samples apart, at that many
    times the memory and work per rank, and wrong after a view/reshape that merges the batch with a sharded dim."""


# (global shape, batch axis, sharded axis) already warned about in this process: the warning is said once
_BATCH_WARNED: set[tuple[tuple[int, ...], int, int]] = set()


def domain_mesh():
    """This rank's 1-D "domain" sub-mesh (the ranks one sample is sharded over)."""
    mesh = STATE.mesh
    if mesh is None:
        raise ShardDbgError("torch.distributed is not set up on this engine; start it with sharddbg.Cluster")
    return mesh["domain"]


# The arguments every rank of a domain group must pass alike, with the types each accepts.
ARGUMENT_TYPES = {
    "dim": "an int or None",
    "batch_dim": "an int or None",
    "replicate": "a bool",
    "requires_grad": "a bool",
}


@dataclass(frozen=True)
class SourceTensor:
    """What the source rank's tensor is: all the other ranks need to know to receive their shard."""

    shape: tuple[int, ...]
    dtype: object  # torch.dtype (picklable)
    requires_grad: bool


@dataclass(frozen=True)
class RankRequest:
    """One rank's side of a scatter, as every rank of the domain group receives it.

    ``arguments`` holds ``repr()`` of each argument (never the object itself: whatever a rank passed
    must reach its peers, picklable or not); ``type_problems`` the arguments of the wrong type;
    ``source`` is set on the source rank only, ``source_problem`` when its tensor is not a tensor.
    """

    rank: int
    arguments: tuple[tuple[str, str], ...]
    type_problems: tuple[str, ...]
    source: SourceTensor | None
    source_problem: str | None

    def argument(self, name: str) -> str:
        """``repr()`` of the argument ``name`` as this rank passed it."""
        return dict(self.arguments)[name]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_problems(dim, batch_dim, replicate, requires_grad) -> tuple[str, ...]:
    """The names of the arguments of the wrong type (ARGUMENT_TYPES says what each accepts)."""
    ok = {
        "dim": dim is None or _is_int(dim),
        "batch_dim": batch_dim is None or _is_int(batch_dim),
        "replicate": isinstance(replicate, bool),
        "requires_grad": isinstance(requires_grad, bool),
    }
    return tuple(name for name, good in ok.items() if not good)


def _ranks_text(ranks: list[int], everyone: list[int]) -> str:
    if sorted(ranks) == sorted(everyone) and len(everyone) > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(ranks))


def _request_problems(requests: list[RankRequest], source_rank: int) -> list[str]:
    """What is wrong with the ranks' requests taken together: arguments of the wrong type, arguments
    that differ between ranks, a source holding no tensor. Pure: every rank reaches the same answer."""
    everyone = [q.rank for q in requests]
    source = next(q for q in requests if q.rank == source_rank)
    problems = []
    for name, expected in ARGUMENT_TYPES.items():
        by_value: dict[str, list[int]] = {}  # repr of the value -> ranks that passed it
        for q in requests:
            by_value.setdefault(q.argument(name), []).append(q.rank)
        mistyped = {q.argument(name) for q in requests if name in q.type_problems}
        if mistyped:
            problems += [f"{name}={value} is not {expected} (on {_ranks_text(by_value[value], everyone)})"
                         for value in sorted(mistyped, key=lambda v: min(by_value[v]))]
            continue
        if len(by_value) == 1:
            continue
        # the value most ranks passed is the reference (the source's on a tie); the others are named
        reference = max(by_value, key=lambda v: (len(by_value[v]), v == source.argument(name)))
        others = sorted((ranks, value) for value, ranks in by_value.items() if value != reference)
        told = [f"{_ranks_text(ranks, everyone)} {'passed ' if i == 0 else ''}{name}={value}"
                for i, (ranks, value) in enumerate(others)]
        rest = "the others" if len(by_value[reference]) > 1 else _ranks_text(by_value[reference], everyone)
        problems.append(f"{', '.join(told)}, {rest} {name}={reference} "
                        f"(every rank of the domain group must pass the same {name})")
    if source.source_problem:
        problems.append(source.source_problem)
    return problems


def _shape_problem(src: SourceTensor, dim, batch_dim, replicate, group_ranks: list[int]) -> str | None:
    """Why the source tensor cannot be scattered as asked, or None. Pure: every rank reaches the same answer."""
    shape = src.shape
    ndim = len(shape)
    if ndim == 0:
        return "cannot scatter a 0-d tensor"
    if batch_dim is not None:
        if not -ndim <= batch_dim < ndim:
            return f"batch_dim={batch_dim} is out of range for a {ndim}-d tensor of shape {tuple(shape)}"
        b = batch_dim % ndim
        if shape[b] == 0:
            return (f"the batch axis (dim {b}) has size 0: there is no sample to scatter (shape {tuple(shape)}); "
                    f"pass batch_dim=None for inputs without a batch axis (point clouds)")
    if replicate:
        return None
    if dim is None:
        return "give the dimension to shard along (dim=...), or replicate=True"
    if not -ndim <= dim < ndim:
        return f"dim={dim} is out of range for a {ndim}-d tensor of shape {tuple(shape)}"
    if batch_dim is not None and dim % ndim == batch_dim % ndim:
        return f"dim={dim} is the batch axis; shard along a spatial axis"
    rows = shape[dim % ndim]
    sizes = balanced_sizes(rows, len(group_ranks))
    empty = [r for r, size in zip(group_ranks, sizes) if size == 0]
    if empty:
        return (f"dim={dim}: {rows} row{'' if rows == 1 else 's'} over {len(group_ranks)} ranks would leave "
                f"{_ranks_text(empty, [])} with no rows; ShardTensor ops fail on empty shards: use fewer domain "
                f"ranks or a larger dim")
    return None


def _warn_batch(shape: tuple[int, ...], batch_axis: int, axis: int) -> None:
    """Say once per process and shape what a batch larger than 1 per domain group costs and risks (the same
    cost and risk ``cl.doctor()``'s "samples kept apart" check names)."""
    key = (tuple(shape), batch_axis, axis)
    if key in _BATCH_WARNED:
        return
    _BATCH_WARNED.add(key)
    samples = shape[batch_axis]
    warnings.warn(
        f"sharddbg.engine.scatter: a batch of {samples} per domain group (dim {batch_axis} of shape {tuple(shape)}), "
        f"sharded along dim {axis} like one sample. It costs {samples} times the memory and work per rank; a "
        f"view/reshape that merges dim {batch_axis} with the sharded dim (x.reshape(B * N, C)) mixes the samples "
        f"in every shard. cl.doctor() checks the last trace for ops that do; a batch of 1 per domain group with "
        f"the batch over the 'ddp' mesh axis has neither cost nor risk",
        BatchPerDomainGroupWarning, stacklevel=3)


def scatter(tensor, dim: int | None = None, *, batch_dim: int | None = 0, replicate: bool = False,
            requires_grad: bool = False) -> ShardTensor:
    """Shard ``tensor`` along ``dim`` over this rank's domain group (or replicate it with ``replicate=True``).

    Called on every rank of the domain group (a collective over it). The tensor held by rank 0 of each
    domain group is the one that counts (physicsnemo's ``scatter_tensor`` broadcasts it from that rank);
    other ranks' values are ignored and may be None. Uneven sizes are fine: 66 rows over 4 ranks give 17,
    17, 16, 16 (no rank more than one row above another, larger shards first, the sizes declared in the
    result's sharding shapes); fewer rows than ranks are refused (a rank would hold none). Every rank of the
    domain group must pass the same ``dim``, ``batch_dim``, ``replicate`` and ``requires_grad``. The result
    requires grad on every rank when the source tensor does or ``requires_grad`` is True, and is then a leaf
    that accumulates its gradient on every rank; it is never part of the source tensor's graph (the data is
    detached and moved to the rank's device first).

    A batch of B samples (the batch axis of size B above 1) is sharded like one sample: every rank holds its
    rows of each sample. That is right for ops that keep the samples apart (convolutions, normalizations,
    pointwise ops, a linear over the last dim), at B times the memory and work per rank, and wrong after a
    view/reshape that merges the batch axis with the sharded dim (``x.reshape(B * N, C)``): the samples are
    mixed. Each rank says so once per process and shape with a ``BatchPerDomainGroupWarning``;
    ``cl.doctor()`` checks the last trace for the ops that mix samples. A batch of 1 per domain group, the
    batch scaled over the ``ddp`` mesh axis, has neither the cost nor the risk.

    Before any data moves, the ranks exchange their arguments and the source's shape in one collective,
    and every rank raises the same ``ScatterError`` when any rank's request is wrong.

    Parameters
    ----------
    tensor : torch.Tensor or None
        The whole sample (or batch of samples), on the domain group's first rank; ignored (and may be None)
        on the others.
    dim : int or None, default None
        The dim to shard along (negative counts from the end). None only with ``replicate=True``.
    batch_dim : int or None, default 0
        The batch axis: it cannot be ``dim`` nor of size 0; above 1, a ``BatchPerDomainGroupWarning``.
        None for inputs without a batch axis (point clouds).
    replicate : bool, default False
        Put the whole tensor on every rank of the domain group (a Replicate ShardTensor, for targets)
        instead of sharding it; ``dim`` is then not used.
    requires_grad : bool, default False
        Make the result a leaf that requires grad on every rank (the source's own flag does so as well).

    Returns
    -------
    ShardTensor
        On this rank's ``domain`` sub-mesh, placed ``Shard(dim)`` (``dim`` counted from the front) or
        ``Replicate()``, with the source's global shape and dtype, its local part on the rank's device.

    Raises
    ------
    ScatterError
        On every rank of the domain group alike, when any rank's request is wrong: an argument of the wrong
        type (``dim`` or ``batch_dim`` not an int or None, ``replicate`` or ``requires_grad`` not a bool),
        ranks passing different values, a source rank holding no ``torch.Tensor``, a 0-d tensor,
        ``batch_dim`` out of range or its size 0, no ``dim`` without ``replicate``, ``dim`` out of range
        or equal to the batch axis, fewer rows along ``dim`` than ranks. The message names the ranks.
    ShardDbgError
        torch.distributed is not set up on this engine (it is not a rank of a ``sharddbg.Cluster``);
        raised before any exchange.

    Warns
    -----
    BatchPerDomainGroupWarning
        The tensor is sharded with a batch axis of size above 1: once per process and (shape, batch axis,
        dim), on every rank of the domain group.

    Examples
    --------
    In a ``%%px`` cell on 4 ranks, one domain group of 4 (``torch`` and ``sharddbg`` are in the ranks'
    namespace):

    >>> x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)
    >>> tuple(x._local_tensor.shape)  # on rank 3
    (1, 3, 16, 64)
    >>> target = sharddbg.engine.scatter(torch.randn(1, 4, 66, 64), replicate=True)
    >>> tuple(target._local_tensor.shape)
    (1, 4, 66, 64)
    >>> xb = sharddbg.engine.scatter(torch.randn(2, 3, 66, 64), dim=2)  # doctest: +SKIP
    BatchPerDomainGroupWarning: sharddbg.engine.scatter: a batch of 2 per domain group (dim 0 of shape ...
    >>> tuple(xb._local_tensor.shape)  # on rank 3
    (2, 3, 16, 64)
    """
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
    from torch.distributed.tensor import Replicate, Shard

    mesh = domain_mesh()
    group_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    source_rank = group_ranks[0]
    me = current_rank()
    source = source_problem = None
    if me == source_rank:
        if isinstance(tensor, torch.Tensor):
            source = SourceTensor(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))
        else:
            source_problem = f"the source rank {source_rank} holds a {type(tensor).__name__}, not a torch.Tensor"
    arguments = {"dim": dim, "batch_dim": batch_dim, "replicate": replicate, "requires_grad": requires_grad}
    mine = RankRequest(rank=me, arguments=tuple((k, _short_repr(v)) for k, v in arguments.items()),
                       type_problems=_type_problems(dim, batch_dim, replicate, requires_grad),
                       source=source, source_problem=source_problem)
    requests: list = [None] * len(group_ranks)
    dist.all_gather_object(requests, mine, group=DistributedManager().get_mesh_group(mesh))
    requests.sort(key=lambda q: q.rank)
    problems = _request_problems(requests, source_rank)
    src = next(q for q in requests if q.rank == source_rank).source
    if not problems:
        shape_problem = _shape_problem(src, dim, batch_dim, replicate, group_ranks)
        problems = [shape_problem] if shape_problem else []
    if problems:
        raise ScatterError("sharddbg.engine.scatter: " + "; ".join(problems))

    shape = src.shape
    if not replicate and batch_dim is not None and shape[batch_dim % len(shape)] > 1:
        # decided from the gathered requests: every rank warns alike
        _warn_batch(shape, batch_dim % len(shape), dim % len(shape))
    if me != source_rank:
        tensor = None
    else:
        # the data only: the result is a leaf of its own on every rank, never part of the source's graph
        tensor = tensor.detach()
        if tensor.device != DistributedManager().device:
            tensor = tensor.to(DistributedManager().device)
    # physicsnemo's scatter_tensor does the broadcast from the source rank; it splits like torch.chunk
    # (66 over 4 -> 17,17,17,15), so we cut the replicated copy into balanced pieces ourselves
    # (17,17,16,16: no rank more than one row above another) and declare those shapes explicitly.
    full = scatter_tensor(tensor.contiguous() if tensor is not None else None, source_rank, mesh, (Replicate(),),
                          global_shape=torch.Size(shape), dtype=src.dtype)
    if replicate:
        result = full
    else:
        axis = dim % len(shape)
        sizes = balanced_sizes(shape[axis], mesh.size())
        pieces = torch.split(full._local_tensor, sizes, dim=axis)
        local = pieces[mesh.get_local_rank()].contiguous()
        shard_shapes = [tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1:]) for size in sizes]
        result = ShardTensor.from_local(local, mesh, (Shard(axis),), sharding_shapes={0: shard_shapes})
    if requires_grad or src.requires_grad:  # decided from the gathered requests: the same on every rank
        result = result.detach().requires_grad_(True)
    return result


def _short_repr(value) -> str:
    """``repr(value)``, cut to a length that reads well in an error message."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not break the exchange
        text = f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def balanced_sizes(length: int, parts: int) -> list[int]:
    """Split ``length`` into ``parts`` sizes differing by at most one, larger ones first (66/4 -> 17,17,16,16)."""
    base, extra = divmod(length, parts)
    return [base + 1 if i < extra else base for i in range(parts)]
