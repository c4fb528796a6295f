"""How a step runs, behind one interface so the trainer has one loop (:func:`.setup.steps_for` picks one):

* :class:`DataParallelSteps`: whole models, gradients averaged as ``comm.mode`` says (:mod:`.comm_modes`);
* :class:`ShardedSteps` (``comm.shard``): the same, but each rank updates only its slice (:mod:`.sharding`);
* :class:`~.split.SplitSteps` (``[parallel]``): the model split into pipeline stages and
  tensor-parallel ranks, the replicas of each stage averaging its gradients.

A step, as the trainer drives it::

    for indices in micro_batches:
        loss += steps.forward_backward(run, indices, len(micro_batches))
    apply = steps.synchronize(state, step)        # False: nothing to apply this step
    if not steps.grads_finite(state, apply):      # the same verdict on every rank
        bad = steps.first_nonfinite(state)
    elif apply:
        steps.clip(state, max_norm); steps.apply(state)
"""
import contextlib
import functools

import numpy as np

from ..backends import get_backend
from ..config.schema import is_import_path
from ..data import eval_shard
from ..data.batches import to_device
from ..models import build_model
from ..runtime.coordination import all_or_none
from . import evaluation, nonfinite, recipes
from .losses import forward


def seed_step(seed, step, rank):
    """Every rank's generators from ``(seed, step, rank)``: a resumed step draws what it drew."""
    import torch

    torch.manual_seed(int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0]))


def autocast(precision, device):
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


