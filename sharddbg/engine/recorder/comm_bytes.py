"""How many bytes a collective moves on this rank, from its arguments: one small function per kind of
collective op, in the table ``BYTE_COUNTS``.

Each function takes the op's arguments by their schema names (``args``), the group's global ranks in
group-rank order (``ranks``, None when unknown) and this rank's global rank, and returns a ``CommBytes``.
``sent`` / ``recv`` are the sizes of this rank's send and receive buffers (the part that stays local
included, as NCCL-tests' "size"); ``splits_sent`` / ``splits_recv`` are per group rank (all_to_all only);
``peer`` / ``root`` are global ranks (the ops carry group ranks). Nothing here calls a collective: reading
numel / element_size is metadata. A tensor argument may also be a ``TensorMeta`` (its sizes, kept instead
of the tensor when the bytes are worked out after the call).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


class TensorMeta:
    """What the byte counts need of a collective's input tensor, kept instead of the tensor itself."""

    __slots__ = ("shape", "dtype", "esize")

    def __init__(self, shape, dtype, element_size: int) -> None:
        self.shape, self.dtype, self.esize = shape, dtype, element_size

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.esize

    def dim(self) -> int:
        return len(self.shape)


class CommBytes:
    """The byte counts of one collective call on this rank (see the module docstring); ``first_tensor``:
    its first tensor argument (the input; the output for scatter), whose dtype and shape are recorded."""

    __slots__ = ("sent", "recv", "splits_sent", "splits_recv", "peer", "root", "first_tensor")

    def __init__(self, sent: int, recv: int, splits_sent: list | None = None, splits_recv: list | None = None,
                 peer: int | None = None, root: int | None = None, first_tensor: Any = None) -> None:
        self.sent = sent
        self.recv = recv
        self.splits_sent = splits_sent
        self.splits_recv = splits_recv
        self.peer = peer
        self.root = root
        self.first_tensor = first_tensor

    def __repr__(self) -> str:
        return "CommBytes(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def nbytes(t: Any) -> int:
    """Bytes of a tensor (or TensorMeta), or of every tensor in nested lists/tuples of them."""
    if isinstance(t, (torch.Tensor, TensorMeta)):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return 0


