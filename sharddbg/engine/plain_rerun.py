"""One rank of a re-run without sharddbg (``blame=True`` of ``Cluster.check`` and ``Cluster.diff``).

Started as a script by its path (``python .../plain_rerun.py JOB_FILE``, like torchrun's workers: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment), never as ``sharddbg.engine.plain_rerun``:
it imports torch, torch.distributed, physicsnemo and the user's code, and no sharddbg module (it says at the end
whether one was loaded anyway). It rebuilds what the check's reference bundle holds for its domain group (the
inputs, sharded again on a plain ``("ddp", "domain")`` mesh as the ranks had them, the models, the values the
statement reads), runs the statement, the loss and its backward, and gathers every output and gradient whole.
The first rank compares them with the unsharded reference the check wrote and writes the answer as JSON.

Where CUDA is not available it registers physicsnemo's ShardTensor patches itself (``register_custom_ops()``), as
the ranks did and as a CPU script must. The statement's uses of sharddbg's own helpers are replaced by plain
equivalents written here:
``scatter`` (physicsnemo's ``scatter_tensor``, then balanced pieces) and ``without_patches`` (ShardTensor's
function registry entries removed for the block).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import sys
import traceback
import types

REBUILD = ("sharddbg.engine.reference", "rebuild_tensor")  # how the bundle's tensors are pickled


def rebuild_tensor(data, is_parameter: bool, requires_grad: bool):
    import torch

    if is_parameter:
        return torch.nn.Parameter(data, requires_grad=requires_grad)
    return data.requires_grad_(requires_grad) if data.is_floating_point() or data.is_complex() else data


class PlainUnpickler(pickle.Unpickler):
    """The bundle's pickle without sharddbg: its tensor rebuilder is this module's; anything else of sharddbg's
    cannot be rebuilt here."""

    def find_class(self, module, name):
        if (module, name) == REBUILD:
            return rebuild_tensor
        if module == "sharddbg" or module.startswith("sharddbg."):
            raise pickle.UnpicklingError(f"the statement reads a value of sharddbg's ({module}.{name}), which a run "
                                         f"without sharddbg cannot have")
        return super().find_class(module, name)


def balanced_sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def plain_scatter(mesh):
    """``sharddbg.engine.scatter`` in plain physicsnemo: the domain group's first rank's tensor, in balanced
    pieces along ``dim`` (or replicated)."""
    import torch
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
    from torch.distributed.tensor import Replicate, Shard

    def scatter(tensor, dim=None, *, batch_dim=0, replicate=False, requires_grad=False):
        domain = mesh["domain"]
        source = int(domain.mesh.flatten().tolist()[0])
        import torch.distributed as dist

        meta = [(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad)) if dist.get_rank() == source else None]
        dist.broadcast_object_list(meta, src=source, group=domain.get_group())
        shape, dtype, source_grad = meta[0]
        full = scatter_tensor(tensor.detach().contiguous() if dist.get_rank() == source else None, source, domain,
                              (Replicate(),), global_shape=torch.Size(shape), dtype=dtype)
        if replicate:
            result = full
        else:
            axis = dim % len(shape)
            sizes = balanced_sizes(shape[axis], domain.size())
            local = torch.split(full._local_tensor, sizes, dim=axis)[domain.get_local_rank()].contiguous()
            shapes = [tuple(shape[:axis]) + (s,) + tuple(shape[axis + 1:]) for s in sizes]
            result = ShardTensor.from_local(local, domain, (Shard(axis),), sharding_shapes={0: shapes})
        if requires_grad or source_grad:
            result = result.detach().requires_grad_(True)
        return result

    return scatter


@contextlib.contextmanager
def plain_without_patches(*ops):
    """``sharddbg.engine.without_patches`` in plain physicsnemo: the ops' entries of ShardTensor's function
    registries removed for the block."""
    from physicsnemo.domain_parallel import ShardTensor

    removed = []
    for registry in (ShardTensor._function_registry, ShardTensor._named_function_registry):
        for key in list(registry):
            if key in ops or (isinstance(key, str) and any(getattr(o, "__name__", None) == key.rsplit(".", 1)[-1]
                                                           for o in ops)):
                removed.append((registry, key, registry.pop(key)))
    try:
        yield
    finally:
        for registry, key, handler in removed:
            registry[key] = handler


def _sharded_input(full, layout, mesh, requires_grad: bool):
    """The input as the ranks held it: a ShardTensor over the same mesh dims, with the same pieces."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Replicate, Shard

    sub = mesh[tuple(layout["mesh_dims"])] if len(layout["mesh_dims"]) > 1 else mesh[layout["mesh_dims"][0]]
    coordinate = sub.get_coordinate()
    placements = []
    index = [slice(None)] * full.ndim
    shapes = {int(k): [tuple(s) for s in v] for k, v in layout["sharding_shapes"].items()}
    for mesh_dim, placement in enumerate(layout["placements"]):
        if placement[0] == "shard":
            d = placement[1]
            sizes = [s[d] for s in shapes[mesh_dim]]
            start = sum(sizes[:coordinate[mesh_dim]])
            index[d] = slice(start, start + sizes[coordinate[mesh_dim]])
            placements.append(Shard(d))
        else:
            placements.append(Replicate())
    local = full[tuple(index)].contiguous()
    result = ShardTensor.from_local(local, sub, tuple(placements), sharding_shapes=shapes)
    return result.detach().requires_grad_(True) if requires_grad else result


