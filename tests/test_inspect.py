"""The shard inspector on a real 4-rank CPU cluster: snapshots, offsets, checks, the widget's data.

Expected shapes and offsets are computed here independently (balanced row split, cumulative sums),
never read back from the inspector.
"""

from __future__ import annotations

import re

import pytest

import sharddbg
from sharddbg.analysis.layout import ShardLayout
from sharddbg.cluster.inspect import InspectError
from sharddbg.engine import api
from sharddbg.views.inspector import ShardInspector

N = 4
SHAPE = (1, 3, 66, 64)
ROWS = [SHAPE[2] // N + (1 if r < SHAPE[2] % N else 0) for r in range(N)]  # 17, 17, 16, 16
OFFS = [sum(ROWS[:r]) for r in range(N)]  # 0, 17, 34, 50

SETUP = f"""
torch.manual_seed(0)
x = sharddbg.engine.scatter(torch.randn{SHAPE}, dim=2)
not_a_tensor = 42
plain = torch.zeros(rank + 1, 5)
from torch.distributed.device_mesh import DeviceMesh
mesh22 = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("ddp", "domain"))
_i, _j = mesh22.get_coordinate()
ROWS2, COLS2 = [34, 32], [33, 31]
x22 = ShardTensor.from_local(torch.randn(1, 3, ROWS2[_i], COLS2[_j]), mesh22, (Shard(2), Shard(3)),
    sharding_shapes={{0: [(1, 3, r, COLS2[_j]) for r in ROWS2], 1: [(1, 3, ROWS2[_i], c) for c in COLS2]}})
# the same (1, 3, 66, 64) sample per ddp group, sharded over its 2-rank domain sub-mesh
_rows = [33, 33]
xdom = ShardTensor.from_local(torch.randn(1, 3, _rows[_j], 64), mesh22["domain"], (Shard(2),),
    sharding_shapes={{0: [(1, 3, r, 64) for r in _rows]}})
xrep = ShardTensor.from_local(torch.randn(1, 3, _rows[_j], 64), mesh22, (Replicate(), Shard(2)),
    sharding_shapes={{1: [(1, 3, r, 64) for r in _rows]}})
part = ShardTensor.from_local(torch.ones(2, 5), mesh["domain"], (Partial(),), sharding_shapes={{}})
# a plain torch DTensor, uneven the torch way (torch.chunk: 10 rows over 4 ranks -> 3, 3, 3, 1)
from torch.distributed.tensor import DTensor
_dt_rows = [3, 3, 3, 1]
dt = DTensor.from_local(torch.randn(_dt_rows[rank], 6), mesh["domain"], [Shard(0)], run_check=False,
                        shape=torch.Size([10, 6]), stride=(6, 1))
# deliberately inconsistent: the spec lists the rows of ranks 0..3 as 16,16,17,17; they hold 17,17,16,16
WRONG = [(1, 3, r, 64) for r in (16, 16, 17, 17)]
bad = ShardTensor.from_local(x._local_tensor, mesh["domain"], (Shard(2),), sharding_shapes={{0: WRONG}})
"""


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=120)
    return cluster4


def test_uneven_scatter(cl):
    w = cl.inspect("x")
    assert isinstance(w, ShardInspector)
    lay = w.shard_layout
    assert isinstance(lay, ShardLayout) and w.warnings == lay.warnings == []
    df = lay.get_ranks()
    assert list(df["rank"]) == list(range(N))
    assert [s[2] for s in df["local_shape"]] == ROWS
    assert all(s == (1, 3, r, 64) for s, r in zip(df["local_shape"], ROWS))
    assert [o[2] for o in df["offsets"]] == OFFS
    assert all(o[:2] + o[3:] == (0, 0, 0) for o in df["offsets"])
    assert list(df["local_bytes"]) == [3 * r * 64 * 4 for r in ROWS]
    assert df["ok"].all() and lay.warnings == []
    assert list(df["coordinate"]) == [f"domain={r}" for r in range(N)]  # x lives on the domain sub-mesh
    assert lay.global_shape == list(SHAPE) and lay.dtype == "torch.float32" and lay.kind == "ShardTensor"
    assert lay.notes == ["uneven split of tensor dim 2 (66) over mesh dim 'domain': 17, 17, 16, 16 on ranks [0, 1, 2, 3]"]
    # the real local tensors agree (independent read through eval)
    assert cl.eval("tuple(x._local_tensor.shape)") == [tuple(s) for s in df["local_shape"]]
    # diagram: one block per rank along dim 2 (rows) x dim 3 (cols), sized by the real rows
    data = w.data
    pair = data["pairs"][data["default_pair"]]
    assert pair["dims"] == [2, 3]
    blocks = pair["blocks"]
    assert [b["ranks"] for b in blocks] == [[r] for r in range(N)]
    assert [(b["row0"], b["row1"]) for b in blocks] == [(o, o + r) for o, r in zip(OFFS, ROWS)]
    assert all((b["col0"], b["col1"]) == (0, 64) for b in blocks)
    assert [b["uneven"] for b in blocks] == [r < max(ROWS) for r in ROWS]
    # every pair of dims is drawable (4-d: 6 pairs); dims 0 x 1: every slice of the sharded dim 2 would show
    # the same whole block, so there is one diagram, one block listing every rank, each with its slice
    assert len(data["pairs"]) == 6
    (b01,) = data["pairs"][0]["blocks"]
    assert (b01["facet"], b01["ranks"], b01["split_along"]) == ("", list(range(N)), [2])
    assert b01["local_shapes"] == [[1, 3, r, 64] for r in ROWS]
    # module-level entry point and plain-text rendering: a line per rank, the block diagram as characters
    text = repr(sharddbg.inspect("x"))
    assert "rank 3 [domain=3] local (1, 3, 16, 64) offsets (0, 0, 50, 0)" in text
    grid = [line for line in text.splitlines() if any(ch in line for ch in "│┐┤┘")]
    assert [int(m.group(1)) for line in grid if (m := re.search(r"[┐┤┘] (\d+)$", line))] == [0] + OFFS[1:] + [66]
    assert [m.group(0) for line in grid if (m := re.search(r"rank \d\*?", line))] == ["rank 0", "rank 1", "rank 2*", "rank 3*"]


