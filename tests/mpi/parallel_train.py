"""Train the shared model split as stages x replicas x tensor ranks and compare, every step,
the loss, the gradients and the parameters with a single-process run of the dense model.

    mpirun -n 4 python tests/mpi/parallel_train.py --stages 4 --schedule gpipe --tol 1e-5

Prints ``RANK r MATCH max_grad_diff max_param_diff`` and, with replicas, ``RANK r
REPLICAS IDENTICAL`` once the parameters of every stage are bitwise equal across replicas.
"""
import argparse

import torch
from torch import nn

from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.parallel import HybridParallel, Layout
from hpctrain.parallel.tensor import shard_dims

from parallel_common import batch, build_model, crc, local_view, optimizer, reference


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--balance", default="params")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    x0, _ = batch(0)
    hp = HybridParallel(build_model(), Layout(args.stages, None, args.tensor), nn.MSELoss(), optimizer,
                        micro_batches=args.micro, schedule=args.schedule, balance=args.balance,
                        sample=x0[:4], compression=args.compression)
    grid, rank = hp.grid, hp.grid.rank
    print(f"RANK {rank} {grid.describe()}; {hp.pipeline.describe()}", flush=True)
    ref_grads, ref_params, ref_losses = reference(args.steps)
    shards = shard_dims(hp.module)

    # The gradients as the optimizer receives them inside HybridParallel.train_step: after
    # the pipeline's backward passes and the averaging among replicas, before the update.
    grads = {}
    hp.optimizer.register_step_pre_hook(
        lambda opt, a, kw: grads.update((n, p.grad.detach().clone()) for n, p in hp.module.named_parameters()))
    worst_g = worst_p = 0.0
    for step in range(args.steps):
        x, y = batch(step)
        grads.clear()
        loss = hp.train_step(x, y)
        assert grads, f"rank {rank}: HybridParallel.train_step did not call optimizer.step()"
        for name, g in grads.items():
            diff = (g - local_view(ref_grads[step][name], name, shards)).abs().max().item()
            worst_g = max(worst_g, diff)
        for name, p in hp.module.named_parameters():
            diff = (p.detach() - local_view(ref_params[step][name], name, shards)).abs().max().item()
            worst_p = max(worst_p, diff)
        assert abs(loss - ref_losses[step]) <= args.tol * max(1.0, abs(ref_losses[step])), (loss, ref_losses[step])
    assert worst_g <= args.tol and worst_p <= args.tol, (
        f"rank {rank}: gradients differ by {worst_g:.3g}, parameters by {worst_p:.3g} (tolerance {args.tol})")
    print(f"RANK {rank} MATCH {worst_g:.3g} {worst_p:.3g}", flush=True)

    sums = [crc(p) for p in hp.module.parameters()]
    everyone = grid.dp_comm.allgather(sums)
    assert all(s == everyone[0] for s in everyone), f"rank {rank}: replicas of stage {grid.stage} differ"
    if grid.layout.replicas > 1:
        print(f"RANK {rank} REPLICAS IDENTICAL", flush=True)
    hp.close()


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main()
