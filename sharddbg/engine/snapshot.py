"""A per-rank snapshot of a ShardTensor / DTensor / plain tensor as plain JSON-able data.

Runs inside a rank (the client asks through ``sharddbg.engine.api.tensor_snapshot("x")``) and reads only
local state: the local tensor's shape, ``_spec.tensor_meta`` (global shape, dtype), ``_spec.placements``,
``_spec.mesh`` and ``_spec._sharding_shapes``. It never communicates: ``spec.sharding_shapes()`` (an
all_gather when the cached shapes are None), ``full_tensor()`` and ``t.shape`` on a ShardTensor are not
called. The client puts every rank's snapshot together (the shard inspector's ``ShardLayout``); what one
rank cannot know (the other ranks' real local shapes) is checked there.

Snapshot record (``SNAPSHOT_VERSION``)::

    {"version": 1, "name": "x", "rank": 2, "status": "ok" | "missing" | "not_a_tensor",
     "kind": "ShardTensor" | "DTensor" | "Tensor", "type": "physicsnemo...ShardTensor",
     "global_shape": [1, 3, 66, 64], "local_shape": [1, 3, 16, 64], "dtype": "torch.float32",
     "device": "cpu", "requires_grad": False, "element_size": 4, "local_bytes": 4096,
     "mesh": {"dim_names": ["domain"], "shape": [4], "ranks": [[0, 1, 2, 3]], "coordinate": [2]} | None,
     "placements": [{"type": "shard", "dim": 2, "text": "Shard(dim=2)"}],
     "sharding_shapes": {"0": [[1, 3, 17, 64], ...]} | None,
     "spec_local_shape": [1, 3, 16, 64] | None,   # what the spec says this rank holds
     "spec_offsets": [0, 0, 34, 0] | None,        # global offset of the local block per tensor dim, per spec
     "problems": ["..."]}                         # what this rank alone can see is inconsistent
"""

from __future__ import annotations

from typing import Any

from .rank_state import current_rank

SNAPSHOT_VERSION = 1


def _placement(p) -> dict:
    text = repr(p)  # Shard(dim=2), Replicate(), Partial(sum); str() abbreviates (S(2), P(sum))
    if p.is_shard():
        return {"type": "shard", "dim": int(p.dim), "text": text}
    if p.is_partial():
        return {"type": "partial", "reduce_op": str(getattr(p, "reduce_op", "sum")), "text": text}
    if p.is_replicate():
        return {"type": "replicate", "text": text}
    return {"type": "other", "text": text}


def _mesh(mesh) -> dict:
    ranks = mesh.mesh.tolist()
    coord = mesh.get_coordinate()
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    return {"dim_names": names, "shape": [int(s) for s in mesh.mesh.shape],
            "ranks": ranks if isinstance(ranks, list) else [ranks],
            "coordinate": None if coord is None else [int(c) for c in coord],
            "device_type": str(mesh.device_type)}


def _resolve(namespace: dict, name: str):
    """``name`` or a dotted path (``model.weight``) in ``namespace``; (found, value)."""
    head, *rest = name.split(".")
    if head not in namespace:
        return False, None
    value = namespace[head]
    for attr in rest:
        if not hasattr(value, attr):
            return False, None
        value = getattr(value, attr)
    return True, value


def snapshot_named(name: str) -> dict:
    """Snapshot of the variable ``name`` (or a dotted path) in this rank's %px namespace."""
    from IPython import get_ipython

    ip = get_ipython()
    namespace = ip.user_ns if ip is not None else {}
    found, value = _resolve(namespace, name)
    if not found:
        return {"version": SNAPSHOT_VERSION, "name": name, "rank": current_rank(), "status": "missing"}
    return snapshot(value, name)