def test_spec_disagrees_with_local(cl):
    lay = cl.inspect("bad").shard_layout
    df = lay.get_ranks()
    assert [s[2] for s in df["local_shape"]] == ROWS  # what the ranks really hold
    assert [s[2] for s in df["spec_local_shape"]] == [16, 16, 17, 17]
    assert not df["ok"].any()
    for r in range(N):
        msgs = [m for m in lay.warnings if m.startswith(f"rank {r} holds a local tensor of shape (1, 3, {ROWS[r]}, 64)")]
        assert len(msgs) == 1, lay.warnings
        assert "the spec disagrees with the local tensor" in msgs[0]
        assert "(1, 3, %d, 64)" % (16 if r < 2 else 17) in msgs[0]
        assert "ranks [0, 1, 2, 3]" in msgs[0]
    assert any("ShardTensor.from_local's sharding_shapes" in n for n in lay.notes)
    # offsets come from the real shapes, not the wrong spec
    assert [o[2] for o in df["offsets"]] == OFFS


def test_multi_dim_mesh(cl):
    rows2, cols2 = [34, 32], [33, 31]
    lay = cl.inspect("x22").shard_layout
    df = lay.get_ranks()
    assert lay.warnings == [], lay.warnings
    for r in range(N):
        i, j = divmod(r, 2)
        assert df.loc[r, "local_shape"] == (1, 3, rows2[i], cols2[j])
        assert df.loc[r, "offsets"] == (0, 0, sum(rows2[:i]), sum(cols2[:j]))
        assert df.loc[r, "coordinate"] == f"ddp={i}, domain={j}"
    assert lay.global_shape == [1, 3, 66, 64]
    assert "uneven split of tensor dim 2 (66) over mesh dim 'ddp': 34, 32 on ranks [0, 2] and [1, 3]" in lay.notes
    assert "uneven split of tensor dim 3 (64) over mesh dim 'domain': 33, 31 on ranks [0, 1] and [2, 3]" in lay.notes
    blocks = lay.blocks(2, 3)
    assert sorted((b["row0"], b["col0"], tuple(b["ranks"])) for b in blocks) == \
        [(0, 0, (0,)), (0, 33, (1,)), (34, 0, (2,)), (34, 33, (3,))]
    # dims 1 x 2 (channels down, H across): dim 3 is sharded but not drawn; its two column ranges hold the
    # same split of H, so one diagram: H 0-34 held by ranks 0 and 1 (each its own W columns), 34-66 by 2 and 3
    assert [(b["facet"], b["row0"], b["row1"], b["col0"], b["col1"], b["ranks"], b["split_along"])
            for b in lay.blocks(1, 2)] == [("", 0, 3, 0, 34, [0, 1], [3]), ("", 0, 3, 34, 66, [2, 3], [3])]

    # a sample per ddp group, sharded over the domain sub-mesh: two groups of two ranks
    lay = cl.inspect("xdom").shard_layout
    assert [g["ranks"] for g in lay.groups] == [[0, 1], [2, 3]]
    assert [o[2] for o in lay.get_ranks()["offsets"]] == [0, 33, 0, 33]
    assert lay.warnings == []
    # with the mesh the ranks sit on (mesh22 is ddp x domain = 2 x 2, row-major like a cluster's), every rank
    # and every group is named by both coordinates
    lay = ShardLayout(cl.apply(api.tensor_snapshot, "xdom"), world_mesh={"ddp": 2, "domain": 2})
    assert list(lay.get_ranks()["coordinate"]) == [f"ddp={r // 2}, domain={r % 2}" for r in range(N)]
    assert [g["label"] for g in lay.groups] == ["ddp=0: ranks [0, 1]", "ddp=1: ranks [2, 3]"]
    # Replicate over ddp, Shard(2) over domain: replicas share one block each
    lay = cl.inspect("xrep").shard_layout
    assert lay.warnings == []
    assert [(b["row0"], b["ranks"]) for b in lay.blocks(2, 3)] == [(0, [0, 2]), (33, [1, 3])]
    assert any("Replicate over mesh dim 'ddp'" in n for n in lay.notes)


