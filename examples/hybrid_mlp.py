"""Train a small attention + MLP model split as pipeline stages x data-parallel replicas
(x tensor-parallel ranks) with the Python API (:class:`hpctrain.parallel.HybridParallel`),
save a checkpoint, and resume from it in any other layout. ``hpctrain train`` does the same
from a configuration file (``mpirun -n 4 hpctrain train examples/pipeline_mlp.toml``); this
script shows the pieces for your own training loop.

4 ranks as 2 stages x 2 replicas, 1F1B schedule, fp16 gradient compression:

    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --stages 2 --compression fp16 --out runs/hybrid

The layout from an ``hpctrain train`` configuration's ``[parallel]`` and ``[comm]`` (flags win),
or the replicas averaging over Horovod process sets instead of MPI sub-communicators:

    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --config examples/pipeline_mlp.toml
    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --stages 2 --backend horovod --compression fp16

Resume that checkpoint as 4 stages x 1 replica, or as pure data parallelism (1 x 4), or
with the MLP and attention split over 2 tensor ranks:

    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --stages 4 --resume runs/hybrid/ckpt-00000040.h5
    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --stages 1 --resume runs/hybrid/ckpt-00000040.h5
    mpirun -n 4 .venv/bin/python examples/hybrid_mlp.py --stages 2 --tensor 2 --resume runs/hybrid/ckpt-00000040.h5

Under Slurm: ``srun --mpi=pmix -n 4 .venv/bin/python examples/hybrid_mlp.py ...``.
"""
import argparse
import os
import time

import torch
from torch import nn

from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.parallel import HybridParallel, Layout, MLPBlock, SelfAttention
from hpctrain.state import Progress

DEFAULTS = dict(stages=2, replicas=None, tensor=1, schedule="1f1b", micro_batches=4, balance="params",
                compression="none", backend="mpi", steps=40, batch_size=64, lr=0.05, width=32, heads=4, seq=8,
                out="runs/hybrid", resume=None)


def model(width, heads):
    """A stack of layers: the unit a pipeline splits. Built with one seed on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), SelfAttention(width, heads), nn.LayerNorm(width),
                         MLPBlock(width, 4 * width), nn.LayerNorm(width), MLPBlock(width, 4 * width),
                         nn.Linear(width, 4))


def teacher_batch(step, n, seq):
    """Synthetic regression data: the same global batch on every rank for a given step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, seq, 16, generator=g)
    return x, torch.tanh(x[..., :4] * 2) + 0.1 * x[..., 4:8]


def settings():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="an hpctrain train configuration: its [parallel] and [comm] sections")
    for key, value in DEFAULTS.items():
        kind = type(value) if value is not None else (int if key == "replicas" else str)
        ap.add_argument("--" + key.replace("_", "-"), type=kind, default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        from hpctrain.config import load_config

        loaded = load_config(args.config)
        p = loaded.parallel
        cfg.update(stages=p.stages, tensor=p.tensor, schedule=p.schedule, micro_batches=p.micro_batches,
                   balance=p.balance, compression=loaded.comm.compression, backend=loaded.comm.backend)
    cfg.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    return cfg


def main():
    cfg = settings()
    hp = HybridParallel(model(cfg["width"], cfg["heads"]), Layout(cfg["stages"], cfg["replicas"], cfg["tensor"]),
                        loss_fn=nn.MSELoss(), optimizer=lambda p: torch.optim.AdamW(p, lr=cfg["lr"] / 10),
                        micro_batches=cfg["micro_batches"], schedule=cfg["schedule"], balance=cfg["balance"],
                        sample=teacher_batch(0, cfg["micro_batches"], cfg["seq"])[0],
                        compression=cfg["compression"], backend=cfg["backend"])
    root = hp.grid.rank == 0
    progress = Progress()
    if cfg["resume"]:
        hp.load(cfg["resume"], progress)
    if root:
        print(f"layout {hp.layout.describe()}; {hp.pipeline.describe()} (rank 0)", flush=True)
    start, first = time.perf_counter(), progress.step
    for step in range(progress.step, progress.step + cfg["steps"]):
        loss = hp.train_step(*teacher_batch(step, cfg["batch_size"], cfg["seq"]))
        progress.step = step + 1
        if root and (step % 10 == 0 or step == first + cfg["steps"] - 1):
            print(f"step {step + 1:5d}  loss {loss:.5f}", flush=True)
    seconds = time.perf_counter() - start
    path = os.path.join(cfg["out"], f"ckpt-{progress.step:08d}.h5")
    hp.save(path, progress, run_config=cfg, metrics={"loss": loss})
    if root:
        print(f"{cfg['steps']} steps in {seconds:.1f}s; saved {path}", flush=True)
    hp.close()


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main()
