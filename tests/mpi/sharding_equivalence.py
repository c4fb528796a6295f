"""Sharded training equals replicated training: for SGD with momentum and AdamW (with
accumulation and gradient clipping), train the same tiny model with comm.shard none,
optimizer and gradients in one launch, and compare every rank's parameters and losses.

    mpirun -n 4 python tests/mpi/sharding_equivalence.py OUT horovod|mpi

Prints ``SAME <optimizer> <mode> max|diff| <d>`` per comparison on rank 0 and raises (every
rank) when a sharded run's parameters differ from the replicated run's beyond float
tolerance, or when the ranks of a sharded run do not hold identical parameters. Also runs
parameter groups (decay groups; a user's optimizer whose biases have half the learning rate),
fp16 gradient compression and bf16 autocast with sharding, against their replicated twins.
"""
import os
import sys

import numpy as np
import torch

from hpctrain import Trainer, load_config
from train_tiny import synthetic  # the same data as the other tiny runs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: userpkg

STEPS = 20


class Losses:
    def __init__(self):
        self.values = []

    def on_step(self, state, metrics, phase_times):
        self.values.append(metrics["loss"])


def train(out, backend, overrides):
    cfg = load_config(None, ["model.in_features=8", "model.hidden=24", "model.depth=2", "model.num_classes=4",
                             "train.global_batch_size=48", "train.accumulation=2", "train.epochs=1",
                             f"train.max_steps={STEPS}", "train.clip_grad_norm=0.3", "data.val=none",
                             "monitor.progress=off", "monitor.log_every=100", f"comm.backend={backend}",
                             f"run.root={out}/runs", *overrides])
    losses = Losses()
    trainer = Trainer(cfg, train_data=synthetic(960, 1), checkpoints=None, callbacks=[losses])
    trainer.fit()
    params = np.concatenate([p.detach().reshape(-1).numpy() for p in trainer.state.model.parameters()])
    return trainer.world, params, np.array(losses.values)


def compare(world, name, ref, got, rtol, atol):
    (p0, l0), (p1, l1) = ref, got
    everywhere = world.comm.allgather(p1)
    if any(not np.array_equal(everywhere[0], p) for p in everywhere):
        raise AssertionError(f"{name}: the ranks' parameters differ after sharded training")
    diff = float(np.abs(p0 - p1).max())
    if not (np.allclose(p0, p1, rtol=rtol, atol=atol) and np.allclose(l0, l1, rtol=rtol, atol=atol)):
        raise AssertionError(f"{name}: sharded differs from replicated: max|diff| {diff}, losses {l0} vs {l1}")
    if world.rank == 0:
        print(f"SAME {name} max|diff| {diff:.3g}", flush=True)


def main(out, backend):
    torch.set_num_threads(1)
    optimizers = {"sgd": ["train.optimizer=sgd", "train.lr=0.2", "train.momentum=0.9", "train.weight_decay=0.01"],
                  "adamw": ["train.optimizer=adamw", "train.lr=0.01", "train.weight_decay=0.05"]}
    for name, opts in optimizers.items():
        world, *ref = train(out, backend, opts)
        if name == "sgd":  # the clipping these runs compare must be at work
            _, unclipped, _ = train(out, backend, opts + ["train.clip_grad_norm=0"])
            assert float(np.abs(unclipped - ref[0]).max()) > 1e-3, "train.clip_grad_norm=0.3 clipped nothing"
        # comm.shard_reduce: "auto" is the bucketed all-reduce on CPUs; the reduce-scatter too
        for mode in ("optimizer", "gradients", "optimizer reduce_scatter", "gradients reduce_scatter"):
            shard, *reduce = mode.split()
            _, *got = train(out, backend, opts + [f"comm.shard={shard}"] + [f"comm.shard_reduce={r}" for r in reduce])
            compare(world, f"{name} {mode}", ref, got, rtol=1e-4, atol=1e-5)
    for name, extra, tol in (("bf16", ["train.precision=bf16"], 1e-3), ("fp16-wire", ["comm.compression=fp16"], 1e-2),
                             ("fp16-wire reduce_scatter", ["comm.compression=fp16"], 1e-2)):
        opts = optimizers["adamw"] + extra
        world, *ref = train(out, backend, opts)
        reduce = ["comm.shard_reduce=reduce_scatter"] if "reduce_scatter" in name else []
        _, *got = train(out, backend, opts + ["comm.shard=gradients"] + reduce)
        compare(world, f"adamw {name} gradients", ref, got, rtol=tol, atol=tol)
    groups = {"adamw-matrices": optimizers["adamw"] + ["train.weight_decay_on=matrices"],
              "grouped": ["train.optimizer=userpkg.optim:grouped_adamw", "train.lr=0.01", "train.weight_decay=0.05"]}
    for name, opts in groups.items():  # one tensor per group in each slice, some of them empty
        world, *ref = train(out, backend, opts)
        for mode in ("optimizer", "gradients reduce_scatter"):
            shard, *reduce = mode.split()
            _, *got = train(out, backend, opts + [f"comm.shard={shard}"] + [f"comm.shard_reduce={r}" for r in reduce])
            compare(world, f"{name} {mode}", ref, got, rtol=1e-4, atol=1e-5)
    if world.rank == 0:
        print("EQUIVALENCE OK", flush=True)


if __name__ == "__main__":
    from mpi4py import MPI

    from hpctrain.runtime.coordination import abort_on_exception

    with abort_on_exception(MPI.COMM_WORLD):
        main(*sys.argv[1:])