def _whole(value):
    """The whole tensor of ``value``: a plain one as it is; a sum over ranks (Partial) summed; else every rank's
    local piece gathered over the tensor's mesh and joined along the dim the pieces split (also when the spec
    calls that dim whole, as physicsnemo's DTensor fallback can leave it): what the data says, not the spec."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial

    from physicsnemo.domain_parallel import ShardTensor

    if not isinstance(value, (DTensor, ShardTensor)):
        return value.detach()
    spec = value._spec
    if any(isinstance(p, Partial) for p in spec.placements):
        return value.full_tensor().detach()
    with torch.no_grad():
        local = value._local_tensor.detach().cpu()
    global_shape = tuple(spec.tensor_meta.shape)
    split = [d for d in range(local.ndim) if local.shape[d] != global_shape[d]]
    if not split:
        return local
    pieces: list = [None] * spec.mesh.size()
    dist.all_gather_object(pieces, local, group=spec.mesh.get_group())
    return torch.cat(pieces, dim=split[0])


def run(job: dict) -> dict | None:
    import physicsnemo
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    registries = ("_function_registry", "_named_function_registry", "_dispatch_registry", "_dispatch_registry_by_name")
    if not sum(len(getattr(ShardTensor, name, {}) or {}) for name in registries):
        # physicsnemo registers its ShardTensor patches itself only where CUDA is available; a CPU script calls this
        import physicsnemo.domain_parallel as domain_parallel

        domain_parallel.register_custom_ops()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", tuple(job["mesh_shape"]), mesh_dim_names=("ddp", "domain"))
    group = rank // job["mesh_shape"][1]
    folder = os.path.join(job["job_dir"], f"group{group}")
    with open(os.path.join(folder, "environment.json")) as f:
        environment = json.load(f)
    if environment["cwd"] and os.path.isdir(environment["cwd"]):
        os.chdir(environment["cwd"])
    sys.path[:] = list(dict.fromkeys(environment["sys_path"] + sys.path))
    with open(os.path.join(folder, "bundle.pkl"), "rb") as f:
        bundle = PlainUnpickler(io.BytesIO(f.read())).load()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    scatter = plain_scatter(mesh)
    stand_in = types.SimpleNamespace(engine=types.SimpleNamespace(scatter=scatter, without_patches=plain_without_patches))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "torch": torch, "nn": nn, "F": F, "dist": dist,
                 "physicsnemo": physicsnemo, "ShardTensor": ShardTensor, "Shard": Shard, "Replicate": Replicate,
                 "Partial": Partial, "rank": rank, "world_size": world_size, "mesh": mesh, "sharddbg": stand_in}
    for name, module in bundle["modules"].items():
        if module != "sharddbg" and not module.startswith("sharddbg."):
            namespace[name] = __import__(module, fromlist=["_"])
    for name in bundle["scatter_names"]:
        namespace[name] = scatter
    for name in bundle["no_patches_names"]:
        namespace[name] = plain_without_patches
    namespace.update(bundle["values"])
    namespace.update(bundle["models"])
    inputs = {}
    for name, (data, requires_grad) in bundle["inputs"].items():
        layout = job["layouts"].get(name)
        inputs[name] = _sharded_input(data, layout, mesh, requires_grad) if layout else \
            (data.detach().requires_grad_(requires_grad) if requires_grad else data.detach())
    namespace.update(inputs)
    torch.set_rng_state(bundle["rng"])
    answer = {"rank": rank, "raised": None, "tensors": []}
    try:
        exec(compile(job["stmt"], "<statement>", "exec"), namespace)  # noqa: S102 - the user's own statement
        outputs = {n: namespace[n] for n in job["outputs"] if isinstance(namespace.get(n), torch.Tensor)}
        if job["backward"] == "check":
            if job["loss"]:
                loss = eval(compile(job["loss"], "<loss>", "eval"), namespace)  # noqa: S307
            else:
                terms = [o.square().mean() for o in outputs.values() if o.requires_grad]
                loss = sum(terms[1:], terms[0]) if terms else None
            if loss is not None:
                loss.backward()
        got = {("outputs", n): _whole(v) for n, v in outputs.items()}
        if job["backward"] in ("check", "statement"):
            for n, t in inputs.items():
                if t.grad is not None:
                    got[("input_grads", n)] = _whole(t.grad)
            for m, module in bundle["models"].items():
                for p, param in module.named_parameters():
                    if param.grad is not None:
                        got[("param_grads", f"{m}.{p}")] = _whole(param.grad)
    except Exception as exc:  # noqa: BLE001 - what the statement raised without sharddbg is the answer
        frames = traceback.extract_tb(exc.__traceback__)
        lines = [f.lineno for f in frames if f.filename == "<statement>"]
        answer["raised"] = f"{type(exc).__name__}: {exc}" + (f" (line {lines[-1]} of the statement)" if lines else "")
        got = None
    if rank == 0 and got is not None:
        reference = torch.load(os.path.join(folder, "reference.pt"), weights_only=True)
        for (section, name), mine in got.items():
            expected = reference[section].get(name)
            if expected is None:
                continue
            a, b = mine.double(), expected.double()
            if a.shape != b.shape:
                answer["tensors"].append({"name": name, "section": section, "ok": False, "max_abs": float("nan"),
                                          "note": f"shape {tuple(a.shape)}, the reference's {tuple(b.shape)}"})
                continue
            rtol = job["rtol"] if job["rtol"] is not None else job["default_rtol"].get(str(expected.dtype), 0.0)
            scale = float(b.abs().max()) if b.numel() else 0.0
            atol = job["atol"] if job["atol"] is not None else rtol * scale
            diff = (a - b).abs()
            answer["tensors"].append({"name": name, "section": section, "max_abs": float(diff.max()) if diff.numel()
                                      else 0.0, "ok": bool((diff <= atol + rtol * b.abs()).all()), "note": ""})
    dist.barrier()
    dist.destroy_process_group()
    answer["sharddbg_loaded"] = sorted(m for m in sys.modules if m == "sharddbg" or m.startswith("sharddbg."))
    answer["versions"] = {"torch": torch.__version__, "physicsnemo": getattr(physicsnemo, "__version__", "?"),
                          "python": sys.version.split()[0]}
    return answer


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    answer = run(job)
    if answer is not None and (answer["rank"] == 0 or answer["raised"]):
        with open(os.path.join(job["out_dir"], f"rank{answer['rank']}.json"), "w") as f:
            json.dump(answer, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
