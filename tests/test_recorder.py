"""The recorder on a real 4-rank CPU cluster (gloo, patches registered): paths, shapes, modules,
backward, the TypeError trap, hook restoration, overflow, snapshots.

Every expectation is computed independently here (uneven row split, single-process shapes), not read
back from the recorder.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sharddbg.errors import ShardDbgWarning
from sharddbg.trace import Trace

N = 4
H = 66  # rows sharded over the domain axis: 66 over 4 ranks -> 17, 17, 16, 16
ROWS = [H // N + (1 if r < H % N else 0) for r in range(N)]

# On every rank. Seeded, so every rank builds the same X_full and weights. x is built with from_local
# and explicit sharding shapes (tensor_split: 17,17,16,16): physicsnemo's scatter_tensor uses chunk
# (17,17,17,15), and from_local's default "infer" would run a collective.
SETUP = f"""
import torch, torch.nn as nn, torch.nn.functional as F
from torch.distributed.tensor import Shard
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
import physicsnemo.domain_parallel.shard_tensor as _stm
import physicsnemo.domain_parallel.shard_utils.linear_patches as _lin
from torch.nn.modules import module as _nnmod
from sharddbg.engine import recorder as R
from sharddbg.engine.patches import without_patches, NoPatchError

_mesh = DistributedManager().global_mesh["domain"]
torch.manual_seed(0)
X_full = torch.randn(1, 3, {H}, 8)
_rank = torch.distributed.get_rank()
_parts = torch.tensor_split(X_full, {N}, dim=2)
x_local = _parts[_rank].clone().requires_grad_(True)
x = ShardTensor.from_local(x_local, _mesh, (Shard(2),), sharding_shapes={{0: [tuple(p.shape) for p in _parts]}})

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 2, 3, padding=1)
    def forward(self, x):
        return self.conv2(self.conv1(x).relu())

def _catch(fn):
    try:
        fn()
    except BaseException as e:
        c = e.__cause__
        return (type(e).__name__, str(e), type(c).__name__ if c is not None else None)
    return None

def _hook_state():
    regs = tuple(dict(getattr(ShardTensor, n)) for n in
                 ("_function_registry", "_named_function_registry", "_dispatch_registry", "_dispatch_registry_by_name"))
    return (ShardTensor.__dict__["__torch_function__"], ShardTensor.__dict__["__torch_dispatch__"],
            _stm._torch_function_fallback_via_dtensor, _stm._dispatch_fallback_via_dtensor,
            _stm._promote_plain_tensor_to_dtensor, _lin._torch_function_fallback_via_dtensor,
            len(_nnmod._global_forward_pre_hooks), len(_nnmod._global_forward_hooks), regs)
