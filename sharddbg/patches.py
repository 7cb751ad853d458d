"""Starting points for a ShardTensor handler: ``scaffold(op, family)`` returns a handler's source, commented,
in the shape of physicsnemo's own patches of that family (see ``Trace.get_fallbacks()``'s ``family``).

The source is plain text (this module imports nothing heavy): paste it into a ``%%shard_patch OP`` cell (or
define it in a cell and pass it to ``cl.patch``), fill in what the comments ask, and ``cl.check_patch`` it. The
handler runs on the ranks; it imports what it needs from physicsnemo inside its body, so the notebook's own
process never imports torch.
"""

from __future__ import annotations

import re

__all__ = ["FAMILIES", "scaffold"]

FAMILIES = ("pointwise", "halo", "reduction", "view")

_HEADER = '''\
def {name}(func, types, args, kwargs{extra}):
    """ShardTensor handler for {op} ({family}): ShardTensor calls it as handler(func, types, args, kwargs)
    with plain tensor arguments promoted to Replicate; ``func`` is {op} itself."""
'''

_POINTWISE = '''\
    # Pointwise: every output element depends on the input element at the same place, so each rank computes
    # its own shard alone and the result keeps the input's spec (placements and per-rank sharding shapes).
    x = args[0]
    local = x.to_local()  # differentiable: gradients flow back to x
    # Plain tensor arguments arrive as Replicate DTensors/ShardTensors: use their local (whole) values.
    rest = [a.to_local() if hasattr(a, "to_local") else a for a in args[1:]]
    out = func(local, *rest, **kwargs)
    spec = x._spec
    return ShardTensor.from_local(out, spec.mesh, spec.placements, sharding_shapes=spec._sharding_shapes)
'''

_HALO = '''\
    # Halo (the shape of conv1d/2d/3d's patch, physicsnemo conv_patches.partial_conv_nd): each shard fetches
    # `halo` rows from each neighbour along the sharded dim (one all_to_all_single, halo rows only), runs the
    # op on its rows plus the halos, and trims the rows that belong to a neighbour.
    #   halo:   rows needed from each neighbour (get_fallbacks()'s halo_width)
    #   shrink: how many rows shorter the op's output is than its input along that dim (0 when it pads)
    from physicsnemo.domain_parallel.shard_utils.halo import HaloConfig, halo_padding

    x = args[0]
    spec = x._spec
    mesh_dim = next(i for i, p in enumerate(spec.placements) if p.is_shard())
    dim = spec.placements[mesh_dim].dim
    config = HaloConfig(mesh_dim=mesh_dim, tensor_dim=dim, halo_size=halo, edge_padding_size=0,
                        communication_method="a2a")
    padded = halo_padding(x.to_local(), spec.mesh, config)  # differentiable: halo gradients go back
    out = func(padded, *args[1:], **kwargs)  # the op itself, on plain local rows
    # Output row j reads input rows j .. j + shrink; it stays with the shard that holds its centre row.
    rank, size = spec.mesh.get_local_rank(mesh_dim), spec.mesh.size(mesh_dim)
    rows = [s[dim] for s in spec._sharding_shapes[mesh_dim]]  # input rows per shard

    def kept(r):  # output rows of shard r
        return rows[r] - (shrink // 2 if r == 0 else 0) - (shrink - shrink // 2 if r == size - 1 else 0)

    start = halo - shrink // 2 if rank > 0 else 0
    out = out.narrow(dim, start, kept(rank))
    shapes = {mesh_dim: [tuple(out.shape[:dim]) + (kept(r),) + tuple(out.shape[dim + 1:]) for r in range(size)]}
    return ShardTensor.from_local(out, spec.mesh, spec.placements, sharding_shapes=shapes)
'''

_REDUCTION = '''\
    # Reduction over the sharded dim (the shape of physicsnemo's sum/mean patches, custom_ops._reductions):
    # reduce each shard locally, then add the partial results of all shards with one all_reduce.
    # Fill in: a mean must divide by the global size, not the local one; keepdim changes the output's shape.
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Replicate

    x = args[0]
    spec = x._spec
    mesh_dim = next(i for i, p in enumerate(spec.placements) if p.is_shard())
    out = func(x.to_local(), *args[1:], **kwargs)  # the local partial result
    out = out.clone()
    dist.all_reduce(out, group=spec.mesh.get_group(mesh_dim))  # no autograd through it: see _reductions
    placements = [Replicate() for _ in spec.placements]
    return ShardTensor.from_local(out, spec.mesh, placements, sharding_shapes="chunk", global_shape=out.shape)
'''

