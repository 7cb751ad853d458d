"""The ranks of a re-run without sharddbg (``blame=True`` of ``Cluster.check``, ``Cluster.diff`` and
``Cluster.smoke``).

Run as a script by its path, never as ``sharddbg.engine.plain_rerun``: it imports torch, torch.distributed,
physicsnemo and the user's code, and no sharddbg module (it says at the end whether one was loaded anyway).
``python .../plain_rerun.py --serve`` (``cluster.blame.PlainServer``) imports torch and physicsnemo once, then
forks the ranks of each job it is sent (one line on stdin: the job file, the world size, the port), each with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set as torchrun sets them for its workers;
``python .../plain_rerun.py JOB_FILE`` with those set runs one rank by itself.

A check or diff job rebuilds what the check's reference bundle holds for its domain group (the inputs, sharded
again on a plain ``("ddp", "domain")`` mesh as the ranks had them, the models, the values the statement reads),
runs the statement, the loss and its backward, and gathers every output and gradient whole; the first rank
compares them with the unsharded reference the check wrote. A smoke job runs one configuration of the matrix
from the user's ``setup`` and ``step`` (``run_smoke``). Each rank writes its answer as JSON.

Where CUDA is not available it registers physicsnemo's ShardTensor patches itself (``register_custom_ops()``), as
the ranks did and as a CPU script must. sharddbg's own helpers are replaced by plain equivalents written here:
``scatter`` (the domain group's first rank's tensor broadcast, then balanced pieces) and ``without_patches``
(ShardTensor's function registry entries removed for the block); a step function that imports them gets them
from stand-in modules with no file.
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
    """``sharddbg.engine.scatter`` in plain torch.distributed and physicsnemo: the domain group's first rank's
    tensor broadcast, then cut in balanced pieces along ``dim`` (or whole on every rank, ``replicate``)."""
    import torch
    import torch.distributed as dist
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Replicate, Shard

    def scatter(tensor, dim=None, *, batch_dim=0, replicate=False, requires_grad=False):
        domain = mesh["domain"]
        source = int(domain.mesh.flatten().tolist()[0])
        mine = dist.get_rank() == source
        meta = [(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad)) if mine else None]
        dist.broadcast_object_list(meta, src=source, group=domain.get_group())
        shape, dtype, source_grad = meta[0]
        full = tensor.detach().contiguous().clone() if mine else torch.empty(shape, dtype=dtype)
        dist.broadcast(full, src=source, group=domain.get_group())
        if replicate:
            result = ShardTensor.from_local(full, domain, (Replicate(),),
                                            sharding_shapes={0: [tuple(shape)] * domain.size()})
        else:
            axis = dim % len(shape)
            sizes = balanced_sizes(shape[axis], domain.size())
            local = torch.split(full, sizes, dim=axis)[domain.get_local_rank()].contiguous()
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

    register_patches()
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
    answer["versions"] = {"torch": str(torch.__version__), "physicsnemo": getattr(physicsnemo, "__version__", "?"),
                          "python": sys.version.split()[0]}
    return answer


# ---- one configuration of the smoke matrix, without sharddbg ------------------------------------------------
def install_stand_ins(mesh) -> None:
    """A ``sharddbg`` and ``sharddbg.engine`` of plain equivalents (``scatter``, ``without_patches``) for a step
    function that imports them: modules with no file, so never counted as sharddbg code loaded."""
    engine = types.ModuleType("sharddbg.engine")
    engine.scatter = plain_scatter(mesh) if mesh is not None else (lambda tensor, *a, **k: tensor)
    engine.without_patches = plain_without_patches
    package = types.ModuleType("sharddbg")
    package.engine = engine
    package.__path__ = []
    sys.modules.setdefault("sharddbg", package)
    sys.modules.setdefault("sharddbg.engine", engine)


class PlainSmokeContext:
    """The ``ctx`` of the user's ``step(model, ctx)`` in plain physicsnemo, as the smoke matrix hands it on the
    ranks (``sharddbg.engine.smoke.SmokeContext``): the same attributes, ``shard`` and ``replicate``."""

    def __init__(self, config, step, sample, training, mesh, domain_size, samples_per_domain):
        self.config, self.step, self.sample, self.training = config, step, sample, training
        self.mesh, self.domain_size, self.samples_per_domain = mesh, domain_size, samples_per_domain
        self._scatter = plain_scatter(mesh) if mesh is not None and domain_size > 1 else None

    def shard(self, tensor, dim, *, batch_dim=0, requires_grad=False):
        return self._place(tensor, dim, batch_dim, False, requires_grad)

    def replicate(self, tensor, *, batch_dim=0, requires_grad=False):
        return self._place(tensor, None, batch_dim, True, requires_grad)

    def _place(self, tensor, dim, batch_dim, replicate, requires_grad):
        import torch

        if self.samples_per_domain > 1 and batch_dim is not None:  # the drawn sample, then copies rolled by 1, 2, ...
            last = tensor.dim() - 1
            same = last < 0 or last == batch_dim % tensor.dim()
            tensor = torch.cat([tensor if same or k == 0 else tensor.roll(k, dims=last)
                                for k in range(self.samples_per_domain)], dim=batch_dim)
        if self._scatter is None:
            tensor = tensor.detach()
            return tensor.requires_grad_(True) if requires_grad else tensor
        return self._scatter(tensor, dim, batch_dim=batch_dim, replicate=replicate, requires_grad=requires_grad)


def _data_seed(seed: int, step: int, sample: int) -> int:
    """The generator's seed for one sample of one step, as the smoke matrix draws it on the ranks."""
    return (seed * 1_000_003 + step * 1_009 + sample + 1) % (2**63 - 1)


