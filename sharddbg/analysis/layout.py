"""The shard inspector's data: every rank's snapshot of one tensor, put together and checked.

``ShardLayout(snapshots)`` takes the per-rank snapshot records of one tensor (``sharddbg.engine.snapshot``;
gathered by ``sharddbg.cluster.inspect``, or read from a file) and is pure data, testable without a
cluster:

- ``get_ranks()``: one row per rank: mesh coordinate, local shape (the real local tensor), the local
  shape the spec claims, global offsets of the local block, memory, requires_grad, check result;
- ``warnings``: where the spec disagrees with a rank's local tensor (a rank's own spec, or another
  rank's ``_sharding_shapes`` about it), ranks that disagree on global shape / dtype / placements, local
  sizes that do not add up to the global size;
- ``blocks(row_dim, col_dim)``: the rectangles of the block diagram for two tensor dims;
- ``to_json()``: everything the inspector widget (``sharddbg.views.inspector``) draws; ``text()``: the
  same as plain text.

Offsets come from the real local shapes of all ranks (cumulative along each sharded mesh dim, within the
same cross-section of a multi-dim mesh), not from the spec, so a wrong spec cannot hide itself.
"""

from __future__ import annotations

import itertools
from typing import Any

import pandas as pd

from ..errors import InspectError
from .formatting import format_bytes, format_shape

__all__ = ["ShardLayout", "InspectError", "RANK_COLUMNS"]

RANK_COLUMNS = ["rank", "group", "coordinate", "local_shape", "spec_local_shape", "offsets", "local_bytes",
                "dtype", "device", "requires_grad", "placements", "ok"]


