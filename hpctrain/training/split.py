"""Split-model steps (``[parallel]`` with more than one stage or tensor rank) for :class:`hpctrain.Trainer`,
which does the rest: the loop, ``metrics.jsonl`` and progress, stop on request, checkpoints and resume.

    mpirun -n 4 hpctrain train examples/pipeline_mlp.toml          # 2 stages x 2 replicas
    sbatch --ntasks=4 slurm/train.sbatch examples/pipeline_mlp.toml parallel.tensor=2 parallel.stages=1

What differs from data parallelism:

* the process grid and a :class:`~hpctrain.parallel.hybrid.ReplicaBackend` (replicas average
  over Horovod process sets, or over MPI sub-communicators with ``comm.backend = "mpi"``);
* this rank's stage: of a :class:`~hpctrain.models.stack.LayerStack` (``[model] name = "transformer"``) only
  its layers are built; an ``nn.Sequential`` (a user's model) is built whole on every rank and cut;
* data: ``train.batch_size`` samples per *replica* and step, pipelined in ``parallel.micro_batches``;
* evaluation through the pipeline, and the checkpoint planner of :mod:`hpctrain.parallel.checkpoint` (each
  rank writes the regions it holds; a file loads into any layout).
"""
import numpy as np

from ..data import eval_shard
from ..errors import HpctrainError
from ..job.watchdog import watching
from ..models import build_model
from ..parallel.checkpoint import SplitPlanner
from ..parallel.hybrid import ReplicaBackend
from ..parallel.layout import Layout, ProcessGrid
from ..parallel.pipeline import Pipeline
from . import evaluation
from .steps import DataParallelSteps


def model_stack(cfg, model=None):
    """The model to split: the user's (``nn.Sequential`` or :class:`LayerStack`), else ``[model]``'s."""
    if model is not None:
        return model
    if cfg.model.name == "transformer":
        from ..models.transformer import transformer_stack

        return transformer_stack(cfg.model, seed=cfg.run.seed)
    return build_model(cfg.model)  # [model] factory (an nn.Sequential or a LayerStack) or built-in


class SplitSteps(DataParallelSteps):
    """One rank's part of a split run. Collective to create (the grid's communicators)."""

    holds = "rank 0 stage"
    data_ranks_are = "replicas"
    starts_after_resume = False  # its replicas' process sets are registered as Horovod starts

    def __init__(self, cfg, world):
        p, c = cfg.parallel, cfg.comm
        self.cfg, self.world = cfg, world
        self.grid = ProcessGrid.build(Layout(p.stages, None, p.tensor), world.comm)
        self.backend = ReplicaBackend(self.grid, c.backend, c.compression, c.gradient_predivide_factor,
                                      backward_passes=p.micro_batches)
        self.pipeline = None

    @property
    def data_rank(self):
        return self.grid.replica

    @property
    def data_ranks(self):
        return self.grid.layout.replicas

    def build_model(self, model, train, loss_fn):
        """This rank's stage (an ``nn.Sequential`` under the full model's names) on its device."""
        p = self.cfg.parallel
        with watching("building this rank's pipeline stage"):
            sample = None
            if p.balance == "time":  # a micro-batch of real inputs to time the layers on
                n = max(1, self.cfg.train.batch_size // p.micro_batches)
                sample = train.read(np.arange(min(n, len(train))))[0]
            self.pipeline = Pipeline(model_stack(self.cfg, model), self.grid, loss_fn, p.micro_batches, p.schedule,
                                     p.balance, sample)
            return self.pipeline.module.to(self.world.device)

    def planner(self):
        return SplitPlanner(self.grid, self.cfg.checkpoint.consistency)

    def describe(self):
        stage = self.pipeline.describe() if self.pipeline is not None else "no stage yet"
        return f"split model: rank {self.grid.rank} holds {stage}"

    def close(self):
        super().close()
        self.grid.free()

    def _read(self, data, indices):
        """Inputs on the first stage, targets on the last (None where not needed)."""
        first, last = self.grid.is_first_stage, self.grid.is_last_stage
        if not (first or last):
            return None, None
        batch = data.read(indices)
        if isinstance(batch, dict):
            raise HpctrainError(f"a split model ([parallel]) reads (x, y) samples, but the dataset gives dict batches "
                                f"(keys {', '.join(batch)})", hint="make the dataset return (x, y), or train "
                                                                 "data-parallel (no [parallel] section)")
        x, y = batch
        device = self.world.device
        return (x.to(device, non_blocking=True) if first else None, y.to(device, non_blocking=True) if last else None)

    def forward_backward(self, run, indices, count):
        """The pipeline's forward and backward passes over this replica's batch; its mean loss."""
        with run.timer.phase("data"):
            x, y = self._read(run.train, indices)
        with run.timer.phase("forward_backward"):
            return self.pipeline.train_step(x, y)

    def grads_finite(self, state, apply):
        """The ranks hold different parts of the model: one verdict for all of them."""
        from mpi4py import MPI

        return bool(self.grid.comm.allreduce(int(bool(super().grads_finite(state, apply))), op=MPI.MIN))

    def eval_totals(self, run, batch_size):
        """Each replica scores a part through its pipeline; only the last stage's tensor rank 0 counts it."""
        pipe = self.pipeline
        counts = self.grid.is_last_stage and self.grid.tensor_rank == 0
        indices = eval_shard(len(run.val), self.data_rank, self.data_ranks)
        totals, micro = {}, pipe.micro_batches
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
