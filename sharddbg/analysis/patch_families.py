"""Which family of ShardTensor patch would fit each op that fell back to DTensor, and the evidence for it.

Read from the trace alone (no torch): the op's name, the global and local shapes of its sharded input and of
its result, the placements in and out, and what the DTensor fallback moved (the collectives issued inside its
calls). The families are the shapes of physicsnemo's own patches:

- ``pointwise``: the result has its input's global shape and sharding and the fallback moved nothing; the
  handler runs the op on the local tensor and keeps the input's spec (physicsnemo's ``unary_ops`` shape);
- ``halo``: the result is shorter along the sharded dim by a few rows (a stencil without padding: every output
  row reads a neighbourhood of input rows) and the fallback gathered the input whole; the handler fetches
  ``halo_width`` rows from the neighbouring shards (``halo_padding``), runs the op locally and trims (the
  pattern of conv1d/2d/3d's halo patch, ``conv_patches.partial_conv_nd``);
- ``reduction``: the sharded dim is reduced away (or to 1): a local reduction, then one all_reduce or a
  Partial placement (``_reductions.sum_wrapper`` / ``mean_wrapper``);
- ``view``: the same elements in another shape that merges or splits the sharded dim
  (``view_ops.reshape_wrapper``);
- ``global``: every output row depends on the whole sharded dim (a scan, a sort, an FFT): no local patch;
- ``none``: nothing above fits what was recorded, or no result was recorded (the fallback raised).

``classified_fallbacks`` is ``Trace.get_fallbacks()``: ``analysis.ops.fallbacks`` with these columns added.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .comm import call_keys
from .formatting import format_bytes
from .ops import FALLBACK_COLUMNS, fallbacks, is_fallback

__all__ = ["FAMILIES", "FAMILY_COLUMNS", "CLASSIFIED_FALLBACK_COLUMNS", "FamilyFit", "classify_calls",
           "classified_fallbacks", "sharded_dims"]

FAMILIES = ("pointwise", "halo", "reduction", "view", "global", "none")
FAMILY_COLUMNS = ["family", "sharded_dim", "halo_width", "closest_patch", "evidence", "fallback_collectives",
                  "fallback_bytes"]
CLASSIFIED_FALLBACK_COLUMNS = FALLBACK_COLUMNS + FAMILY_COLUMNS

_SHARD = re.compile(r"(?<![_A-Za-z])(?:S\((\d+)\)|Shard\(dim=(\d+)\))")
_PARTIAL = re.compile(r"P\(|Partial\(")
_SHARD_UTILS = "physicsnemo.domain_parallel.shard_utils"
# the physicsnemo handler whose shape a new patch of each family would copy
_HALO_BY_SPATIAL_DIMS = {1: "conv1d", 2: "conv2d", 3: "conv3d"}
_CLOSEST = {
    "pointwise": f"{_SHARD_UTILS}.unary_ops.unsqueeze_wrapper (local op, the input's spec kept)",
    "reduction": "physicsnemo.domain_parallel.custom_ops._reductions.sum_wrapper (local sum, then Partial / "
                 "all_reduce)",
    "view": f"{_SHARD_UTILS}.view_ops.reshape_wrapper (reshape with the sharding shapes carried)",
}
# ops whose every output row reads the whole of the dim they run along: no halo is enough
_WHOLE_DIM_OPS = ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort", "msort", "topk",
                  "kthvalue", "median", "flip", "roll", "fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
# stencils that keep the size along the dim (padded): a halo, of a width their arguments give
_SAME_SIZE_STENCILS = ("conv", "pool", "pad", "interpolate", "upsample", "unfold", "gradient", "diff", "blur")


@dataclass(frozen=True)
class FamilyFit:
    """The family one op's fallback calls point to, with the evidence read from the trace.

    ``sharded_dim``: the input's sharded tensor dim (None when no input was sharded); ``halo_width``: rows each
    shard needs from a neighbour along it (``halo`` only, None where the shapes do not tell); ``closest_patch``:
    the physicsnemo handler a patch of this family would follow; ``evidence``: one sentence of what was seen."""

    family: str
    sharded_dim: int | None
    halo_width: int | None
    closest_patch: str | None
    evidence: str


def sharded_dims(placements) -> list[int]:
    """The tensor dims a placements string (``"(S(2),)"``, ``"(Shard(dim=2),)"``) shards, in mesh-dim order;
    [] for a plain tensor (None) or a replicated one."""
    if not isinstance(placements, str):
        return []
    return [int(a if a is not None else b) for a, b in _SHARD.findall(placements)]


def _shape(value) -> list[int] | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return [int(v) for v in value]


def _numel(shape: list[int]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


def _base_name(op: str) -> str:
    """'torch.nn.functional.avg_pool1d' -> 'avg_pool1d', 'aten.cumsum.default' -> 'cumsum'."""
    parts = op.split(".")
    if op.startswith("aten.") and len(parts) >= 2:
        return parts[1]
    return parts[-1]


def _halo_patch(ndim: int) -> str:
    conv = _HALO_BY_SPATIAL_DIMS.get(max(ndim - 2, 1), "conv2d")
    return f"{_SHARD_UTILS}.conv_patches.partial_conv_nd ({conv}'s halo patch: halo_padding, local op, trim)"


def classify_calls(op: str, calls: pd.DataFrame, moved: pd.DataFrame) -> FamilyFit:
    """The family of ``op`` from its forward fallback calls (rows of ``get_ops()``) and the collectives issued
    inside them (rows of ``get_collectives()``); the first call of the lowest rank speaks for the op."""
    first = calls.sort_values(["rank", "seq"], kind="stable").iloc[0]
    in_pl = list(first["in_placements"] or [])
    gshapes = list(first["in_global_shapes"] or [])
    sharded = next((i for i, p in enumerate(in_pl) if sharded_dims(p)), None)
    if sharded is None or sharded >= len(gshapes):
        return FamilyFit("none", None, None, None, "no input was sharded (the fallback ran on replicated or "
                                                   "plain tensors): nothing to patch along a sharded dim")
    dim = sharded_dims(in_pl[sharded])[0]
    gin = _shape(gshapes[sharded])
    gout, pl_out = _shape(first["out_global_shape"]), first["placements"]
    kinds = sorted(set(moved["kind"])) if len(moved) else []
    gathered = any(k.startswith("all_gather") for k in kinds)
    moved_text = f"the fallback ran {', '.join(kinds)}" if kinds else "the fallback moved nothing"
    name = _base_name(op)
    if gout is None:
        error = first["message"] if isinstance(first["message"], str) else None
        if error and "sharding strategy" in error:
            why = "DTensor has no sharding strategy for it, so the fallback cannot run it at all"
        else:
            why = f"the fallback raised ({first['exc_type']})" if error else "no tensor result was recorded"
        return FamilyFit("none", dim, None, None, f"{why}: the family cannot be read from the trace; input "
                                                  f"{gin} sharded on dim {dim}")
    shape_text = f"{gin} -> {gout}"
    if any(name.startswith(w) or name.endswith(w) for w in _WHOLE_DIM_OPS) and len(gout) == len(gin) \
            and gout[dim] == gin[dim]:
        return FamilyFit("global", dim, None, None,
                         f"{name} reads the whole of the dim it runs along ({shape_text}); {moved_text}: a halo "
                         f"cannot make it local, gathering (as the fallback does) or a scan across ranks is needed")
    if gout == gin and sharded_dims(pl_out) == sharded_dims(in_pl[sharded]) and not kinds:
        return FamilyFit("pointwise", dim, None, _CLOSEST["pointwise"],
                         f"the result keeps the input's global shape {gin} and its sharding {pl_out}, and the "
                         f"fallback moved nothing: pointwise, each shard alone")
    if len(gout) == len(gin) and all(a == b for i, (a, b) in enumerate(zip(gin, gout)) if i != dim):
        shrink = gin[dim] - gout[dim]
        if 0 < shrink < gin[dim] // 2:
            width = (shrink + 1) // 2
            return FamilyFit("halo", dim, width, _halo_patch(len(gin)),
                             f"the result is {shrink} row{'s' if shrink > 1 else ''} shorter along the sharded dim "
                             f"{dim} ({shape_text}), every other dim kept: a {shrink + 1}-point stencil without "
                             f"padding; {moved_text}. A shard needs {width} row{'s' if width > 1 else ''} from each "
                             f"neighbour ({shrink} from one side for a one-sided stencil)")
        if shrink == 0 and (gathered or sharded_dims(pl_out) != sharded_dims(in_pl[sharded])):
            if any(w in name for w in _SAME_SIZE_STENCILS):
                return FamilyFit("halo", dim, None, _halo_patch(len(gin)),
                                 f"{name} is a stencil that keeps the size along the sharded dim {dim} "
                                 f"({shape_text}); {moved_text}: a halo, of a width its arguments give")
            return FamilyFit("none", dim, None, None,
                             f"same shape {shape_text} but the fallback gathered the sharded dim {dim} "
                             f"({moved_text}): a halo of unknown width, or an op that reads the whole dim")
    reduced = (gin[:dim] + gin[dim + 1:], gin[:dim] + [1] + gin[dim + 1:])  # the sharded dim reduced away / to 1
    if gin[dim] > 1 and (gout in reduced or _numel(gout) == 1
                         or (isinstance(pl_out, str) and bool(_PARTIAL.search(pl_out)))):
        return FamilyFit("reduction", dim, None, _CLOSEST["reduction"],
                         f"the sharded dim {dim} is reduced ({shape_text}, out {pl_out}); {moved_text}: a local "
                         f"reduction, then one all_reduce (or a Partial result)")
    if _numel(gout) == _numel(gin) and gout != gin:
        return FamilyFit("view", dim, None, _CLOSEST["view"],
                         f"the same {_numel(gin)} elements in another shape ({shape_text}) that moves the sharded "
                         f"dim {dim} (out {pl_out}); {moved_text}: a view or reshape carrying the sharding shapes")
    return FamilyFit("none", dim, None, None, f"{shape_text}, out {pl_out}; {moved_text}: no patch family fits")


def _moved(calls: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """The forward collectives issued inside ``calls`` (rows of get_ops()), on the same rank."""
    if collectives is None or collectives.empty or calls.empty:
        return collectives.iloc[0:0] if collectives is not None else pd.DataFrame(columns=["kind", "bytes_recv"])
    c = collectives[(collectives["phase"] == "forward").fillna(False).to_numpy(dtype=bool)]
    # (rank, seq) as one integer: the calls' keys looked up for all collectives at once
    keys = call_keys(calls["rank"], calls["seq"])
    rank = c["rank"]
    inside = np.isin(call_keys(rank, c["op_seq"]), keys) | np.isin(call_keys(rank, c["outer_op_seq"]), keys)
    return c[inside]



def _moved_text(moved: pd.DataFrame, calls: int) -> tuple[str, int]:
    """('2 all_gather_into_tensor (480 B received per call and rank)', bytes received per call and rank)."""
    if moved.empty:
        return "nothing", 0
    ranks = max(int(moved["rank"].nunique()), 1)
    calls = max(calls, 1)
    per_call = int(moved["bytes_recv"].sum()) // (calls * ranks) if calls else 0
    counts = moved.groupby("kind").size()
    parts = [f"{int(n) // (calls * ranks) or 1} {k}" for k, n in counts.items()]
    return f"{', '.join(parts)} per call ({format_bytes(per_call)} received per call and rank)", per_call


# The columns of get_ops() and get_collectives() that classify_calls, _moved and _moved_text read.
CALL_COLUMNS_READ = ("op", "path", "rank", "seq", "in_placements", "in_global_shapes", "out_global_shape", "placements",
                     "message", "exc_type")
COLLECTIVE_COLUMNS_READ = ("rank", "phase", "op_seq", "outer_op_seq", "kind", "bytes_recv")


def classified_fallbacks(ops: pd.DataFrame, collectives: pd.DataFrame | None,
                         include_metadata: bool = False) -> pd.DataFrame:
    """``analysis.ops.fallbacks`` with each row's patch family and its evidence (``FAMILY_COLUMNS``):
    ``family`` (one of ``FAMILIES``), ``sharded_dim``, ``halo_width`` (nullable), ``closest_patch``,
    ``evidence``, ``fallback_collectives`` (what the fallback moved per call, in words) and ``fallback_bytes``
    (bytes received per call and rank)."""
    fb = fallbacks(ops, include_metadata)
    if fb.empty:
        out = pd.DataFrame(columns=CLASSIFIED_FALLBACK_COLUMNS)
        out["halo_width"] = out["halo_width"].astype("Int64")
        return out
    # the columns read (classify_calls, _moved, _moved_text), then the rows: a mask moves every column it is given
    calls_all = ops[list(CALL_COLUMNS_READ)][is_fallback(ops, include_metadata) & (ops["phase"] == "forward")]
    if collectives is not None and not collectives.empty:
        collectives = collectives[list(COLLECTIVE_COLUMNS_READ)]
    fits = []
    for row in fb.itertuples(index=False):
        calls = calls_all[(calls_all["op"] == row.op) & (calls_all["path"] == row.path)]
        moved = _moved(calls, collectives)
        if row.category == "metadata":
            fit = FamilyFit("none", None, None, None, "a metadata read: the fallback answers it cheaply and right, "
                                                      "nothing to patch")
        else:
            fit = classify_calls(row.op, calls, moved)
        per_rank_calls = int(calls.groupby("rank").size().max()) if len(calls) else 0
        text, per_call = _moved_text(moved, per_rank_calls)
        fits.append({"family": fit.family, "sharded_dim": fit.sharded_dim, "halo_width": fit.halo_width,
                     "closest_patch": fit.closest_patch, "evidence": fit.evidence, "fallback_collectives": text,
                     "fallback_bytes": per_call})
    out = pd.concat([fb.reset_index(drop=True), pd.DataFrame(fits, columns=FAMILY_COLUMNS)], axis=1)
    out["sharded_dim"] = out["sharded_dim"].astype("Int64")
    out["halo_width"] = out["halo_width"].astype("Int64")
    return out
