"""GPU figures: fp16 against fp32 gradient all-reduce of CUDA tensors, and a training step
against PyTorch DDP, on the GPUs of one node (``scripts/gpu-check.sh`` runs it).

    mpirun -n 2 python benchmarks/gpu.py --out bench-results/gpu/gpu.json

Ranks are pinned as the trainer pins them (``cuda:<local rank % GPUs>``). Where ranks share
a GPU, NCCL cannot hold two ranks of one communicator on one device: DDP then runs over gloo
and the result says so. Each measurement that fails is recorded with its error, and the
others still run: on new hardware the failures are findings too.
"""
import argparse
import time

from common import MIB, median, write_result

SIZES = [64 * MIB, 256 * MIB]
# hpctrain's horovod backend refuses ranks that share a GPU (NCCL holds one rank per GPU).
SHARED_HOROVOD = "ranks share a GPU: NCCL needs one rank per GPU"


def cuda_timed(comm, fn, reps, warmup=2):
    """The slowest rank's seconds of each of ``reps`` runs of ``fn``, the GPU drained around each."""
    import torch
    from mpi4py import MPI

    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= warmup:
            times.append(t)
    return times


def allreduce_rows(world, backend_name, reps):
    import torch

    from hpctrain.backends import get_backend

    rows = []
    for compression in ("none", "fp16"):
        backend = get_backend(backend_name, world, compression=compression)
        for nbytes in SIZES:
            module = torch.nn.Module()
            for i in range(16):
                p = torch.nn.Parameter(torch.zeros(nbytes // 64, device=world.device))
                p.grad = torch.randn(nbytes // 64, device=world.device)
                module.register_parameter(f"g{nbytes}{compression}_{i}", p)
            opt = backend.distributed_optimizer(torch.optim.SGD(module.parameters(), lr=0.0), module)
            ts = cuda_timed(world.comm, lambda: backend.synchronize(opt), reps)
            rows.append({"backend": backend_name, "compression": compression, "bytes": nbytes,
                         "median_s": median(ts), "min_s": min(ts), "max_s": max(ts)})
        backend.close()
    return rows


def step_rows(world, shared, reps, width):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpctrain.backends import get_backend
    from train_step import build, init_ddp

    rows = []
    x = torch.randn(256, 256, device=world.device)
    y = torch.randint(0, 16, (256,), device=world.device)
    loss_fn = torch.nn.CrossEntropyLoss()
    for impl in ("ddp", "horovod", "mpi"):
        if impl == "horovod" and shared:
            rows.append({"impl": impl, "skipped": SHARED_HOROVOD})
            continue
        try:
            torch.manual_seed(0)
            model = build("large", width).to(world.device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if impl == "ddp":
                ddp_backend = "gloo" if shared else "nccl"
                init_ddp(world, ddp_backend)
                net = DistributedDataParallel(model, device_ids=None if shared else [torch.cuda.current_device()])
                step = lambda: (loss_fn(net(x), y).backward(), opt.step(), opt.zero_grad())  # noqa: E731
            else:
                backend = get_backend(impl, world)
                opt = backend.distributed_optimizer(opt, model)
                backend.broadcast_state(model, opt)

                def step(backend=backend, opt=opt, model=model):
                    loss_fn(model(x), y).backward()
                    backend.synchronize(opt)
                    backend.step(opt)
                    opt.zero_grad()
            ts = cuda_timed(world.comm, step, reps)
            rows.append({"impl": impl, "median_s": median(ts), "min_s": min(ts), "max_s": max(ts),
                         "note": f"DDP over {ddp_backend}" if impl == "ddp" else ""})
            if impl == "ddp":
                dist.destroy_process_group()
            else:
                backend.close()
        except Exception as exc:  # a finding to report, not a reason to lose the other figures
            rows.append({"impl": impl, "error": f"{type(exc).__name__}: {exc}"[:500]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1440, help="hidden width of the step's model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from hpctrain.runtime.world import init_world

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device here. HINT: run it where nvidia-smi sees a GPU")
    world = init_world()  # pinned as the trainer pins: cuda:<local rank % GPUs>
    shared = world.local_size > torch.cuda.device_count()
    result = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "ranks": world.size,
              "ranks_share_a_gpu": shared, "allreduce": [], "step": []}
    for backend in ("horovod", "mpi"):
        if backend == "horovod" and shared:
            result["allreduce"].append({"backend": backend, "skipped": SHARED_HOROVOD})
            continue
        try:
            result["allreduce"] += allreduce_rows(world, backend, args.reps)
        except Exception as exc:
            result["allreduce"].append({"backend": backend, "error": f"{type(exc).__name__}: {exc}"[:500]})
    by = {(r["backend"], r.get("compression"), r.get("bytes")): r for r in result["allreduce"] if "median_s" in r}
    for (backend, compression, nbytes), r in by.items():
        if compression == "fp16" and (backend, "none", nbytes) in by:
            r["fp16_over_fp32"] = r["median_s"] / by[(backend, "none", nbytes)]["median_s"]
    result["step"] = step_rows(world, shared, args.reps, args.width)
    if world.rank == 0:
        for r in result["allreduce"] + result["step"]:
            print("gpu", r, flush=True)
    write_result(world, args.out, "gpu", vars(args), result)


if __name__ == "__main__":
    main()