def test_replicate_spec_over_sharded_rows(cl):
    """A conv through the DTensor fallback: its output's spec says Replicate (whole on every rank), while
    each rank holds only its own rows. The inspector lays them out as held, each rank a mismatch."""
    cl.run("with sharddbg.engine.without_patches(F.conv2d):\n    y_fb = F.conv2d(x, torch.randn(2, 3, 3, 3), padding=1)",
           timeout=60)
    lay = cl.inspect("y_fb").shard_layout
    assert [p["type"] for p in lay.snapshots[0]["placements"]] == ["replicate"]
    assert cl.eval("tuple(y_fb._local_tensor.shape)") == [(1, 2, r, 64) for r in ROWS]  # what they really hold
    assert [(b["row0"], b["row1"], b["ranks"], b["ok"]) for b in lay.blocks(2, 3)] == \
        [(o, o + r, [k], False) for k, (o, r) in enumerate(zip(OFFS, ROWS))]
    assert lay.inferred == {0: [2]} and not lay.get_ranks()["ok"].any()
    assert any("drawn as the ranks really hold it" in n for n in lay.notes)


def test_partial_and_plain(cl):
    lay = cl.inspect("part").shard_layout
    (b,) = lay.blocks(0, 1)
    assert b["partial"] and b["ranks"] == list(range(N)) and (b["row1"], b["col1"]) == (2, 5)
    assert any(n.startswith("Partial(sum) over mesh dim 'domain'") for n in lay.notes) and lay.warnings == []
    lay = cl.inspect("plain").shard_layout
    assert lay.kind == "Tensor" and lay.warnings == []
    assert [(g["ranks"], g["label"]) for g in lay.groups] == \
        [([r], f"rank {r} (plain tensor, not distributed)") for r in range(N)]
    assert [s for s in lay.get_ranks()["local_shape"]] == [(r + 1, 5) for r in range(N)]


def test_dtensor(cl):
    lay = cl.inspect("dt").shard_layout
    assert lay.kind == "DTensor" and lay.global_shape == [10, 6]
    chunk = [3, 3, 3, 1]  # torch.chunk(10 rows, 4)
    df = lay.get_ranks()
    assert [s[0] for s in df["local_shape"]] == chunk and [s[0] for s in df["spec_local_shape"]] == chunk
    assert [o[0] for o in df["offsets"]] == [0, 3, 6, 9]
    assert df["ok"].all() and lay.warnings == []


def test_bad_input_messages(cl):
    with pytest.raises(InspectError) as e:
        cl.inspect("nope")
    assert "'nope'" in str(e.value) and "[0, 1, 2, 3]" in str(e.value) and "Define it" in str(e.value)
    cl.run("if rank == 2:\n    only_some = x", timeout=30)
    with pytest.raises(InspectError) as e:
        cl.inspect("only_some")
    assert "on ranks [0, 1, 3]; it exists on ranks [2]" in str(e.value)
    with pytest.raises(InspectError) as e:
        cl.inspect("not_a_tensor")
    assert "not a tensor on ranks [0, 1, 2, 3]" in str(e.value) and "builtins.int" in str(e.value) and "42" in str(e.value)
    with pytest.raises(InspectError) as e:
        cl.inspect("x[0]")
    assert "x[0]" in str(e.value)


def test_shard_inspect_magic(cl):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    assert sharddbg.active_cluster() is cl
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sharddbg")
    w = shell.run_line_magic("shard_inspect", "x")
    assert isinstance(w, ShardInspector)
    assert [s[2] for s in w.get_ranks()["local_shape"]] == ROWS
    with pytest.raises(UsageError, match="takes the name of a variable"):
        shell.run_line_magic("shard_inspect", "x + 1")