class DataParallelSteps:
    """Every rank holds the whole model; the backend averages the gradients."""

    holds = "model"  # what a rank's parameters are, in the run's first line
    data_ranks_are = "ranks"
    _first_seen = False  # the first micro-batch is read and computed under a check on every rank
    # Horovod's background thread keeps MPI busy from its start, and the set-up's MPI-IO beside it ran 3-5x
    # slower (docs/performance.md): the backend starts after the resume (start), the optimizer wrapped then.
    # Sharded and split steps build their optimizers on a started backend.
    starts_after_resume = True
    _wrap = None  # the comm mode's wrapping, left for start()

    def __init__(self, cfg, world):
        c = cfg.comm
        self.cfg, self.world = cfg, world
        self.backend = get_backend(c.backend, world, c.compression, c.gradient_predivide_factor,
                                   start=not self.starts_after_resume)

    @property
    def data_rank(self):
        """Which share of each global batch this rank reads."""
        return self.world.rank

    @property
    def data_ranks(self):
        return self.world.size

    # -- set-up
    def build_model(self, model, train, loss_fn):
        """This rank's model on its device: ``model``, or ``[model]``'s (one rank's failure raised on all)."""
        model = model if model is not None else all_or_none(lambda: build_model(self.cfg.model), self.world.comm)
        model.to(self.world.device)
        return model

    def wrap_optimizer(self, make, model, mode):
        """The optimizer to resume into: ``make()``'s (a user's function failing on any rank fails on all), as
        ``comm.mode`` wraps it, now or, where the backend starts after the resume, in :meth:`start`."""
        optimizer = all_or_none(make, self.world.comm) if is_import_path(self.cfg.train.optimizer) else make()
        wrap = functools.partial(mode.wrap_optimizer, model=model, accumulation=self.cfg.train.accumulation)
        if self.starts_after_resume:
            self._wrap = wrap
            return optimizer
        return wrap(optimizer)

    def start(self, state):
        """After the resume, before the broadcast (collective): the backend started and ``state``'s optimizer
        wrapped as ``comm.mode`` has it, holding the state resumed into it."""
        if self._wrap is None:
            return
        self.backend.start()
        plain, wrap, self._wrap = state.optimizer, self._wrap, None
        wrapped = wrap(plain)
        if wrapped is not plain:  # Horovod's wrapper is a new optimizer on the same parameters, with no state
            wrapped.load_state_dict(plain.state_dict())
        state.optimizer = wrapped

    def broadcast(self, state):
        """Rank 0's weights and optimizer state win (after a resume, or a fresh start)."""
        self.backend.broadcast_state(state.model, state.optimizer)

    def planner(self):
        """Who writes what of a checkpoint (None: the checkpoint manager's data-parallel default)."""

    def describe(self):
        """A line more for the run's start, or None."""

    def close(self):
        self.backend.close()

    # -- a step
    def forward_backward(self, run, indices, count):
        """Read micro-batch ``indices``, forward and backward (gradient scaled by 1/``count``); its loss."""
        if not self._first_seen:
            # The first micro-batch: what the data and the model make of it (a collate function, a model that
            # takes no targets or not these keys) fails alike on every rank, not on one while the others wait.
            self._first_seen = True
            return all_or_none(lambda: self._first_forward_backward(run, indices, count), self.world.comm)
        return self._forward_backward(run, indices, count)

    def _first_forward_backward(self, run, indices, count):
        """The first micro-batch; where ``train.compile`` fails to compile the model, it goes on eager."""
        model = run.state.model
        try:
            return self._forward_backward(run, indices, count)
        except Exception as exc:
            if not recipes.is_compiled(model):
                raise
            recipes.uncompile(model)
            model.zero_grad(set_to_none=True)
            run.log(recipes.compile_failed(type(model).__name__, exc))
            return self._forward_backward(run, indices, count)

    def _forward_backward(self, run, indices, count):
        device, scaler = self.world.device, run.state.scaler
        with run.timer.phase("data"):
            batch = to_device(run.train.read(indices), device)
        with run.timer.phase("forward_backward"):
            with autocast(run.cfg.train.precision, device):
                result = forward(run.state.model, batch, run.loss_fn)
                loss = result.loss if result.loss is not None else run.loss_fn(result.output, result.target)
            # Dividing by the micro-batch count makes the summed gradient a mean.
            scaled = loss / count
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            return float(loss.detach())

    def synchronize(self, state, step):
        """The step's averaged gradients (``step`` counted from 1); False: none to apply."""
        return state.comm_mode.synchronize_gradients(state.optimizer, step)  # stale: False at its first step

    def grads_finite(self, state, apply):
        # With a GradScaler, inf/NaN gradients are its own business: it skips the step
        # and lowers the scale. Otherwise a non-finite step is never applied.
        return not apply or state.scaler is not None or nonfinite.grads_finite(state.optimizer)

    def first_nonfinite(self, state):
        """The first parameter whose gradient is not finite (the slow search, on that path only)."""
        return nonfinite.first_nonfinite(state.model)

    def clip(self, state, max_norm):
        """``train.clip_grad_norm``: the global norm of the averaged gradients."""
        import torch

        if state.scaler is not None:
            state.scaler.unscale_(state.optimizer)
        return torch.nn.utils.clip_grad_norm_([p for p in state.model.parameters() if p.grad is not None], max_norm)

    def apply(self, state):
        state.comm_mode.step(state.optimizer, state.scaler)

    def eval_totals(self, run, batch_size):
        """``{name: (sum, count)}`` of this rank's share of the validation set."""
        import torch

        model, world, t = run.state.model, self.world, run.cfg.train
        indices = eval_shard(len(run.val), world.rank, world.size)
        totals = {"loss": (0.0, 0)}  # name -> (sum, count): val_loss, val_accuracy where it applies, train.metrics
        model.eval()
        with torch.no_grad():
            for lo in range(0, len(indices), batch_size):
                batch = to_device(run.val.read(indices[lo:lo + batch_size]), world.device)
                with autocast(t.precision, world.device):
                    result = forward(model, batch, run.loss_fn)
                out = None if result.output is None else result.output.float()
                evaluation.add(totals, evaluation.score_batch(out, result.target, run.loss_fn, run.metrics_fn,
                                                              loss=result.loss, samples=result.samples))
        model.train()
        return totals


class ShardedSteps(DataParallelSteps):
    """Each rank updates its slice (:class:`~.sharding.ShardedOptimizer`); ``comm.mode`` is ``sync``."""

    starts_after_resume = False

    def wrap_optimizer(self, make, model, mode):
        from .sharding import ShardedOptimizer

        c = self.cfg.comm
        return all_or_none(lambda: ShardedOptimizer(make(), model, self.backend, c.shard,
                                                    accumulation=self.cfg.train.accumulation,
                                                    reduction=c.shard_reduce), self.world.comm)

    def broadcast(self, state):
        state.optimizer.broadcast_parameters()  # each rank keeps its own optimizer slice

    def synchronize(self, state, step):
        state.optimizer.synchronize()
        return True

    def grads_finite(self, state, apply):
        return state.optimizer.grads_finite()  # one verdict over all slices

    def first_nonfinite(self, state):
        return state.optimizer.first_nonfinite()

    def clip(self, state, max_norm):
        return state.optimizer.clip_grad_norm(max_norm)

    def apply(self, state):
        state.optimizer.step()
