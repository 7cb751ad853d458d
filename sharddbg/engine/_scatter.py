"""``scatter``: one sample in, one ShardTensor on the "domain" sub-mesh out (runs on every rank)."""

from __future__ import annotations

from ..errors import ShardDbgError
from .rank_state import STATE, current_rank


class ScatterError(ShardDbgError, ValueError):
    """The tensor cannot be scattered as asked (raised on every rank alike, so none is left waiting)."""


def domain_mesh():
    """This rank's 1-D "domain" sub-mesh (the ranks one sample is sharded over)."""
    mesh = STATE.mesh
    if mesh is None:
        raise ShardDbgError("torch.distributed is not set up on this engine; start it with sharddbg.Cluster")
    return mesh["domain"]


def _check(meta, dim, batch_dim, replicate) -> str | None:
    """Why ``meta`` (shape, dtype) cannot be scattered, or None. Pure: every rank reaches the same answer."""
    shape, _dtype = meta
    ndim = len(shape)
    if ndim == 0:
        return "cannot scatter a 0-d tensor"
    if batch_dim is not None:
        if not -ndim <= batch_dim < ndim:
            return f"batch_dim={batch_dim} is out of range for a {ndim}-d tensor of shape {tuple(shape)}"
        b = batch_dim % ndim
        if shape[b] != 1:
            return (f"the batch axis (dim {b}) has size {shape[b]}, but each domain group holds one sample: "
                    f"batch size per domain group must be 1. Scale the batch over the 'ddp' mesh axis instead, "
                    f"or pass batch_dim=None for inputs without a batch axis (point clouds)")
    if replicate:
        return None
    if dim is None:
        return "give the dimension to shard along (dim=...), or replicate=True"
    if not -ndim <= dim < ndim:
        return f"dim={dim} is out of range for a {ndim}-d tensor of shape {tuple(shape)}"
    if batch_dim is not None and dim % ndim == batch_dim % ndim:
        return f"dim={dim} is the batch axis; shard along a spatial axis"
    return None


def scatter(tensor, dim: int | None = None, *, batch_dim: int | None = 0, replicate: bool = False,
            requires_grad: bool = False):
    """Shard ``tensor`` along ``dim`` over this rank's domain group (or replicate it with ``replicate=True``).

    The tensor held by rank 0 of each domain group is the one that counts (physicsnemo's ``scatter_tensor``
    broadcasts it from that rank); other ranks' values are ignored and may be None. Uneven sizes are fine:
    66 rows over 4 ranks give 17, 17, 16, 16. Errors are decided from the source's shape after one small
    broadcast, so every rank raises the same error instead of leaving peers blocked in a collective.
    """
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
    from torch.distributed.tensor import Replicate, Shard

    mesh = domain_mesh()
    source = int(mesh.mesh.flatten()[0].item())
    is_source = current_rank() == source
    if is_source and not isinstance(tensor, torch.Tensor):
        problem = f"expected a torch.Tensor on the source rank {source}, got {type(tensor).__name__}"
        meta = None
    else:
        meta = (tuple(tensor.shape), tensor.dtype) if is_source else None
        problem = None
    if is_source and problem is None:
        problem = _check(meta, dim, batch_dim, replicate)
    shared = [(meta, problem)]
    dist.broadcast_object_list(shared, src=source, group=DistributedManager().get_mesh_group(mesh))
    meta, problem = shared[0]
    if problem:
        raise ScatterError(f"sharddbg.engine.scatter: {problem}")
    shape, dtype = meta
    if not is_source:
        tensor = None
    elif tensor.device != DistributedManager().device:
        tensor = tensor.to(DistributedManager().device)
    # physicsnemo's scatter_tensor does the broadcast from the source rank; it splits like torch.chunk
    # (66 over 4 -> 17,17,17,15), so we cut the replicated copy into balanced pieces ourselves
    # (17,17,16,16: no rank more than one row above another) and declare those shapes explicitly.
    full = scatter_tensor(tensor.contiguous() if tensor is not None else None, source, mesh, (Replicate(),),
                          global_shape=torch.Size(shape), dtype=dtype)
    if replicate:
        result = full
    else:
        axis = dim % len(shape)
        sizes = balanced_sizes(shape[axis], mesh.size())
        pieces = torch.split(full._local_tensor, sizes, dim=axis)
        local = pieces[mesh.get_local_rank()].contiguous()
        shard_shapes = [tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1:]) for size in sizes]
        result = ShardTensor.from_local(local, mesh, (Shard(axis),), sharding_shapes={0: shard_shapes})
    if requires_grad:
        result = result.detach().requires_grad_(True)
    return result


def balanced_sizes(length: int, parts: int) -> list[int]:
    """Split ``length`` into ``parts`` sizes differing by at most one, larger ones first (66/4 -> 17,17,16,16)."""
    base, extra = divmod(length, parts)
    return [base + 1 if i < extra else base for i in range(parts)]
