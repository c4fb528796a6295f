"""The Python-API twin of a split ``hpctrain train`` run: the same configuration file drives
:class:`HybridParallel` by hand (same model, data order, optimizer and steps), and the final
state is saved as a checkpoint, to be compared with the one the command wrote.

    mpirun -n 4 python tests/mpi/parallel_cli_api.py CONFIG OUT.h5 [section.key=value ...]

The replicas average with the mpi backend here, whatever ``comm.backend`` says: the command's
run (Horovod process sets by default) must give the same numbers.
"""
import sys

import torch
from torch import nn

from hpctrain.config import load_config
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.data import ShardSampler, open_splits
from hpctrain.parallel import HybridParallel, Layout
from hpctrain.training.split import model_stack
from hpctrain.state import Progress


def main(config, out, overrides):
    cfg = load_config(config, overrides)
    p, t = cfg.parallel, cfg.train
    torch.set_num_threads(1)
    train, _ = open_splits(cfg.data)
    hp = HybridParallel(model_stack(cfg), Layout(p.stages, None, p.tensor), nn.CrossEntropyLoss(),
                        lambda params: torch.optim.SGD(params, lr=t.lr, momentum=t.momentum),
                        micro_batches=p.micro_batches, schedule=p.schedule, balance=p.balance, backend="mpi")
    sampler = ShardSampler(len(train), cfg.run.seed, t.batch_size, hp.layout.replicas)
    order = sampler.permutation(0)
    n = sampler.global_batch
    for step in range(t.max_steps):
        x, y = train.read(order[step * n:(step + 1) * n])  # the global batch; each replica takes its rows
        hp.train_step(x, y)
    hp.save(out, Progress(step=t.max_steps, seed=cfg.run.seed))
    print(f"RANK {hp.grid.rank} API SAVED {hp.layout.describe()}", flush=True)
    hp.close()


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main(sys.argv[1], sys.argv[2], sys.argv[3:])
