"""Run under mpirun: a tiny data-parallel loop (mpi4py all-reduce of the gradients) that
calls the Monitor like the trainer does, with knobs to slow one rank or perturb one rank's
parameters on purpose.

    mpirun -n 4 python tests/mpi/monitor_loop.py RUN_DIR --steps 40 --slow-rank 1
"""
import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.monitoring.monitor import Monitor
from hpctrain.state import TrainState

parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--data-seconds", type=float, default=0.004, help="every rank's data phase")
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-seconds", type=float, default=0.04, help="extra data time on the slow rank")
parser.add_argument("--perturb-rank", type=int, default=-1)
parser.add_argument("--perturb-step", type=int, default=20)
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--gather-every", type=int, default=5)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--consistency-every", type=int, default=0)
parser.add_argument("--progress", default="log")
parser.add_argument("--hog-rank", type=int, default=-1, help="this rank holds --hog-mib more memory from step 6 on")
parser.add_argument("--hog-mib", type=int, default=64)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = TrainState(model, optimizer)
batch = 16
monitor = Monitor(args.run_dir, comm, log_every=args.log_every, progress=args.progress,
                  gather_every=args.gather_every, consistency_every=args.consistency_every,
                  slow_rank_window=3, total_steps=args.steps, samples_per_step=batch * size)
assert (monitor.root is not None) == (rank == 0), "rank 0 alone holds the run log"
generator = torch.Generator().manual_seed(rank)
for step in range(1, args.steps + 1):
    times = {}
    t0 = time.perf_counter()
    # data: a sleep stands for reading a batch; the slow rank reads slowly
    time.sleep(args.data_seconds + (args.slow_seconds if rank == args.slow_rank else 0.0))
    if step == 6 and rank == args.hog_rank:
        hog = np.ones(args.hog_mib * 2 ** 20 // 8)  # touched: resident
    x = torch.randn(batch, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    t1 = time.perf_counter()
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    t2 = time.perf_counter()
    flat = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(torch.from_numpy(flat[offset:offset + n] / size).view_as(p))
        offset += n
    t3 = time.perf_counter()
    optimizer.step()
    if step == args.perturb_step and rank == args.perturb_rank:
        with torch.no_grad():
            model.weight[0, 3] += 1e-3  # one element on one rank: the replicas now differ
    t4 = time.perf_counter()
    times = {"data": t1 - t0, "forward_backward": t2 - t1, "allreduce_wait": t3 - t2, "optimizer": t4 - t3}
    state.progress.step = step
    state.progress.epoch = (step - 1) // 20
    if args.checkpoint_every and step % args.checkpoint_every == 0:  # as the trainer saves
        t5 = time.perf_counter()
        path = f"{args.run_dir}/ckpt-{step}.pt"
        if rank == 0:
            torch.save(model.state_dict(), path)
        comm.Barrier()
        times["checkpoint"] = time.perf_counter() - t5
        monitor.on_checkpoint(state, path, times["checkpoint"])
    monitor.on_step(state, {"loss": loss.detach(), "lr": 0.05}, times)
    if args.eval_every and step % args.eval_every == 0:
        with torch.no_grad():
            val = float(torch.nn.functional.mse_loss(model(x), y))
        monitor.on_eval(state, {"val_loss": val, "val_acc": 1.0 / (1.0 + val)})
monitor.on_end(state)
print(f"rank {rank}: loop done", flush=True)
