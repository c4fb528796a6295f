"""Split-model training inside :class:`hpctrain.Trainer`: what differs from data parallelism
when ``[parallel]`` has more than one stage or tensor rank. Everything else (the loop,
``metrics.jsonl`` and progress, stop on request, the checkpoint pipeline and resume) is
the trainer's own.

    mpirun -n 4 hpctrain train examples/pipeline_mlp.toml          # 2 stages x 2 replicas
    sbatch --ntasks=4 slurm/train.sbatch examples/pipeline_mlp.toml parallel.tensor=2 parallel.stages=1

What a :class:`SplitModel` supplies to the trainer:

* the process grid and a :class:`~.hybrid.ReplicaBackend` (replicas average over Horovod
  process sets, or over MPI sub-communicators with ``comm.backend = "mpi"``);
* this rank's stage: only its layers are built when the model is a
  :class:`~.stack.LayerStack` (``[model] name = "transformer"``); an ``nn.Sequential``
  (a user's model) is built whole on every rank and cut;
* the data of a step: ``train.batch_size`` samples per *replica*, read by the first stage
  (inputs) and the last (targets), passed through the pipeline in ``parallel.micro_batches``;
* evaluation through the pipeline, and :class:`SplitCheckpoints`, the checkpoint manager
  whose plan is :mod:`.checkpoint`'s (each rank writes the regions it holds; a file loads
  into any layout).
"""
import numpy as np

from ..checkpoint.manager import CheckpointManager, check_consistency
from ..coordination import all_or_none, everywhere
from ..errors import CheckpointError
from .hybrid import ReplicaBackend
from .layout import Layout, ProcessGrid
from .pipeline import Pipeline


def model_stack(cfg, model=None):
    """What the pipeline splits: the user's model (``nn.Sequential`` or :class:`LayerStack`)
    or the configured one; the transformer as a stack, so each rank builds only its stage."""
    if model is not None:
        return model
    if cfg.model.name == "transformer":
        from .transformer import transformer_stack

        return transformer_stack(cfg.model, seed=cfg.run.seed)
    from ..factories import build_model

    return build_model(cfg.model)  # [model] factory (an nn.Sequential or a LayerStack) or built-in


class SplitModel:
    """One rank's part of a split run. Collective to create (the grid's communicators)."""

    def __init__(self, cfg, world):
        p, c = cfg.parallel, cfg.comm
        self.cfg = cfg
        self.world = world
        self.grid = ProcessGrid.build(Layout(p.stages, None, p.tensor), world.comm)
        self.backend = ReplicaBackend(self.grid, c.backend, c.compression, c.gradient_predivide_factor,
                                      backward_passes=p.micro_batches)
        self.pipeline = None

    @property
    def replicas(self):
        return self.grid.layout.replicas

    @property
    def replica(self):
        return self.grid.replica

    def build(self, model, train, loss_fn):
        """This rank's stage (an ``nn.Sequential`` under the full model's names) on its device."""
        p = self.cfg.parallel
        sample = None
        if p.balance == "time":  # a micro-batch of real inputs to time the layers on
            n = max(1, self.cfg.train.batch_size // p.micro_batches)
            sample = train.read(np.arange(min(n, len(train))))[0]
        self.pipeline = Pipeline(model_stack(self.cfg, model), self.grid, loss_fn, p.micro_batches, p.schedule,
                                 p.balance, sample)
        return self.pipeline.module.to(self.world.device)

    def _read(self, data, indices):
        """Inputs on the first stage, targets on the last (None where not needed)."""
        pipe = self.pipeline
        if not (pipe.stage == 0 or pipe.stage == pipe.stages - 1):
            return None, None
        x, y = data.read(indices)
        device = self.world.device
        x = x.to(device, non_blocking=True) if pipe.stage == 0 else None
        y = y.to(device, non_blocking=True) if pipe.stage == pipe.stages - 1 else None
        return x, y

    def forward_backward(self, run, indices):
        """The pipeline's forward and backward passes over this replica's batch; its mean loss."""
        with run.timer.phase("data"):
            x, y = self._read(run.train, indices)
        with run.timer.phase("forward_backward"):
            return self.pipeline.train_step(x, y)

    def eval_totals(self, run, batch_size):
        """``{name: (sum, count)}`` of this rank's share of the validation set
        (:mod:`hpctrain.training.evaluation`): each replica scores a part through its pipeline;
        only the last stage's tensor rank 0 counts, the other ranks add nothing."""
        from ..data import eval_shard
        from ..training import evaluation

        pipe = self.pipeline
        counts = pipe.stage == pipe.stages - 1 and self.grid.tensor_rank == 0
        indices = eval_shard(len(run.val), self.replica, self.replicas)
        totals = {}
        micro = pipe.micro_batches
        pipe.module.eval()
        try:
            for lo in range(0, len(indices), batch_size):
                part = indices[lo:lo + batch_size]
                x, y = self._read(run.val, part)
                pipe.micro_batches = min(micro, len(part))  # the same on every stage of the replica
                out = pipe.forward(x)
                if counts:
                    evaluation.add(totals, evaluation.score_batch(out.float(), y, run.loss_fn, run.metrics_fn))
        finally:
            pipe.micro_batches = micro
            pipe.module.train()
        return totals

    def all_finite(self, finite):
        """The ranks hold different parts of the model: one verdict for all of them."""
        return bool(self.grid.comm.allreduce(int(bool(finite)), op=_mpi_min()))

    def checkpoints(self, directory, run_config):
        return SplitCheckpoints(directory, self.world, self.cfg.checkpoint, run_config, self.grid)

    def describe(self):
        stage = self.pipeline.describe() if self.pipeline is not None else "no stage yet"
        return f"rank {self.grid.rank} holds {stage}"

    def close(self):
        self.grid.free()


def _mpi_min():
    from mpi4py import MPI

    return MPI.MIN


class SplitCheckpoints(CheckpointManager):
    """The checkpoint manager of a split run: the same saves, retention, ``latest`` and
    resume, with :mod:`.checkpoint`'s plan (each rank writes the regions of the global
    tensors it holds, into one file in the ordinary format) and loader (any layout)."""

    def __init__(self, directory, world, cfg, run_config, grid):
        super().__init__(directory, world, cfg, run_config)
        from ..checkpoint import writer

        self.grid = grid
        if not writer.h5py_parallel():
            raise everywhere(CheckpointError(
                "checkpoints of split models are written collectively, but h5py was built without MPI support",
                hint="build h5py against parallel HDF5 (`make setup`)"))
        self.parallel = True

    def _check_replicas(self, state):
        # The replicas of a stage (and tensor rank) hold the same tensors: they must agree.
        all_or_none(lambda: check_consistency(state.model, self.grid.dp_comm, self.cfg.consistency), self.comm)

    def _make_plan(self, state, info, background):
        from .checkpoint import _plan, layout_attr

        info["meta"]["parallel_layout"] = layout_attr(self.grid)
        return _plan(state.model, state.optimizer, self.grid, state.progress, info)

    def _load_file(self, path, state):
        from .checkpoint import load_parallel_checkpoint

        return load_parallel_checkpoint(path, state.model, state.optimizer, self.grid, state.progress)