"""


def _line_of(code: str, line: str) -> int:
    """Line number of ``line`` in a cell as it runs (IPython drops a cell's leading empty lines)."""
    return code.lstrip("\n").splitlines().index(line) + 1


# the line of Net.forward that calls the convs (their user frame)
FORWARD_LINE = _line_of(SETUP, "        return self.conv2(self.conv1(x).relu())")


@pytest.fixture(scope="module")
def cl(cluster4):
    cluster4.run(SETUP, timeout=120)
    return cluster4


def _pull(cl, name):
    return cl.view.pull(name, block=True)


def _trace(cl, code, max_events=200_000, unmask=True, timeout=120) -> Trace:
    from sharddbg.engine import api

    cl.apply(api.recording_start, {"max_events": max_events, "unmask": unmask}, timeout=30)
    try:
        cl.run(code, timeout=timeout)
    finally:
        payloads = cl.apply(api.recording_stop, timeout=30)
    return Trace.from_payloads(payloads)


def _fwd(ops, op):
    return ops[(ops["op"] == op) & (ops["phase"] == "forward")]


PATHS_CELL = """
net = Net()
y = net(x)
with without_patches(F.conv2d):
    y_fb = net.conv1(x)
z = x.abs()
y.square().mean().backward()
"""


def test_paths_shapes_modules_backward(cl):
    t = _trace(cl, PATHS_CELL)
    ops = t.get_ops()
    assert sorted(ops["rank"].unique()) == list(range(N))
    for r in range(N):
        o = ops[ops["rank"] == r]
        convs = _fwd(o, "torch.conv2d")
        # net.conv1, net.conv2 (patched), conv1 under without_patches (fallback)
        assert list(convs["path"]) == ["function_handler", "function_handler", "dtensor_fallback_function"]
        assert "conv_patches" in convs["handler"].iloc[0]
        assert list(convs["module"]) == ["conv1", "conv2", "conv1"]
        c1 = convs.iloc[0]
        # the scattered input: local rows computed independently, global = the single-process tensor
        assert c1["in_local_shapes"][0] == [1, 3, ROWS[r], 8]
        assert c1["in_global_shapes"][0] == [1, 3, H, 8]
        expect_out = list(torch.nn.functional.conv2d(torch.zeros(1, 3, H, 8), torch.zeros(4, 3, 3, 3), padding=1).shape)
        assert c1["out_global_shape"] == expect_out
        assert c1["out_local_shape"] == [1, 4, ROWS[r], 8]
        assert c1["placements"] == "(S(2),)"
        assert c1["in_bytes"] == (ROWS[r] * 3 * 8 + 4 * 3 * 3 * 3 + 4) * 4  # x shard + weight + bias, fp32
        assert c1["sharding_shapes"] == {"0": [[1, 4, n, 8] for n in ROWS]}
        # the user's line: Net.forward for the two module calls, the traced cell for the third
        # both are cells sent by cl.run (the set-up cell's Net.forward, the traced cell), named so (no notebook
        # count from a script, and never the ranks' own count or the file IPython compiled them to)
        traced_line = _line_of(PATHS_CELL, '    y_fb = net.conv1(x)')
        assert list(convs["user_frame"]) == [f"cell sent by cl.run, line {FORWARD_LINE} in forward"] * 2 + [
            f"cell sent by cl.run, line {traced_line} in <module>"]
        assert convs["user_cell"].isna().all()
        assert list(convs["user_code"]) == ["return self.conv2(self.conv1(x).relu())"] * 2 + ["y_fb = net.conv1(x)"]
        assert convs["location"].iloc[2] == f"cell sent by cl.run, line {traced_line}: `y_fb = net.conv1(x)`"
        # CPU: each top-level forward call's local computation was timed on plain tensors after recording
        assert convs["local_ms"].notna().all() and (convs["local_ms"] < convs["host_ms"]).all()
        assert o[o["phase"] == "backward"]["local_ms"].isna().all()
        # abs has no patch: the DTensor fallback
        assert _fwd(o, "Tensor.abs")["path"].tolist() == ["dtensor_fallback_function"]
        # backward of each patched conv is its own event, linked to its forward
        bw = o[(o["phase"] == "backward") & (o["op"] == "torch.conv2d")]
        assert set(bw["fwd_seq"]) == set(convs["seq"].iloc[:2])
        assert bw["autograd_node"].notna().all()
        assert set(bw["module"]) == {"conv1", "conv2"}
        assert o["host_ms"].gt(0).all() and o["device_ms"].isna().all()  # CPU: no device time
        # weights promoted to Replicate, named from the module tree
        prom = t.get_promotions()
        pr = prom[(prom["rank"] == r) & (prom["seq"] == c1["seq"])]
        assert set(pr["param"]) == {"conv1.weight", "conv1.bias"}
        assert tuple(pr[pr["param"] == "conv1.weight"]["shape"].iloc[0]) == (4, 3, 3, 3)
    fb = t.get_fallbacks()
    absrow = fb[fb["op"] == "Tensor.abs"].iloc[0]
    assert absrow["ranks"] == list(range(N)) and absrow["calls"] == N
    conv_fb = fb[(fb["op"] == "torch.conv2d")]
    assert conv_fb["calls"].sum() == N  # once per rank, under without_patches
    for p in t.payloads.values():  # the recorder never re-entered dispatch and had no internal errors
        assert p["meta"]["reentries"] == 0 and p["meta"]["internal_errors"] == []
        assert p["meta"]["patch_mode"] == "registered"


TRAP = """
def _boom_add(func, types, args, kwargs):
    raise TypeError("sharddbg-test: add handler exploded")
ShardTensor.register_function_handler(torch.Tensor.add, _boom_add)
ShardTensor.register_function_handler(torch.Tensor.__rsub__, _boom_add)
"""

UNTRAP = """
ShardTensor._function_registry.pop(torch.Tensor.add, None)
ShardTensor._function_registry.pop(torch.Tensor.__rsub__, None)
"""


def test_typeerror_trap_unmasked(cl):
    cl.run(TRAP, timeout=30)
    try:
        # without the recorder: PyTorch's generic message, no cause (proves the trap is real)
        cl.run("plain = _catch(lambda: x + x); plain_r = _catch(lambda: 1 - x)", timeout=60)
        for res in _pull(cl, "plain") + _pull(cl, "plain_r"):
            assert res[0] == "TypeError" and "unsupported operand" in res[1]
            assert "exploded" not in res[1] and res[2] is None
        t = _trap_trace(cl, unmask=True)
        for res in _pull(cl, "dunder") + _pull(cl, "dunder_r"):
            assert res[0] == "UnmaskedOpError", res
            assert "sharddbg-test: add handler exploded" in res[1] and res[2] == "TypeError"
        # the message names the user's line: the lambda of the traced cell
        for res in _pull(cl, "dunder"):
            line = _line_of(TRAP_CELL, "dunder = _catch(lambda: x + x)")
            assert "at cell sent by cl.run, " in res[1] and f"line {line}: `dunder = _catch(lambda: x + x)`" in res[1], res[1]
        for r, res in enumerate(_pull(cl, "method")):  # not a dunder: unchanged
            assert res == ("TypeError", "sharddbg-test: add handler exploded", None), (r, res)
        errs = t.get_errors()
        assert sorted(errs["rank"]) == sorted(list(range(N)) * 3)
        assert (errs["exc_type"] == "TypeError").all()
        assert errs["message"].eq("sharddbg-test: add handler exploded").all()
        assert errs["traceback"].str.contains("_boom_add").all()
        # each recorded traceback starts at the user's code (the traced cell, named as IPython does), above
        # the handler that raised
        for tb in errs["traceback"]:
            assert "Cell sent by cl.run" in tb and tb.index("Cell sent by") < tb.index("_boom_add"), tb
            assert "sharddbg/engine" not in tb  # the recorder's own frames are left out
        assert errs["unmasked"].sum() == 2 * N  # x + x and 1 - x, not x.add(x)
        assert set(errs["op"]) == {"Tensor.add", "Tensor.__rsub__"}
        # unmask=False: PyTorch's behaviour, still recorded
        t2 = _trap_trace(cl, unmask=False)
        for res in _pull(cl, "dunder"):
            assert res[0] == "TypeError" and "unsupported operand" in res[1]
        assert len(t2.get_errors()) == 3 * N
    finally:
        cl.run(UNTRAP, timeout=30)


TRAP_CELL = """
dunder = _catch(lambda: x + x)
dunder_r = _catch(lambda: 1 - x)
method = _catch(lambda: x.add(x))
"""


def _trap_trace(cl, unmask):
    return _trace(cl, TRAP_CELL, unmask=unmask)


def test_real_error_recorded_per_rank(cl):
    # a real physicsnemo failure: max_pool2d on an uneven shard (17 rows is not divisible by 2). The
    # handler checks every rank's shard, so every rank raises it, the 16-row ranks too.
    t = _trace(cl, "pool = _catch(lambda: F.max_pool2d(x, 2))")
    res = _pull(cl, "pool")
    errs = t.get_errors()
    for r in range(N):
        e = errs[errs["rank"] == r]
        assert res[r] is not None and "local size 17" in res[r][1], (r, res[r])
        assert len(e) == 1 and e["exc_type"].iloc[0].endswith(res[r][0])
        assert e["message"].iloc[0] == res[r][1]
        assert e["traceback"].iloc[0].count("Traceback") >= 1
        # F.max_pool2d is torch's boolean_dispatch wrapper: that is the function __torch_function__ sees
        assert e["op"].iloc[0] == "torch.nn.functional.boolean_dispatch.<locals>.fn"


HANDLED_CELL = """
try:
    F.max_pool2d(x, 2)
except Exception as e:
    pool_error = str(e)
y = x * 2
"""
ESCAPED_CELL = """
try:
    F.max_pool2d(x, 2)
except Exception as e:
    raise RuntimeError("pooling failed") from e
"""

WITH_BLOCK_CELL = """
try:
    with R.Recorder() as _rec:
        try:
            F.max_pool2d(x, 2)
        except Exception:
            pass
        F.max_pool2d(x, 2)
except Exception:
    pass
_handled = [e["error"]["handled"] for e in _rec.events if e["kind"] == "op" and e["error"]
            and e["error"]["origin_seq"] == e["seq"]]
"""


def test_handled_errors_are_not_failures(cl):
    """An op error the cell caught (try/except, then the cell went on) is recorded as handled: no failure, no
    "raised" in the headline, no error mark in the explorer; one that escapes the cell, chained into the
    exception that ended it, is a failure."""
    from sharddbg.errors import RankError
    from sharddbg.views.explorer import explorer_frame

    t = cl.trace(HANDLED_CELL, display=False)
    errs = t.get_errors()
    assert sorted(errs["rank"]) == list(range(N)) and errs["handled"].tolist() == [True] * N
    assert set(errs["op"]) == {"torch.nn.functional.boolean_dispatch.<locals>.fn"}
    assert [f for f in t.findings if f.severity == "fail"] == []
    handled = [f for f in t.findings if f.kind == "error_handled"]
    assert len(handled) == 1 and handled[0].severity == "info", t.findings
    assert handled[0].sentence.startswith(f"{N} op calls raised and the cell handled them: ")
    assert "UndeterminedShardingError: Sharded dimension 2 with local size 17" in handled[0].sentence
    assert t.overview.errors == 0 and t.overview.handled_errors == N
    assert f", 0 raised ({N} more raised and handled), " in t.overview.headline()
    assert "error" not in set(explorer_frame(t)["kind"])
    for p in t.payloads.values():  # recorded on the rank, in the record
        (err,) = [e["error"] for e in p["events"] if e["kind"] == "op" and e["error"]]
        assert err["handled"] is True

    with pytest.raises(RankError):
        cl.trace(ESCAPED_CELL, display=False)
    t = cl.last_trace()
    errs = t.get_errors()
    assert sorted(errs["rank"]) == sorted(list(range(N)) * 2)  # the op's exception and the one it became
    assert errs["handled"].tolist() == [False] * (2 * N)
    assert t.findings[0].kind == "error" and t.findings[0].severity == "fail"
    assert {f.sentence.split(" raised ")[1].split(":")[0] for f in t.findings if f.kind == "error"} == {
        "RuntimeError", errs["exc_type"][errs["op"] != "<outside recorded ops>"].iloc[0]}
    assert t.overview.errors == N and t.overview.handled_errors == 0
    assert (explorer_frame(t)["kind"] == "error").sum() == N

    # a Recorder used as a with block: the exception that leaves the block was not handled, the caught one was
    cl.run(WITH_BLOCK_CELL, timeout=60)
    assert cl.eval("_handled") == [[True, False]] * N


def test_hooks_restored_nested_refused_overflow(cl):
    cl.run("""
s0 = _hook_state()
try:
    with R.Recorder():
        x.abs()
        raise ValueError("user error inside the recorder")
except ValueError:
    pass
after_exc = _hook_state() == s0
try:
    with R.Recorder():
        with R.Recorder():
            pass
    nested = "allowed"
except R.RecorderError as e:
    nested = str(e)
after_nested = _hook_state() == s0
R.start()
try:
    R.start()
    restart = "allowed"
except R.RecorderError as e:
    restart = str(e)
R.stop()
try:
    with without_patches(F.conv2d):
        assert F.conv2d not in ShardTensor._function_registry
        raise KeyError("x")
except KeyError:
    pass
try:
    with without_patches(torch.abs):
        pass
    nopatch = None
except NoPatchError as e:
    nopatch = str(e)
after_patches = _hook_state() == s0
with torch.no_grad():
    with R.Recorder(max_events=3) as small:
        for _ in range(10):
            x.abs()
    with R.Recorder() as big:
        for _ in range(10):
            x.abs()
small_n, small_dropped, big_n = len(small.events), small.dropped, len(big.events)
small_payload = small.payload()
""", timeout=120)
    assert _pull(cl, "after_exc") == [True] * N
    assert all("already active" in s for s in _pull(cl, "nested"))
    assert _pull(cl, "after_nested") == [True] * N
    assert all("already active" in s for s in _pull(cl, "restart"))
    assert all(s is not None and "Tensor.abs" not in s and "no ShardTensor patch" in s for s in _pull(cl, "nopatch"))
    assert _pull(cl, "after_patches") == [True] * N
    big = _pull(cl, "big_n")
    assert big == [big[0]] * N and big[0] >= 10 and big[0] % 10 == 0  # the same events for each of 10 calls
    assert _pull(cl, "small_n") == [3] * N
    assert _pull(cl, "small_dropped") == [b - 3 for b in big]
    with pytest.warns(ShardDbgWarning, match="dropped"):
        t = Trace.from_payloads(_pull(cl, "small_payload"))
    assert t.dropped == sum(b - 3 for b in big)


def test_snapshot_from_another_thread_sees_in_flight_op(cl):
    cl.run("""
import threading
_gate, _taken, _snap = threading.Event(), threading.Event(), {}
def _blocking_handler(func, types, args, kwargs):
    _gate.set()           # main thread is now inside the op
    _taken.wait(30)       # ... and stays there until the snapshot was taken
    return args[0]
ShardTensor.register_function_handler(torch.Tensor.cosh, _blocking_handler)
def _reader():
    _gate.wait(30)
    _snap["p"] = R.peek()
    _taken.set()
R.start()
th = threading.Thread(target=_reader); th.start()
try:
    x.cosh()
finally:
    th.join(30)
    ShardTensor._function_registry.pop(torch.Tensor.cosh, None)
final = R.stop()
snap = _snap["p"]
""", timeout=120)
    snaps = _pull(cl, "snap")
    t = Trace.from_payloads(snaps)
    assert t.incomplete_ranks == list(range(N))
    ops = t.get_ops()
    for r in range(N):
        o = ops[(ops["rank"] == r) & (ops["op"] == "Tensor.cosh")]
        assert len(o) == 1 and bool(o["in_flight"].iloc[0]) and o["path"].iloc[0] == "function_handler"
        assert pd_isna(o["t_end_ns"].iloc[0])
    finals = Trace.from_payloads(_pull(cl, "final"))
    assert finals.incomplete_ranks == []
    fo = finals.get_ops()
    assert (~fo[fo["op"] == "Tensor.cosh"]["in_flight"].astype(bool)).all()


def test_partial_gather_rank_missing(cl):
    t = _trace(cl, "x.abs()")
    payloads = [t.payloads[r] for r in range(N)]
    payloads[2] = None  # a rank that sent nothing (timed out before a snapshot)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardDbgWarning)
        t2 = Trace.from_payloads(payloads)
    assert t2.incomplete_ranks == [2]
    assert sorted(t2.get_ops()["rank"].unique()) == [0, 1, 3]


def pd_isna(v):
    import pandas as pd

    return pd.isna(v)


def test_backward_hook_on_a_thread_without_python_frames(cl):
    # On CUDA the autograd engine runs backward nodes on its own device thread, which has no Python
    # frame above the hook: the recorder must still record the backward event (a frame lookup there
    # once raised inside the hook, losing every backward event on GPUs).
    cl.run("""
import _thread, time
from sharddbg.engine.recorder.autograd import BOX_KEY
R.start()
yb = x * 2.0
_box = yb.grad_fn.metadata[BOX_KEY]
# the hook itself is the thread's first Python frame, as on the autograd engine's device thread
_thread.start_new_thread(_box.post_hook, ((), ()))
_deadline = time.monotonic() + 30
while time.monotonic() < _deadline and not any(e["phase"] == "backward" for e in R.peek()["events"]):
    time.sleep(0.01)
bt_final = R.stop()
""", timeout=60)
    for payload in _pull(cl, "bt_final"):
        assert payload["meta"]["internal_errors"] == []
        bw = [e for e in payload["events"] if e["kind"] == "op" and e["phase"] == "backward"]
        fw = {e["seq"]: e for e in payload["events"] if e["kind"] == "op" and e["phase"] == "forward"}
        assert len(bw) == 1 and bw[0]["thread"] == 1, bw
        fwd = fw[bw[0]["fwd_seq"]]
        assert bw[0]["op"] == fwd["op"] and bw[0]["user_frame"] == fwd["user_frame"] is not None


def test_internal_frames_recognised_through_dotdot_paths():
    # A checkout imported through a path such as bench/../sharddbg (sys.path entries are not normalised)
    # must still count as sharddbg's own frames, or user_frame stops inside the recorder.
    import os

    import sharddbg
    from sharddbg.engine.frames import is_library_file

    pkg = os.path.dirname(os.path.abspath(sharddbg.__file__))
    odd = os.path.join(pkg, "engine", "..", "engine", "recorder.py")
    assert is_library_file(odd)
    assert not is_library_file("/tmp/user_notebook_cell.py")
    # physicsnemo's frames are library frames even when it is imported after sharddbg
    import physicsnemo.domain_parallel.shard_tensor as stm

    assert is_library_file(stm.ShardTensor.__dict__["__torch_function__"].__func__.__code__.co_filename)


def test_nothing_recorded_while_torch_compile_traces(cl):
    # Under torch.compile the wrappers see FakeTensor operands (and funcol ops on them) while dynamo /
    # AOTAutograd trace: none of that may become an event. The compiled graph then runs on the local
    # tensors below ShardTensor's hooks.
    cl.run("""
_fc = torch.compile(lambda t: (t * 2.0).relu().sum(), backend="aot_eager")
_eager = (x * 2.0).relu().sum().full_tensor()
with R.Recorder() as _crec:
    _out = _fc(x)
comp_final = _crec.payload()
comp_fake = _crec.calls_while_compiling
comp_ok = bool(torch.allclose(_out.full_tensor(), _eager))
""", timeout=240)
    assert all(_pull(cl, "comp_ok"))
    assert all(n > 0 for n in _pull(cl, "comp_fake")), "the trace never reached the recorder's wrappers"
    for payload in _pull(cl, "comp_final"):
        assert payload["meta"]["internal_errors"] == [] and payload["meta"]["reentries"] == 0
        assert payload["events"] == [], payload["events"][:3]


def test_recording_leaves_the_random_stream_alone(cl):
    """Traced and untraced runs agree bit for bit: what the recorder does after the cell (timing each op's
    local computation) draws nothing from the user's random stream."""
    cl.run("torch.manual_seed(7)", timeout=30)
    _trace(cl, "_r0 = x.abs()\n_d = torch.nn.functional.dropout(x_local, 0.5)")
    traced = cl.eval("torch.rand(4).tolist()")
    cl.run("torch.manual_seed(7)\n_r0 = x.abs()\n_d = torch.nn.functional.dropout(x_local, 0.5)", timeout=30)
    untraced = cl.eval("torch.rand(4).tolist()")
    assert traced == untraced
