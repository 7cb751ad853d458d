"""A physicsnemo-style training script: a 3-conv net on samples sharded along H over the 'domain' mesh dim,
gradients averaged over 'ddp' by hand, SGD. Run by torchrun (``python conv_job.py --help``), and imported by
the tests, which run ``train_step`` in a notebook cluster to compare the two recordings.

Faults on request, for the tests: ``--kill-rank R --kill-step S`` (SIGKILL in that step, after its backward),
``--skip-rank R --skip-step S`` (that rank skips the step's gradient all_reduce; with ``--linger`` the ranks
wait before they exit, so that the rank left in that all_reduce hangs instead of seeing its peer leave).
"""

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

SHAPE = (1, 3, 34, 32)  # 34 rows over 2 domain ranks: 17 each


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 2, 3, padding=1))


DEVICE = torch.device("cpu")  # the job's device: --device cuda puts each rank on its own GPU (NCCL)


def dtensor_block(mesh, step: int) -> float:
    """A plain DTensor MLP on the 'domain' mesh dim (no ShardTensor): sharding propagation redistributes its
    inputs, and the user redistributes its result."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    dmesh = mesh["domain"]
    torch.manual_seed(7 + step)
    a = distribute_tensor(torch.randn(8, 6, device=DEVICE), dmesh, [Shard(0)])
    w1 = distribute_tensor(torch.randn(6, 8, device=DEVICE), dmesh, [Shard(1)])
    w2 = distribute_tensor(torch.randn(8, 3, device=DEVICE), dmesh, [Shard(0)])
    y = torch.relu(a @ w1) @ w2
    r = y.redistribute(dmesh, [Replicate()])
    return float(r.to_local().sum())


def train_step(model, opt, mesh, step: int, skip_all_reduce: bool = False) -> float:
    """One step: scatter this ddp group's sample over 'domain', forward, backward, average grads over 'ddp'."""
    from physicsnemo.domain_parallel import scatter_tensor

    rank = dist.get_rank()
    ddp_index = mesh.get_coordinate()[0]
    torch.manual_seed(100 + 10 * step + ddp_index)
    x_full = torch.randn(*SHAPE).to(DEVICE)
    src = mesh["domain"].mesh.flatten()[0].item()
    x = scatter_tensor(x_full, src, mesh["domain"], (Shard(2),), global_shape=x_full.shape, dtype=x_full.dtype)
    y = model(x)
    loss = y.square().mean()
    loss.backward()
    ddp_group = mesh.get_group("ddp")
    if not skip_all_reduce:
        for p in model.parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=ddp_group)
            p.grad = g / mesh["ddp"].size()
    opt.step()
    opt.zero_grad()
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    del rank
    return float(value) + 0.0 * dtensor_block(mesh, step)


def fill_distributed_manager(mesh) -> None:
    """physicsnemo's DistributedManager.initialize() wants an accelerator: on a CPU host its state is filled."""
    from physicsnemo.distributed import DistributedManager

    state = DistributedManager._shared_state
    state.update(_is_initialized=True, _distributed=True, _rank=dist.get_rank(), _world_size=dist.get_world_size(),
                 _local_rank=int(os.environ.get("LOCAL_RANK", 0)), _device=DEVICE, _cuda=DEVICE.type == "cuda",
                 _initialization_method="env", _global_mesh=mesh,
                 _mesh_dims={"ddp": mesh.size(0), "domain": mesh.size(1)})
    DistributedManager()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--skip-rank", type=int, default=-1)
    parser.add_argument("--skip-step", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--kill-note", default=None, help="a file the killed rank writes its clock into first")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds to wait after the last step")
    parser.add_argument("--step-times", default=None, help="rank 0 writes each step's wall time (ms) here, as JSON")
    parser.add_argument("--in-process-recorder", action="store_true",
                        help="record the steps with sharddbg.record() in this process (the notebook's recorder)")
    parser.add_argument("--no-patches", action="store_true", help="leave physicsnemo's patches unregistered")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank, NCCL")
    args = parser.parse_args()
    global DEVICE
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    import physicsnemo.domain_parallel as pdp
    from torch.distributed.device_mesh import init_device_mesh

    if not args.no_patches:
        pdp.register_custom_ops()
    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE.type, (2, world // 2) if world % 2 == 0 else (1, world),
                            mesh_dim_names=("ddp", "domain"))
    fill_distributed_manager(mesh)
    model = build_model().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = dist.get_rank()
    import contextlib
    import time

    times = []
    recording = contextlib.nullcontext()
    if args.in_process_recorder:
        import sharddbg

        recording = sharddbg.record()
    with recording:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            _one_step(args, model, opt, mesh, rank, step)
            times.append((time.perf_counter() - t0) * 1e3)
    if args.step_times and rank == 0:
        import json

        with open(args.step_times, "w") as f:
            json.dump(times, f)
    if args.linger:
        time.sleep(args.linger)
    # the process group is destroyed by physicsnemo's DistributedManager at exit


def _one_step(args, model, opt, mesh, rank: int, step: int) -> None:
    if rank == args.kill_rank and step == args.kill_step:
        import time

        time.sleep(1.5)  # past a flush: what the rank did in this step so far is on disk
        if args.kill_note:
            with open(args.kill_note, "w") as f:
                f.write(str(time.monotonic_ns()))
        os.kill(os.getpid(), signal.SIGKILL)
    loss = train_step(model, opt, mesh, step, skip_all_reduce=(rank == args.skip_rank and step == args.skip_step))
    if rank == 0:
        print(f"step {step}: loss {loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