class ShardLayout:
    """Every rank's view of one tensor, checked against each other. Build from snapshots in rank order."""

    def __init__(self, snapshots: list[dict]):
        if not snapshots:
            raise InspectError("no snapshots: the cluster has no ranks")
        self.snapshots = sorted(snapshots, key=lambda s: s["rank"])
        self.name = self.snapshots[0].get("name", "")
        self._check_found()
        self.warnings: list[str] = [f"rank {s['rank']}: {p}" for s in self.snapshots for p in s.get("problems") or ()]
        self.notes: list[str] = []
        self.kind = self._common("kind")
        self.dtype = self._common("dtype")
        self.by_rank = {s["rank"]: s for s in self.snapshots}
        self.groups = self._groups()
        self.offsets: dict[int, list[int]] = {}
        for g in self.groups:
            self._check_group(g)
            self.offsets.update(self._real_offsets(g))
        self.global_shape = list(self.snapshots[0]["global_shape"])
        self.ndim = len(self.global_shape)

    # ---- validation ---------------------------------------------------------------------------------
    def _check_found(self) -> None:
        name = self.name
        all_ranks = [s["rank"] for s in self.snapshots]
        missing = [s["rank"] for s in self.snapshots if s["status"] == "missing"]
        if missing:
            there = [r for r in all_ranks if r not in missing]
            where = (f"on ranks {missing}; it exists on ranks {there}" if there else f"on any rank ({missing})")
            raise InspectError(f"no variable {name!r} {where}. Define it on every rank first "
                               f"(a %%px cell, or cl.run(...)), then inspect it.")
        other = [s for s in self.snapshots if s["status"] == "not_a_tensor"]
        if other:
            types = sorted({s["type"] for s in other})
            example = other[0]["repr"]
            raise InspectError(f"{name!r} is not a tensor on ranks {[s['rank'] for s in other]}: it is "
                               f"{' / '.join(types)} (rank {other[0]['rank']}: {example}). The inspector shows a "
                               f"ShardTensor, a DTensor or a torch.Tensor.")

    def _common(self, key: str) -> Any:
        """Rank 0's value of ``key``; a warning (not an error: the rest can still be drawn) when the
        ranks disagree on it."""
        by: dict[Any, list[int]] = {}
        for s in self.snapshots:
            by.setdefault(s[key], []).append(s["rank"])
        if len(by) > 1:
            self.warnings.append(f"ranks disagree on {key}: " + "; ".join(f"{v} on ranks {r}" for v, r in by.items()))
        return self.snapshots[0][key]

    def _groups(self) -> list[dict]:
        """Ranks holding one logical tensor: same mesh (its global ranks). Plain tensors: one per rank."""
        groups: dict[tuple, dict] = {}
        for s in self.snapshots:
            mesh = s.get("mesh")
            key = (tuple(_flatten(mesh["ranks"])),) if mesh else (("plain", s["rank"]),)
            g = groups.setdefault(key, {"id": len(groups), "ranks": [], "mesh": mesh,
                                         "placements": s.get("placements") or []})
            g["ranks"].append(s["rank"])
        out = list(groups.values())
        for g in out:
            g["label"] = self._group_label(g, len(out))
        return out

    def _group_label(self, g: dict, n_groups: int) -> str:
        if g["mesh"] is None:
            return f"rank {g['ranks'][0]} (plain tensor, not distributed)"
        if n_groups == 1:
            return "all ranks" if len(g["ranks"]) == len(self.snapshots) else f"ranks {g['ranks']}"
        return f"ranks {g['ranks']}"

    def _check_group(self, g: dict) -> None:
        snaps = [self.by_rank[r] for r in g["ranks"]]
        for key, what in (("global_shape", "global shape"), ("dtype", "dtype")):
            vals = {tuple(s[key]) if isinstance(s[key], list) else s[key] for s in snaps}
            if len(vals) > 1:
                self.warnings.append(f"{g['label']}: ranks disagree on the {what}: " + "; ".join(
                    f"{format_shape(s[key]) if isinstance(s[key], list) else s[key]} on rank {s['rank']}" for s in snaps))
        pl = {tuple(p["text"] for p in s["placements"]) for s in snaps}
        if len(pl) > 1:
            self.warnings.append(f"{g['label']}: ranks disagree on placements: " + "; ".join(
                f"{[p['text'] for p in s['placements']]} on rank {s['rank']}" for s in snaps))
        mesh = g["mesh"]
        if mesh is None:
            return
        names = mesh["dim_names"]
        gshape = snaps[0]["global_shape"]
        shard_dims: dict[int, list[int]] = {}
        for m, p in enumerate(g["placements"]):
            if p["type"] == "shard":
                shard_dims.setdefault(p["dim"], []).append(m)
            elif p["type"] == "partial":
                self.notes.append(f"{p['text']} over mesh dim '{names[m]}': every rank holds a full-size partial "
                                  f"value; the tensor is their {p.get('reduce_op', 'sum')} (an all_reduce away)")
            elif p["type"] == "replicate" and len(g["placements"]) > 1:
                self.notes.append(f"Replicate over mesh dim '{names[m]}': ranks that differ only in '{names[m]}' "
                                  f"hold the same block")
        nested = [d for d, ms in shard_dims.items() if len(ms) > 1]
        if nested:
            self.warnings.append(f"tensor dim(s) {nested} are sharded over more than one mesh dim; offsets are "
                                 f"drawn per mesh dim and may not match the nested layout")
        for s in snaps:  # dims not sharded must be whole on every rank
            for d, (loc, glob) in enumerate(zip(s["local_shape"], s["global_shape"])):
                if d not in shard_dims and loc != glob and not any(p["type"] == "partial" for p in g["placements"]):
                    self.warnings.append(f"rank {s['rank']}: tensor dim {d} is not sharded, but its local size is "
                                         f"{loc} while the global size is {glob}")
        # Every rank's spec (its _sharding_shapes cross-section) against the real local tensors of the
        # ranks it describes.
        coords = {s["rank"]: s["mesh"]["coordinate"] for s in snaps if s["mesh"]["coordinate"] is not None}
        claims: dict[tuple[int, tuple], list[int]] = {}
        for s in snaps:
            ss = s.get("sharding_shapes")
            c = coords.get(s["rank"])
            if not ss or c is None:
                continue
            for m, p in enumerate(s["placements"]):
                if p["type"] != "shard" or str(m) not in ss:
                    continue
                shapes = ss[str(m)]
                for r2, c2 in coords.items():
                    if any(c2[k] != c[k] for k in range(len(c)) if k != m) or c2[m] >= len(shapes):
                        continue
                    said = tuple(shapes[c2[m]])
                    if list(said) != self.by_rank[r2]["local_shape"]:
                        claims.setdefault((r2, said), []).append(s["rank"])
        for (r2, said), by in sorted(claims.items()):
            who = "its own spec says" if by == [r2] else f"the spec on rank{'s' if len(by) > 1 else ''} {sorted(set(by))} says"
            self.warnings.append(f"rank {r2} holds a local tensor of shape {format_shape(self.by_rank[r2]['local_shape'])}, "
                                 f"but {who} {format_shape(said)}: the spec disagrees with the local tensor")
        if claims:
            self.notes.append("a wrong spec makes later ops compute halos, gathers and offsets for shapes the ranks do "
                              "not hold; it is set where the tensor was made (ShardTensor.from_local's sharding_shapes, "
                              "or the op that returned it)")
        # Real sizes along each sharded dim must add up to the global size (per cross-section).
        for d, ms in shard_dims.items():
            if len(ms) > 1:
                continue
            m = ms[0]
            lines: dict[tuple, list[int]] = {}
            for r, c in coords.items():
                lines.setdefault(tuple(c[k] for k in range(len(c)) if k != m), []).append(r)
            uneven: dict[tuple, list[list[int]]] = {}
            for rs in lines.values():
                rs = sorted(rs, key=lambda r: coords[r][m])
                sizes = [self.by_rank[r]["local_shape"][d] for r in rs]
                if sum(sizes) != gshape[d]:
                    self.warnings.append(f"along mesh dim '{names[m]}' (ranks {rs}) the local sizes of tensor dim {d} "
                                         f"are {sizes}, adding up to {sum(sizes)}, but the global shape says {gshape[d]}")
                elif len(set(sizes)) > 1:
                    uneven.setdefault(tuple(sizes), []).append(rs)
            for sizes, groups in uneven.items():
                where = " and ".join(str(rs) for rs in groups)
                self.notes.append(f"uneven split of tensor dim {d} ({gshape[d]}) over mesh dim '{names[m]}': "
                                  f"{', '.join(map(str, sizes))} on ranks {where}")

    def _real_offsets(self, g: dict) -> dict[int, list[int]]:
        """Global offset of each rank's block per tensor dim, from the real local shapes of its peers."""
        out = {}
        mesh = g["mesh"]
        for r in g["ranks"]:
            out[r] = [0] * len(self.by_rank[r]["local_shape"])
        if mesh is None:
            return out
        coords = {r: self.by_rank[r]["mesh"]["coordinate"] for r in g["ranks"]}
        for m, p in enumerate(g["placements"]):
            if p["type"] != "shard":
                continue
            d = p["dim"]
            for r, c in coords.items():
                if c is None:
                    continue
                out[r][d] += sum(self.by_rank[r2]["local_shape"][d] for r2, c2 in coords.items()
                                 if c2 is not None and c2[m] < c[m]
                                 and all(c2[k] == c[k] for k in range(len(c)) if k != m))
        return out

    # ---- data for the views --------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return [s["rank"] for s in self.snapshots]

    @property
    def sharded_dims(self) -> list[int]:
        return sorted({p["dim"] for g in self.groups for p in g["placements"] if p["type"] == "shard"})

    def coordinate_text(self, rank: int) -> str:
        m = self.by_rank[rank].get("mesh")
        if not m or m["coordinate"] is None:
            return ""
        return ", ".join(f"{n}={c}" for n, c in zip(m["dim_names"], m["coordinate"]))

    def rank_ok(self, rank: int) -> bool:
        s = self.by_rank[rank]
        if s.get("problems"):
            return False
        if s.get("spec_local_shape") is not None and s["spec_local_shape"] != s["local_shape"]:
            return False
        return not any(w.startswith(f"rank {rank} ") or w.startswith(f"rank {rank}:") for w in self.warnings)

    def get_ranks(self) -> pd.DataFrame:
        """One row per rank, in rank order."""
        rows = []
        for s in self.snapshots:
            r = s["rank"]
            rows.append({
                "rank": r, "group": self._group_of(r)["id"], "coordinate": self.coordinate_text(r),
                "local_shape": tuple(s["local_shape"]),
                "spec_local_shape": tuple(s["spec_local_shape"]) if s.get("spec_local_shape") is not None else None,
                "offsets": tuple(self.offsets[r]), "local_bytes": int(s["local_bytes"]), "dtype": s["dtype"],
                "device": s["device"], "requires_grad": bool(s["requires_grad"]),
                "placements": ", ".join(p["text"] for p in s.get("placements") or []) or "(not distributed)",
                "ok": self.rank_ok(r),
            })
        return pd.DataFrame(rows, columns=RANK_COLUMNS)

    def _group_of(self, rank: int) -> dict:
        return next(g for g in self.groups if rank in g["ranks"])

    def dim_pairs(self) -> list[tuple[int | None, int]]:
        """The (row dim, column dim) pairs the diagram can draw; ``None`` rows for a 1-d tensor."""
        if self.ndim == 0:
            return [(None, None)]
        if self.ndim == 1:
            return [(None, 0)]
        return list(itertools.combinations(range(self.ndim), 2))

    def default_pair(self) -> tuple[int | None, int]:
        pairs = self.dim_pairs()
        sd = self.sharded_dims
        if self.ndim < 2:
            return pairs[0]
        if len(sd) >= 2:
            return (sd[0], sd[1])
        if len(sd) == 1:
            d = sd[0]
            others = [k for k in range(self.ndim) if k != d]
            big = max(others, key=lambda k: (self.global_shape[k], k))  # the largest other dim, later ones on ties
            return (min(d, big), max(d, big))
        return (self.ndim - 2, self.ndim - 1)

    def blocks(self, row_dim: int | None, col_dim: int | None) -> list[dict]:
        """Rectangles for the block diagram of tensor dims (row_dim, col_dim), per group and facet.

        A rectangle per distinct region: ranks holding the same region (Replicate / Partial) share one,
        listed in ``ranks``. Sharded dims that are not drawn become facets (``facet``: their intervals).
        ``uneven``: the block is smaller than the largest block along a drawn sharded dim.
        """
        out = []
        for g in self.groups:
            partial = any(p["type"] == "partial" for p in g["placements"])
            shard_d = {p["dim"] for p in g["placements"] if p["type"] == "shard"}
            regions: dict[tuple, dict] = {}
            for r in g["ranks"]:
                s = self.by_rank[r]
                loc, off = s["local_shape"], self.offsets[r]

                def span(d):
                    return (0, 1) if d is None else (off[d], off[d] + loc[d])

                facet = tuple((d, off[d], off[d] + loc[d]) for d in sorted(shard_d) if d not in (row_dim, col_dim))
                key = (facet, span(row_dim), span(col_dim))
                b = regions.get(key)
                if b is None:
                    regions[key] = b = {
                        "group": g["id"], "facet": " , ".join(f"dim {d} in [{a}, {e})" for d, a, e in facet),
                        "row0": span(row_dim)[0], "row1": span(row_dim)[1],
                        "col0": span(col_dim)[0], "col1": span(col_dim)[1],
                        "ranks": [], "local_shapes": [], "partial": partial, "ok": True,
                        "sharded_rows": row_dim in shard_d, "sharded_cols": col_dim in shard_d,
                    }
                b["ranks"].append(r)
                b["local_shapes"].append(list(loc))
                b["ok"] = b["ok"] and self.rank_ok(r)
            blocks = list(regions.values())
            for axis, key0, key1 in (("rows", "row0", "row1"), ("cols", "col0", "col1")):
                sizes = [b[key1] - b[key0] for b in blocks if b[f"sharded_{axis}"]]
                biggest = max(sizes) if sizes else None
                for b in blocks:
                    b[f"uneven_{axis}"] = bool(b[f"sharded_{axis}"] and len(set(sizes)) > 1 and b[key1] - b[key0] < biggest)
            for b in blocks:
                b["uneven"] = b["uneven_rows"] or b["uneven_cols"]
            out.extend(sorted(blocks, key=lambda b: (b["facet"], b["row0"], b["col0"], b["ranks"])))
        return out

    def to_json(self) -> dict:
        """Everything the inspector widget draws, as plain data."""
        s0 = self.snapshots[0]
        mesh = s0.get("mesh")
        ranks = self.get_ranks()
        rows = []
        for rec in ranks.to_dict("records"):
            rows.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in rec.items()}
                        | {"local_bytes_text": format_bytes(rec["local_bytes"])})
        pairs = []
        for a, b in self.dim_pairs():
            pairs.append({"dims": [a, b], "label": self._pair_label(a, b), "blocks": self.blocks(a, b)})
        default = self.dim_pairs().index(self.default_pair())
        return {
            "name": self.name, "kind": self.kind, "dtype": self.dtype, "global_shape": self.global_shape,
            "mesh": None if mesh is None else {"dim_names": mesh["dim_names"], "shape": mesh["shape"]},
            "placements": [p["text"] for p in s0.get("placements") or []],
            "groups": [{"id": g["id"], "label": g["label"], "ranks": g["ranks"]} for g in self.groups],
            "ranks": rows, "warnings": list(self.warnings), "notes": list(self.notes),
            "pairs": pairs, "default_pair": default,
            "total_bytes_text": format_bytes(int(ranks["local_bytes"].sum())),
        }

    def _pair_label(self, a, b) -> str:
        def one(d):
            return "—" if d is None else f"dim {d} ({self.global_shape[d]})"

        return f"rows: {one(a)} × cols: {one(b)}" if a is not None else f"{one(b)}"

    def __repr__(self) -> str:
        return self.text()

    def text(self) -> str:
        """A plain-text rendering (terminals, logs, doctests)."""
        s0 = self.snapshots[0]
        mesh = s0.get("mesh")
        head = [f"{self.kind} {self.name!r}: global shape {format_shape(self.global_shape)} {self.dtype}"]
        if mesh:
            head.append("mesh " + " x ".join(f"{n}={k}" for n, k in zip(mesh["dim_names"], mesh["shape"])) +
                        ", placements " + ", ".join(p["text"] for p in s0["placements"]))
        df = self.get_ranks()
        lines = head + [f"  rank {r.rank} [{r.coordinate}] local {format_shape(r.local_shape)} offsets {format_shape(r.offsets)} "
                        f"{format_bytes(r.local_bytes)}{'' if r.ok else '  <-- check'}" for r in df.itertuples()]
        lines += [f"  note: {n}" for n in self.notes] + [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def _flatten(x) -> list:
    if isinstance(x, list):
        return [y for e in x for y in _flatten(e)]
    return [x]