_VIEW = '''\
    # View or reshape that moves the sharded dim (the shape of physicsnemo view_ops.reshape_wrapper): reshape
    # the local tensor so that the sharded dim stays whole-rowed, and carry each shard's new shape.
    # Fill in: the target shape of THIS shard (the global target shape with the sharded dim's size replaced by
    # the local one), and the placement's new tensor dim.
    x = args[0]
    spec = x._spec
    mesh_dim = next(i for i, p in enumerate(spec.placements) if p.is_shard())
    dim = spec.placements[mesh_dim].dim
    local = x.to_local()
    local_shape = list(local.shape)  # replace with the shard's target shape
    out = local.reshape(local_shape)
    shapes = {mesh_dim: [tuple(s) for s in spec._sharding_shapes[mesh_dim]]}  # replace: every shard's new shape
    return ShardTensor.from_local(out, spec.mesh, spec.placements, sharding_shapes=shapes)
'''

_BODIES = {"pointwise": (_POINTWISE, ""), "halo": (_HALO, ", halo={halo}, shrink={shrink}"),
           "reduction": (_REDUCTION, ""), "view": (_VIEW, "")}


def _handler_name(op: str) -> str:
    base = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 2 else op.rsplit(".", 1)[-1]
    if base in ("default", "Tensor") and op.count(".") >= 2:
        base = op.split(".")[-2]
    return re.sub(r"\W", "_", base).strip("_") + "_handler"


def scaffold(op: str, family: str, *, halo_width: int = 1, shrink: int | None = None) -> str:
    """The source of a ShardTensor function handler for ``op`` in the shape of ``family``, commented.

    Parameters
    ----------
    op : str
        The op as sharddbg names it (``"torch.diff"``, ``"torch.nn.functional.silu"``, ``"Tensor.add"``): the
        ``op`` column of ``Trace.get_fallbacks()``; it names the handler and its comments.
    family : {"pointwise", "halo", "reduction", "view"}
        The ``family`` column of ``get_fallbacks()``.
    halo_width : int
        ``halo`` only: rows each shard fetches from each neighbour (the ``halo_width`` column), at least 1.
    shrink : int or None
        ``halo`` only: how many rows shorter the op's output is than its input along the sharded dim (0 for a
        padded stencil); None: ``halo_width``.

    Returns
    -------
    str
        Python source defining one function ``<op>_handler(func, types, args, kwargs, ...)``: for
        ``Cluster.patch`` / ``%%shard_patch``. It reads ``ShardTensor`` from the ranks' namespace and imports
        the rest inside its body.

    Raises
    ------
    ValueError
        ``family`` is not one of ``FAMILIES`` (a ``global`` or ``none`` op has no local patch shape), or
        ``halo_width`` / ``shrink`` is not a whole number (at least 1 / at least 0).

    Examples
    --------
    >>> from sharddbg.patches import scaffold
    >>> print(scaffold("torch.diff", "halo", halo_width=1).splitlines()[0])
    def diff_handler(func, types, args, kwargs, halo=1, shrink=1):
    >>> "from_local" in scaffold("torch.nn.functional.silu", "pointwise")
    True
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r} (a 'global' or 'none' op has no local "
                         f"patch shape: gather it, or write the handler from scratch)")
    if isinstance(halo_width, bool) or not isinstance(halo_width, int) or halo_width < 1:
        raise ValueError(f"halo_width must be a whole number of at least 1, got {halo_width!r}")
    shrink = halo_width if shrink is None else shrink
    if isinstance(shrink, bool) or not isinstance(shrink, int) or shrink < 0:
        raise ValueError(f"shrink must be a whole number of at least 0, got {shrink!r}")
    if not isinstance(op, str) or not op.strip():
        raise ValueError(f"op must be the op's name as a string, got {op!r}")
    body, extra = _BODIES[family]
    header = _HEADER.format(name=_handler_name(op), op=op, family=family,
                            extra=extra.format(halo=halo_width, shrink=shrink))
    return header + body
