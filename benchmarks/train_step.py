"""Training step: hpctrain (a backend) or PyTorch DDP, against the same step without any
communication, and the gradient synchronisation against one fused Allreduce.

    mpirun -n 2 python benchmarks/train_step.py --impl horovod --compression fp16 --model large --out x.json
    mpirun -n 2 python benchmarks/train_step.py --impl ddp --model small --out y.json

One launch measures one implementation. Every launch also times, interleaved with it:
``local`` (the same model, optimizer and batch on this rank alone: the compute of a step)
and ``fused`` (one mpi4py ``Allreduce`` of a float32 buffer of all gradient bytes). Step
times of launches made minutes apart on a shared machine are compared through their
``local`` time as well as directly.

The hpctrain step is the trainer's (``Trainer._train_step``): forward, backward,
``backend.synchronize``, ``backend.step``, ``zero_grad``; the batch is made once in memory
(the data phase is not measured). DDP: ``init_process_group("gloo")`` on 127.0.0.1 with a
port chosen by rank 0 and broadcast over MPI; default buckets (25 MB).
"""
import argparse
import os
import socket
import time

from common import init, median, write_result

MODELS = {
    # examples/large_mlp.toml: ~25M parameters in 54 tensors.
    "large": dict(in_features=256, hidden=1440, depth=12, residual=True, layer_norm=True, num_classes=16),
    # ~1.6M parameters in 390 tensors: per-tensor overheads dominate.
    "small": dict(in_features=256, hidden=128, depth=96, residual=True, layer_norm=True, num_classes=16),
}


def build(model_name, hidden=None):
    from hpctrain.config import ModelConfig
    from hpctrain.models import build_model

    spec = dict(MODELS[model_name])
    if hidden:
        spec["hidden"] = hidden
    return build_model(ModelConfig(name="mlp", **spec))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ddp(world, backend="gloo"):
    import torch.distributed as dist

    port = world.comm.bcast(free_port() if world.rank == 0 else None, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(backend, rank=world.rank, world_size=world.size)
    return dist


class Stepper:
    """One training step of one implementation, timed by phase."""

    def __init__(self, impl, model, world, compression, lr=5e-4):
        import torch

        self.impl, self.model = impl, model
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        self.backend = None
        if impl in ("horovod", "mpi"):
            from hpctrain.backends import get_backend

            self.backend = get_backend(impl, world, compression=compression)
            opt = self.backend.distributed_optimizer(opt, model)
            self.backend.broadcast_state(model, opt)
            self.net = model
        elif impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model)
        else:
            self.net = model
        self.opt = opt
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def step(self, x, y):
        """Seconds of (forward+backward, synchronize, optimizer, whole step)."""
        t0 = time.perf_counter()
        loss = self.loss_fn(self.net(x), y)
        loss.backward()  # DDP: its all-reduce runs here, overlapped with the backward pass
        t1 = time.perf_counter()
        if self.backend is not None:
            self.backend.synchronize(self.opt)
        t2 = time.perf_counter()
        if self.backend is not None:
            self.backend.step(self.opt)
        else:
            self.opt.step()
        self.opt.zero_grad()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("horovod", "mpi", "ddp", "local"), required=True)
    parser.add_argument("--compression", choices=("none", "fp16"), default="none")
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--hidden", type=int, help="override the model width (tests)")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    parser.add_argument("--horovod-cycle-ms", type=float, default=None,
                        help="HOROVOD_CYCLE_TIME for this launch (default: hpctrain's choice, or the environment's)")
    parser.add_argument("--mpi-waits", choices=("yield", "spin"), default=None,
                        help="MPI waits yield the core (hpctrain's default) or spin (Open MPI's own, for a rank "
                             "not oversubscribed): OMPI_MCA_mpi_yield_when_idle for this launch")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.horovod_cycle_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = str(args.horovod_cycle_ms)  # read when Horovod starts
    if args.mpi_waits is not None:  # read when MPI starts, in init() below
        os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1" if args.mpi_waits == "yield" else "0"

    import numpy as np
    import torch

    world = init(threads=1)  # first: hpctrain's MPI settings apply only before MPI starts
    from mpi4py import MPI

    comm = world.comm
    if args.impl == "ddp":
        init_ddp(world)
    torch.manual_seed(0)
    model = build(args.model, args.hidden)
    local_model = build(args.model, args.hidden)
    local_model.load_state_dict(model.state_dict())
    stepper = Stepper(args.impl, model, world, args.compression)
    local = Stepper("local", local_model, world, "none")
    params = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    fused = np.ones(grad_bytes // 4, dtype=np.float32)

    gen = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(args.batch, MODELS[args.model]["in_features"], generator=gen)
    y = torch.randint(0, MODELS[args.model]["num_classes"], (args.batch,), generator=gen)

    for _ in range(args.warmup):
        stepper.step(x, y)
        local.step(x, y)
    comm.Barrier()
    runs = {"impl": [], "local": [], "fused": []}
    done = 0
    while done < args.steps:  # interleaved blocks: load from elsewhere hits all three alike
        n = min(args.block, args.steps - done)
        comm.Barrier()
        runs["impl"] += [stepper.step(x, y) for _ in range(n)]
        comm.Barrier()
        runs["local"] += [local.step(x, y) for _ in range(n)]
        for _ in range(n):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)
            runs["fused"].append(time.perf_counter() - t0)
        done += n

    def phase(kind, i):  # median over steps, then the slowest rank
        return comm.allreduce(median([r[i] for r in runs[kind]]), op=MPI.MAX)

    result = {
        "impl": args.impl, "compression": args.compression, "model": args.model,
        "parameters": sum(p.numel() for p in params), "tensors": len(params), "grad_bytes": grad_bytes,
        "batch_per_rank": args.batch, "steps": args.steps,
        "step_s": phase("impl", 3), "forward_backward_s": phase("impl", 0),
        "sync_s": phase("impl", 1), "optimizer_s": phase("impl", 2),
        "local_step_s": phase("local", 3), "local_forward_backward_s": phase("local", 0),
        "fused_allreduce_s": comm.allreduce(median(runs["fused"]), op=MPI.MAX),
        "step_samples_s": [r[3] for r in runs["impl"]] if world.rank == 0 else None,
        # Horovod's cycle time: what this launch asked for (None: hpctrain's default), what ran.
        "cycle_asked_ms": args.horovod_cycle_ms if args.impl == "horovod" else None,
        "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME") if args.impl == "horovod" else None,
        # MPI waits: what this launch asked for (None: hpctrain's default), and what MPI started with.
        "mpi_waits_asked": args.mpi_waits,
        "mpi_yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle"),
    }
    # What communication adds to a step, however it overlaps: the step minus the local one.
    result["exposed_comm_s"] = result["step_s"] - result["local_step_s"]
    result["step_over_local"] = result["step_s"] / result["local_step_s"]
    result["sync_over_fused"] = result["sync_s"] / result["fused_allreduce_s"] if args.impl in ("horovod", "mpi") else None
    if world.rank == 0:
        print(f"train_step {args.model} {args.impl}/{args.compression} {world.size} ranks: "
              f"step {1e3 * result['step_s']:.1f} ms (local {1e3 * result['local_step_s']:.1f}, "
              f"sync {1e3 * result['sync_s']:.1f}, fused allreduce {1e3 * result['fused_allreduce_s']:.1f})",
              flush=True)
    write_result(world, args.out, "train_step", vars(args), result)
    if stepper.backend is not None:
        stepper.backend.close()
    if args.impl == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