def run_smoke(job: dict) -> dict:
    """One rank of a smoke configuration without sharddbg: the model built from the seed, weights broadcast over
    the domain axis, compiled and wrapped as the configuration says, ``steps`` SGD steps of the user's ``step``
    on the same data; each step's loss and the first step's gradient error against the single-device run's."""
    import pickle as plain_pickle

    import cloudpickle
    import physicsnemo
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from physicsnemo.domain_parallel import ShardTensor

    register_patches()
    plan = job["plan"]
    single = plan["single_device"]
    mesh = None
    if not single:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", tuple(job["mesh_shape"]), mesh_dim_names=("ddp", "domain"))
    rank = 0 if single else dist.get_rank()
    install_stand_ins(mesh)
    answer = {"rank": rank, "raised": None, "losses": [], "grad_error": None, "grad_error_param": None}
    with open(job["functions"], "rb") as f:
        functions = plain_pickle.load(f)
    try:
        setup, step = (cloudpickle.loads(fn) if isinstance(fn, bytes) else fn for fn in functions["setup_step"])
        reference_grads = functions["reference_grads"]
        ddp_index, domain_size = (0, 1) if mesh is None else (mesh.get_coordinate()[0], mesh["domain"].size())
        torch.manual_seed(plan["seed"])
        model = setup()
        if domain_size > 1:
            group = mesh["domain"].get_group()
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)
        if plan["compiled"]:
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            torch._dynamo.reset()
            inductor_config.fx_graph_cache = False  # each rank compiles its own halo exchange (a fresh process)
            functorch_config.enable_autograd_cache = False
            for module in list(model.children()) or [model]:
                module.compile(dynamic=False)
        runner = model
        if plan["wrapper"] == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            runner = DistributedDataParallel(model, process_group=mesh["ddp"].get_group())
        elif plan["wrapper"] == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            runner = fully_shard(model, mesh=mesh["ddp"])
        if not plan["training"]:
            model.eval()
        optimizer = torch.optim.SGD(runner.parameters(), lr=plan["lr"]) if plan["training"] else None
        samples = range(plan["samples"]) if single else [ddp_index]

        def value(loss):
            loss = loss.detach()
            if isinstance(loss, (ShardTensor, DTensor)):
                loss = loss.full_tensor()
            return float(loss.float().reshape(()).item())

        for k in range(plan["steps"]):
            values = []
            for sample in samples:
                ctx = PlainSmokeContext(plan["config"], k, sample, plan["training"], mesh, domain_size,
                                        plan["samples_per_domain"])
                torch.manual_seed(_data_seed(plan["seed"], k, sample))
                if plan["training"]:
                    loss = step(runner, ctx)
                    (loss / len(samples) if len(samples) > 1 else loss).backward()
                else:
                    with torch.no_grad():
                        loss = step(runner, ctx)
                values.append(value(loss))
            if plan["training"] and k == 0 and reference_grads is not None:
                worst = (0.0, None)
                for name, param in model.named_parameters():
                    if param.grad is None or name not in reference_grads:
                        continue
                    grad = param.grad.detach()
                    grad = (grad.full_tensor() if isinstance(grad, (ShardTensor, DTensor)) else grad).float()
                    ref = torch.as_tensor(reference_grads[name])
                    scale = float(ref.abs().max()) if ref.numel() else 0.0
                    error = float((grad - ref).abs().max()) / scale if scale > 0 else 0.0
                    if worst[1] is None or error > worst[0]:
                        worst = (error, name)
                answer["grad_error"], answer["grad_error_param"] = worst
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            answer["losses"].append(sum(values) / len(values))
    except Exception as exc:  # noqa: BLE001 - what the configuration raised without sharddbg is the answer
        answer["raised"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if not single and answer["raised"] is None:
        dist.barrier()
    answer["sharddbg_loaded"] = sorted(m for m, module in sys.modules.items() if (m == "sharddbg" or m.startswith(
        "sharddbg.")) and getattr(module, "__file__", None))
    answer["versions"] = {"torch": str(torch.__version__), "physicsnemo": getattr(physicsnemo, "__version__", "?"),
                          "python": sys.version.split()[0]}
    return answer


def _nvidia_device_present() -> bool:
    """Device nodes, not a CUDA call: a process that forks must not have started the driver."""
    import glob

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _preload() -> None:
    """torch, torch.distributed and physicsnemo imported (its ShardTensor patches registered) once, before the
    ranks are forked: what each of torchrun's fresh workers would do itself, at a quarter of the CPU on four ranks.
    Not on a host with NVIDIA devices: physicsnemo's import may start the CUDA driver, which a fork cannot carry."""
    if _nvidia_device_present():
        return
    import physicsnemo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401

    register_patches()


def register_patches() -> None:
    """physicsnemo registers its ShardTensor patches itself only where CUDA is available; a CPU script calls
    ``register_custom_ops()`` (once: the registries are looked at first)."""
    from physicsnemo.domain_parallel import ShardTensor

    registries = ("_function_registry", "_named_function_registry", "_dispatch_registry", "_dispatch_registry_by_name")
    if not sum(len(getattr(ShardTensor, name, {}) or {}) for name in registries):
        import physicsnemo.domain_parallel as domain_parallel

        domain_parallel.register_custom_ops()


def run_job(job_file: str) -> int:
    """One rank (``RANK`` in the environment) of the job in ``job_file``; its answer written as JSON."""
    with open(job_file) as f:
        job = json.load(f)
    smoke = job.get("kind") == "smoke"
    answer = run_smoke(job) if smoke else run(job)
    if answer is not None and (answer["rank"] == 0 or answer["raised"] or smoke):
        with open(os.path.join(job["out_dir"], f"rank{answer['rank']}.json"), "w") as f:
            json.dump(answer, f)
    return 0


def fork_ranks(job_file: str, world_size: int, master_port: int) -> int:
    """Every rank of one job forked from this process (as torchrun's workers: ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), waited for; 0 when every rank exited with 0. Each rank writes its pid
    (``rank<r>.pid``: the notebook ends it when the job runs past its time) and its output (``rank<r>.log``)
    into the job's folder."""
    with open(job_file) as f:
        out_dir = json.load(f)["out_dir"]
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                with open(os.path.join(out_dir, f"rank{rank}.pid"), "w") as f:
                    f.write(str(os.getpid()))
                log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(log, 1)  # the user's prints and any traceback: never the server's answers on stdout
                os.dup2(log, 2)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
                code = run_job(job_file)
            except BaseException:  # noqa: BLE001 - told in the rank's log, the exit status says it failed
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


def serve() -> int:
    """Preload, then run jobs read from stdin, one a line (``JOB_FILE WORLD_SIZE MASTER_PORT``), answering each
    with its exit status on stdout; ends when stdin closes (the notebook's process ended or let it go)."""
    _preload()
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if len(parts) != 3:
            continue
        code = fork_ranks(parts[0], int(parts[1]), int(parts[2]))
        print(f"done {code}", flush=True)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return serve()
    return run_job(sys.argv[1])  # one rank started by itself, as torchrun starts its workers


if __name__ == "__main__":
    sys.exit(main())