def first_tensor(x: Any):
    """The first tensor in ``x`` (itself, or depth-first in nested lists/tuples), else None."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = first_tensor(y)
            if t is not None:
                return t
    return None


def _global(ranks: list | None, group_rank: int | None) -> int | None:
    """The global rank of a group rank (itself when the group's ranks are unknown)."""
    if ranks and group_rank is not None and 0 <= group_rank < len(ranks):
        return ranks[group_rank]
    return group_rank


def _all_to_all(t: Any, in_splits, out_splits, ranks: list | None) -> CommBytes:
    """all_to_all_single: splits are rows of dim 0; empty/None splits mean equal chunks."""
    n = len(ranks) if ranks else None
    row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else t.numel()) * t.element_size()
    if in_splits:
        ss = [int(x) * row for x in in_splits]
    else:
        ss = [nbytes(t) // n] * n if n else None
    if out_splits:
        sr = [int(x) * row for x in out_splits]
    else:
        sr = list(ss) if ss is not None else None
    sent = sum(ss) if ss is not None else nbytes(t)
    recv = sum(sr) if sr is not None else nbytes(t)
    return CommBytes(sent, recv, ss, sr, first_tensor=t)


# ---- functional collectives (_c10d_functional, _c10d_functional_autograd, _dtensor) ----------------

def funcol_all_gather(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    t = args["input"]
    s = nbytes(t)
    return CommBytes(s, s * int(args["group_size"]), first_tensor=t)


def funcol_same_size(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    """all_reduce, broadcast: the input's size both ways."""
    t = args.get("input", args.get("tensor"))
    s = nbytes(t)
    return CommBytes(s, s, first_tensor=t)


def funcol_reduce_scatter(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    t = args["input"]
    s = nbytes(t)
    return CommBytes(s, s // max(int(args["group_size"]), 1), first_tensor=t)


def funcol_all_to_all(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return _all_to_all(args["input"], args.get("input_split_sizes"), args.get("output_split_sizes"), ranks)


def funcol_coalesced_all_gather(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["inputs"]
    s = nbytes(ts)
    return CommBytes(s, s * int(args["group_size"]), first_tensor=first_tensor(ts))


def funcol_coalesced_reduce_scatter(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["inputs"]
    s = nbytes(ts)
    return CommBytes(s, s // max(int(args["group_size"]), 1), first_tensor=first_tensor(ts))


def funcol_coalesced_same_size(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["inputs"]
    s = nbytes(ts)
    return CommBytes(s, s, first_tensor=first_tensor(ts))


def funcol_send(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    t = args["tensor"]
    return CommBytes(nbytes(t), 0, peer=_global(ranks, args.get("dst")), first_tensor=t)


def funcol_recv(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    t = args["tensor"]
    return CommBytes(0, nbytes(t), peer=_global(ranks, args.get("src")), first_tensor=t)


def dtensor_shard_dim_alltoall(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    t = args["input"]
    s = nbytes(t)
    return CommBytes(s, s, first_tensor=t)


# ---- c10d ops (torch.distributed) --------------------------------------------------------------------

def c10d_same_size(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    """allreduce_, allreduce_coalesced_: the tensors' size both ways."""
    ts = args["tensors"]
    s = nbytes(ts)
    return CommBytes(s, s, first_tensor=first_tensor(ts))


def c10d_broadcast(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["tensors"]
    s = nbytes(ts)
    root = _global(ranks, args.get("root_rank"))
    mine = root == my_rank
    return CommBytes(s if mine else 0, 0 if mine else s, root=root, first_tensor=first_tensor(ts))


def c10d_allgather(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["input_tensors"]), nbytes(args["output_tensors"]),
                     first_tensor=first_tensor(args["input_tensors"]))


def c10d_allgather_base(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["input_tensor"]), nbytes(args["output_tensor"]), first_tensor=args["input_tensor"])


def c10d_allgather_coalesced(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["input_list"]), nbytes(args["output_lists"]),
                     first_tensor=first_tensor(args["input_list"]))


def c10d_allgather_into_tensor_coalesced(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["inputs"]), nbytes(args["outputs"]), first_tensor=first_tensor(args["inputs"]))


def c10d_alltoall_base(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return _all_to_all(args["input"], args.get("input_split_sizes"), args.get("output_split_sizes"), ranks)


def c10d_alltoall(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ins, outs = args["input_tensors"], args["output_tensors"]
    return CommBytes(nbytes(ins), nbytes(outs), [nbytes(x) for x in ins], [nbytes(x) for x in outs],
                     first_tensor=first_tensor(ins))


def c10d_reduce_scatter(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["input_tensors"]), nbytes(args["output_tensors"]),
                     first_tensor=first_tensor(args["input_tensors"]))


def c10d_reduce_scatter_base(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["input_tensor"]), nbytes(args["output_tensor"]), first_tensor=args["input_tensor"])


def c10d_reduce_scatter_tensor_coalesced(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    return CommBytes(nbytes(args["inputs"]), nbytes(args["outputs"]), first_tensor=first_tensor(args["inputs"]))


def c10d_reduce(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["tensors"]
    s = nbytes(ts)
    root = _global(ranks, args.get("root_rank"))
    return CommBytes(s, s if root == my_rank else 0, root=root, first_tensor=first_tensor(ts))


def c10d_gather(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    root = _global(ranks, args.get("root_rank"))
    return CommBytes(nbytes(args["input_tensors"]), nbytes(args["output_tensors"]) if root == my_rank else 0,
                     root=root, first_tensor=first_tensor(args["input_tensors"]))


def c10d_scatter(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    root = _global(ranks, args.get("root_rank"))
    return CommBytes(nbytes(args["input_tensors"]) if root == my_rank else 0, nbytes(args["output_tensors"]),
                     root=root, first_tensor=first_tensor(args["output_tensors"]))


def c10d_send(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["tensors"]
    return CommBytes(nbytes(ts), 0, peer=_global(ranks, args.get("dst")), first_tensor=first_tensor(ts))


def c10d_recv(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    ts = args["tensors"]
    return CommBytes(0, nbytes(ts), peer=_global(ranks, args.get("src")), first_tensor=first_tensor(ts))


def no_bytes(args: dict, ranks: list | None, my_rank: int) -> CommBytes:
    """barrier (moves no data), and an unknown collective op (its bytes are not worked out)."""
    return CommBytes(0, 0)


BYTE_COUNTS: dict[str, Callable[[dict, "list | None", int], CommBytes]] = {
    f.__name__: f
    for f in (
        funcol_all_gather, funcol_same_size, funcol_reduce_scatter, funcol_all_to_all, funcol_coalesced_all_gather,
        funcol_coalesced_reduce_scatter, funcol_coalesced_same_size, funcol_send, funcol_recv,
        dtensor_shard_dim_alltoall,
        c10d_same_size, c10d_broadcast, c10d_allgather, c10d_allgather_base, c10d_allgather_coalesced,
        c10d_allgather_into_tensor_coalesced, c10d_alltoall_base, c10d_alltoall, c10d_reduce_scatter,
        c10d_reduce_scatter_base, c10d_reduce_scatter_tensor_coalesced, c10d_reduce, c10d_gather, c10d_scatter,
        c10d_send, c10d_recv,
        no_bytes,
    )
}
