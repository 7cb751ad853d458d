"""Does a ShardTensor's spec agree with the local tensor it wraps? A pure rule over shapes and placements.

A handler builds its result with ``ShardTensor.from_local(local, mesh, placements, sharding_shapes=...)``;
nothing checks that the sharding shapes it passes describe ``local``. A custom op that passes another
tensor's sharding shapes (the points' ``(313, 3)`` for neighbour features of shape ``(313, 17, 3)``) makes a
ShardTensor whose spec lies, and the next op that trusts the spec computes garbage or raises far away. The
recorder keeps each result's local shape, global shape, placements and sharding shapes (plain references,
nothing computed on the hot path) and runs :func:`spec_mismatches` on them when the events are exported, so
a disagreement is named at the op that made it, on the rank where it holds.

What is compared, without communication (each rank knows its own local tensor only):
- ``sharding_shapes[m][c]`` (the shape the spec says the rank at coordinate ``c`` of mesh dim ``m`` holds;
  on a multi-dim mesh the table is the cross-section through this rank's coordinates) against the local
  shape, and the number of entries against the mesh dim's size;
- the global shape: as many dims as the local tensor; a dim no mesh dim shards is whole on every rank; a
  dim one mesh dim shards is the sum of that mesh dim's sharding shapes along it (or, where the spec has no
  sharding shapes, at least the local size).
"""

from __future__ import annotations

from typing import Any, Sequence


class SpecMismatch:
    """One disagreement between a spec and its local tensor (schema.SPEC_MISMATCH_FIELDS less the op's
    ``output`` index and placements, added at export)."""

    __slots__ = ("check", "mesh_dim", "spec_shape", "local_shape", "global_shape", "detail")

    def __init__(self, check: str, mesh_dim: int | None, spec_shape: tuple | None, local_shape: tuple,
                 global_shape: tuple | None, detail: str) -> None:
        self.check = check  # one of schema.SPEC_CHECKS
        self.mesh_dim = mesh_dim
        self.spec_shape = spec_shape
        self.local_shape = local_shape
        self.global_shape = global_shape
        self.detail = detail

    def __repr__(self) -> str:
        return f"SpecMismatch({self.check}: {self.detail})"


def shape_text(shape: Sequence[int]) -> str:
    """'(313, 17, 3)'; '(5,)' for one dim."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _plain_shape(s: Any) -> tuple[int, ...] | None:
    """A shape of ints as a tuple; None for anything else (a symbolic size, a malformed entry)."""
    try:
        return tuple(int(d) for d in s) if all(isinstance(d, int) for d in s) else None
    except TypeError:
        return None


def _sharded_dims(placements: Sequence[Any], ndim: int) -> dict[int, list[int]]:
    """Tensor dim -> the mesh dims that shard it (``Shard(d)`` placements; negative dims normalised)."""
    out: dict[int, list[int]] = {}
    for m, p in enumerate(placements or ()):
        if p.is_shard():
            d = p.dim if p.dim >= 0 else p.dim + ndim
            out.setdefault(d, []).append(m)
    return out


def spec_mismatches(local_shape: Sequence[int], global_shape: Sequence[int] | None, placements: Sequence[Any],
                    sharding_shapes: dict | None, coordinate: Sequence[int], mesh_shape: Sequence[int]
                    ) -> list[SpecMismatch]:
    """Every way the spec (``global_shape``, ``placements``, ``sharding_shapes``: ``{mesh_dim: [shape per
    rank along it]}``) disagrees with a local tensor of ``local_shape`` held at ``coordinate`` of a mesh of
    ``mesh_shape``. Empty when they agree. It runs for every ShardTensor result of a recording: the common
    case (all agree) compares tuples only; the messages are made for a disagreement."""
    local = tuple(local_shape)
    found: list[SpecMismatch] = []
    table: dict[int, Sequence] = {}  # mesh dim -> its sharding shapes, where they are plain ints
    glob = tuple(global_shape) if global_shape is not None else None
    for key, shapes in (sharding_shapes or {}).items():
        try:
            m = int(key)
        except (TypeError, ValueError):
            continue
        if not 0 <= m < len(mesh_shape):
            continue
        c = coordinate[m]
        if len(shapes) == mesh_shape[m] and tuple(shapes[c]) == local:
            table[m] = shapes
            continue
        plain = [_plain_shape(s) for s in shapes]
        if any(s is None for s in plain):
            continue  # symbolic sizes (torch.compile): nothing to compare
        table[m] = plain
        if len(plain) != mesh_shape[m]:
            found.append(SpecMismatch(
                "mesh_size", m, None, local, glob,
                f"the sharding shapes of mesh dim {m} list {len(plain)} ranks, the mesh dim has {mesh_shape[m]}"))
        if c < len(plain) and plain[c] != local:
            found.append(SpecMismatch(
                "sharding_shapes", m, plain[c], local, glob,
                f"spec says {shape_text(plain[c])}, the local tensor is {shape_text(local)} (sharding shapes of "
                f"mesh dim {m}, position {c})"))
    if glob is None:
        return found
    if len(glob) != len(local):
        found.append(SpecMismatch(
            "ndim", None, None, local, glob,
            f"the spec's global shape {shape_text(glob)} has {len(glob)} dims, the local tensor "
            f"{shape_text(local)} has {len(local)}"))
        return found
    sharded = _sharded_dims(placements, len(local))
    for d, size in enumerate(glob):
        by = sharded.get(d)
        if not by:
            if size != local[d]:
                found.append(SpecMismatch(
                    "global_shape", None, glob, local, glob,
                    f"the spec's global shape {shape_text(glob)} says dim {d} is whole ({size}) on every rank, "
                    f"the local tensor is {shape_text(local)}"))
            continue
        shapes = table.get(by[0]) if len(by) == 1 else None
        total = None
        if shapes is not None:
            try:
                total = sum(s[d] for s in shapes)
            except (IndexError, TypeError):
                total = None
        if type(total) is int:
            if total != size:
                found.append(SpecMismatch(
                    "global_shape", by[0], glob, local, glob,
                    f"the sharding shapes of mesh dim {by[0]} add up to {total} along dim {d}, the spec's global "
                    f"shape {shape_text(glob)} says {size}"))
        elif local[d] > size:
            found.append(SpecMismatch(
                "global_shape", by[0], glob, local, glob,
                f"the local tensor {shape_text(local)} holds {local[d]} along dim {d}, more than the spec's global "
                f"shape {shape_text(glob)}"))
    return found