def snapshot(t: Any, name: str = "") -> dict:
    """Snapshot of ``t`` on this rank: no communication, no dispatch (see the module docstring)."""
    import torch

    rank = current_rank()
    base = {"version": SNAPSHOT_VERSION, "name": name, "rank": rank}
    if not isinstance(t, torch.Tensor):
        text = repr(t)
        return {**base, "status": "not_a_tensor", "type": f"{type(t).__module__}.{type(t).__qualname__}",
                "repr": text if len(text) <= 200 else text[:197] + "..."}
    local = getattr(t, "_local_tensor", None)
    spec = getattr(t, "_spec", None)
    cls = type(t)
    qual = f"{cls.__module__}.{cls.__qualname__}"
    if local is None or spec is None:  # a plain tensor
        local = t
        kind = "Tensor"
    else:
        kind = "ShardTensor" if hasattr(spec, "_sharding_shapes") else "DTensor"
    local_shape = [int(s) for s in local.shape]
    elem = int(local.element_size())
    out = {**base, "status": "ok", "kind": kind, "type": qual, "local_shape": local_shape,
           "dtype": str(local.dtype), "device": str(local.device),
           "requires_grad": bool(t.requires_grad),  # a shielded property on ShardTensor: no dispatch
           "element_size": elem, "local_bytes": int(local.numel()) * elem,
           "mesh": None, "placements": [], "sharding_shapes": None, "spec_local_shape": None,
           "spec_offsets": None, "problems": []}
    if kind == "Tensor":
        out["global_shape"] = list(local_shape)
        return out
    meta = spec.tensor_meta
    out["global_shape"] = [int(s) for s in meta.shape]
    out["dtype"] = str(meta.dtype)
    out["mesh"] = _mesh(spec.mesh)
    out["placements"] = [_placement(p) for p in spec.placements]
    coord = out["mesh"]["coordinate"]
    if coord is None:
        out["problems"].append(f"rank {rank} is not in the tensor's mesh {out['mesh']['ranks']}")
        return out
    if str(local.dtype) != out["dtype"]:
        out["problems"].append(f"the spec's dtype is {out['dtype']} but the local tensor is {local.dtype}")
    if kind == "ShardTensor":
        _shardtensor_spec(spec, out)
    else:
        _dtensor_spec(spec, out)
    return out


def _shardtensor_spec(spec, out: dict) -> None:
    ss = spec._sharding_shapes  # never spec.sharding_shapes(): that is a collective when this is None
    coord = out["mesh"]["coordinate"]
    local_attr = getattr(spec, "_local_shape", None)
    if local_attr is not None and [int(s) for s in local_attr] != out["local_shape"]:
        out["problems"].append(f"spec._local_shape is {tuple(int(s) for s in local_attr)} but the local tensor's "
                               f"shape is {tuple(out['local_shape'])}")
    if ss is None:
        if local_attr is not None:
            out["spec_local_shape"] = [int(s) for s in local_attr]
        return
    out["sharding_shapes"] = {str(int(m)): [[int(s) for s in shp] for shp in shapes] for m, shapes in ss.items()}
    spec_local = list(out["global_shape"])
    offsets = [0] * len(spec_local)
    for m, p in enumerate(out["placements"]):
        if p["type"] != "shard":
            continue
        shapes = ss.get(m)
        if shapes is None:
            out["problems"].append(f"mesh dim {m} is {p['text']} but spec._sharding_shapes has no entry for it")
            continue
        c = coord[m]
        if c >= len(shapes):
            out["problems"].append(f"spec._sharding_shapes[{m}] lists {len(shapes)} shards but this rank's "
                                   f"coordinate on mesh dim {m} is {c}")
            continue
        d = p["dim"]
        spec_local[d] = int(shapes[c][d])
        offsets[d] += sum(int(s[d]) for s in shapes[:c])
    out["spec_local_shape"] = spec_local
    out["spec_offsets"] = offsets


def _dtensor_spec(spec, out: dict) -> None:
    """A DTensor's local shape is implied by even (torch.chunk) splitting; ask torch, locally."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(tuple(out["global_shape"]), spec.mesh, spec.placements)
        out["spec_local_shape"] = [int(s) for s in shape]
        out["spec_offsets"] = [int(o) for o in offset]
    except Exception as e:  # noqa: BLE001 - private torch API; degrade to no spec check
        out["problems"].append(f"could not compute the DTensor's local shape from its spec: {type(e).__name__}: {e}")
