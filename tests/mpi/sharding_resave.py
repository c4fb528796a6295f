"""Load a checkpoint of tests/mpi/sharding_train.py into a replicated or sharded state on
this launch's rank count, and save it again at once: the file written must hold the same
tensors, bit for bit, whatever rank counts and comm.shard modes wrote and read them.

    mpirun -n 2 python tests/mpi/sharding_resave.py IN.h5 OUT.h5 none|optimizer|gradients [horovod|mpi] [key=value ...]

The optimizer is AdamW, as the training run's; overrides such as train.weight_decay_on=matrices give it the
training run's parameter groups.
"""
import sys

from hpctrain.backends import get_backend
from hpctrain.checkpoint import load_checkpoint, save_checkpoint
from hpctrain.config import load_config
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.models import build_model
from hpctrain.training.sharding import ShardedOptimizer
from hpctrain.state import Progress, TrainState
from hpctrain.training.optimizers import make_optimizer
from hpctrain.runtime.world import init_world


def main(src, dst, shard, backend_name="horovod", *overrides):
    world = init_world()
    cfg = load_config(None, ["model.in_features=8", "model.hidden=24", "model.depth=2", "model.num_classes=4",
                             "train.optimizer=adamw", *overrides])
    model = build_model(cfg.model)
    optimizer = make_optimizer(model, cfg.train, 0.01)
    if shard != "none":
        optimizer = ShardedOptimizer(optimizer, model, get_backend(backend_name, world), shard)
    state = TrainState(model, optimizer, Progress())
    load_checkpoint(src, state, world.comm)
    save_checkpoint(dst, state, world.comm)
    if world.is_root:
        print(f"RESAVED step {state.progress.step} on {world.size} rank(s) shard={shard}", flush=True)


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main(*sys.argv[1:])
