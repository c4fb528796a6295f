"""The training loop, data-parallel over MPI ranks.

Launch (every rank runs the same command)::

    mpirun -n 4 hpctrain train examples/digits.toml train.batch_size=32
    srun --mpi=pmix -n 4 hpctrain train examples/digits.toml comm.backend=mpi

From Python, launched alike, with your model and data (``read(indices) -> (x, y)``, or a map-style dataset)::

    from hpctrain import ArrayDataset, TrainConfig, Trainer

    cfg = TrainConfig()
    cfg.train.epochs, cfg.train.batch_size, cfg.train.lr = 5, 32, 0.05
    result = Trainer(cfg, model=my_model, train_data=ArrayDataset(x, y),
                     val_data=ArrayDataset(x_val, y_val)).fit()
    print(result.metrics["val_accuracy"], result.run_dir)

Every step re-seeds the random generators from ``(seed, step, rank)`` and the data order comes from
``(seed, epoch)``, so ``Progress`` alone says where to resume.
"""
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..config import TrainConfig, load_config
from ..job.watchdog import watching
from ..runtime.coordination import any_rank
from . import nonfinite
from .evaluation import evaluate
from .optimizers import learning_rate, set_lr
from .run import EARLY_STOPPED, EPOCH_END, MAX_STEPS, ROLLED_BACK, STOP_REQUESTED
from .setup import set_up
from .steps import seed_step


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns (the same on every rank)."""

    run_dir: str
    steps: int
    epoch: int
    stopped: bool  # True when stop_requested() ended the run early
    train_loss: Optional[float] = None  # mean over ranks, last step
    metrics: Dict[str, float] = field(default_factory=dict)  # last evaluation


class Trainer:
    """Data-parallel training of one model.

    ``config``: a :class:`~hpctrain.config.TrainConfig`, a dict of sections, or a TOML path. ``model``: an
    ``nn.Module`` (default: built from ``[model]``). ``train_data``/``val_data``: datasets (default: the HDF5
    file of ``[data]``). ``checkpoints``: an object with ``resume(state)``, ``maybe_save(state, ...)``,
    ``close()`` (and ``load_latest(state)`` to roll back after non-finite gradients, see
    ``train.on_nonfinite``); ``"auto"`` uses ``hpctrain.checkpoint.CheckpointManager``, ``None`` none.
    ``callbacks``: objects with any of ``on_step(state, metrics, phase_times)``, ``on_eval(state, metrics)``,
    ``on_checkpoint(state, path, seconds)``, ``on_nonfinite(state, event)``, ``on_end(state)``.
    ``stop_requested``: a callable; True on any rank makes every rank save (``requested=True``) and stop.

    >>> result = Trainer(cfg, model=net, train_data=train, val_data=val).fit()   # doctest: +SKIP
    """

    def __init__(self, config, model=None, train_data=None, val_data=None, *, world=None,
                 loss_fn=None, checkpoints="auto", callbacks=(), stop_requested=None):
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        self.config = config
        self.model, self.world, self.loss_fn = model, world, loss_fn
        self.train_data, self.val_data = train_data, val_data
        self.checkpoints, self.callbacks, self.stop_requested = checkpoints, list(callbacks), stop_requested
        self.run = None  # the Run of the current or last fit()

    @property
    def state(self):
        """The model, optimizer and progress of the current or last run."""
        return None if self.run is None else self.run.state

    def fit(self):
        # What one rank can clean up alone (watchdog, run lock) is undone on every way out;
        # the collective rest (_close) only when no exception left other ranks behind.
        with contextlib.ExitStack() as local:
            run = self.run = set_up(self, local)
            why = EPOCH_END
            epochs = run.budget[0]  # None: train.max_steps alone ends the run
            while why in (EPOCH_END, ROLLED_BACK) and (epochs is None or run.state.progress.epoch < epochs):
                why = self._train_epoch(run)  # after a rollback: again from where it went back to
                if why == EPOCH_END:
                    _end_epoch(run)
                    if run.stop_early:
                        why = EARLY_STOPPED
            stopped = why == STOP_REQUESTED
            if stopped:
                run.log(f"stop requested: saving at step {run.state.progress.step}")
                _save(run, requested=True)
            train_loss = _finish(run, stopped)
            _close(run)
        progress, metrics = run.state.progress, run.metrics
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        run.log(f"{'stopped' if stopped else 'done'} at step {progress.step}, epoch {progress.epoch}: "
                f"train loss {train_loss if train_loss is None else round(train_loss, 4)} {shown}")
        return FitResult(run.run_dir, progress.step, progress.epoch, stopped, train_loss, dict(metrics))

    def _train_epoch(self, run):
        """Train from where the run stands to the end of its epoch, or until it must stop."""
        t, progress = run.cfg.train, run.state.progress
        epoch = run.sampler.steps(progress.epoch, progress.samples_in_epoch, run.steps.data_rank)
        if hasattr(run.train, "plan"):  # data.workers: what the epoch will read, read ahead
            epoch = list(epoch)
            ahead = epoch[:max(0, t.max_steps - progress.step)] if t.max_steps else epoch  # none past the budget
            run.train.plan([m for step in ahead for m in step], progress.epoch, progress.samples_in_epoch)
        for micro_batches in epoch:
            if t.max_steps and progress.step >= t.max_steps:
                return MAX_STEPS
            if _step(run, micro_batches) == ROLLED_BACK:
                return ROLLED_BACK  # the epoch, its position and the sampler are the checkpoint's now
            if run.stop_early:
                return EARLY_STOPPED
            # Agree at every step boundary, so all ranks save and stop after the same step.
            if self.stop_requested is not None:
                with watching(f"stop agreement after step {progress.step}"):
                    if any_rank(bool(self.stop_requested()), run.world.comm):
                        return STOP_REQUESTED
        return EPOCH_END


def _step(run, micro_batches):
    """One step, then its due evaluation and checkpoint, and the callbacks; ROLLED_BACK if it rolled back."""
    t, progress, timer = run.cfg.train, run.state.progress, run.timer
    timer.start_step()
    base = run.base_lr * progress.extra.get(nonfinite.LR_FACTOR, 1.0)  # lowered by non-finite rollbacks
    lr = set_lr(run.state.optimizer, learning_rate(t, base, progress.step, run.decay_steps))
    with run.watchdog.step(progress.step + 1):
        run.last_loss, bad = _train_step(run, micro_batches)  # returns holding run.settling
    try:
        if bad is None:
            run.skips = 0
        elif nonfinite.handle(run, bad) == ROLLED_BACK:
            return ROLLED_BACK
        progress.step += 1
        progress.samples_in_epoch += run.sampler.global_batch
    finally:
        run.settling.release()
    step_metrics = {"loss": run.last_loss, "lr": lr, "epoch": progress.epoch, "step": progress.step}
    fresh = None  # metrics go to the checkpoints only on the step that measured them
    if t.eval_every and progress.step % t.eval_every == 0 and run.val is not None:
        run.state.comm_mode.align_replicas(progress.step)  # one model to score
        fresh = evaluate(run)
        _count_evaluation(run)
    with timer.phase("checkpoint"):
        _save(run, metrics=fresh)
    phase_times = timer.times()
    with watching(f"callbacks (monitor gathers) at step {progress.step}"):
        run.tell("on_step", run.state, step_metrics, phase_times)
    return None


def _train_step(run, micro_batches):
    """Forward/backward, average, apply; the mean loss and the first non-finite parameter (None if none). Returns
    holding ``run.settling`` (taken once the gradients are averaged: the state changes from there)."""
    steps, state, timer = run.steps, run.state, run.timer
    seed_step(state.progress.seed, state.progress.step, run.world.rank)
    total = 0.0
    for indices in micro_batches:
        total += steps.forward_backward(run, indices, len(micro_batches))
    step = state.progress.step + 1
    with timer.phase("allreduce_wait"):
        apply = steps.synchronize(state, step)
    run.settling.acquire()
    with timer.phase("optimizer"):
        bad = None
        if not steps.grads_finite(state, apply):
            bad = steps.first_nonfinite(state)
        elif apply:  # the mode may have nothing to apply this step
            if run.cfg.train.clip_grad_norm:
                steps.clip(state, run.cfg.train.clip_grad_norm)
            steps.apply(state)
        state.optimizer.zero_grad()
    with timer.phase("allreduce_wait"):
        state.comm_mode.after_step(step)
    return total / len(micro_batches), bad


def _end_epoch(run):
    progress = run.state.progress
    run.state.comm_mode.align_replicas(progress.step)  # one model to evaluate and save
    with run.settling:
        progress.epoch += 1
        progress.samples_in_epoch = 0
    if run.val is not None:
        evaluate(run)
        _count_evaluation(run)
    _save(run, epoch_end=True, metrics=run.metrics or None)


def _count_evaluation(run):
    """``train.early_stop_patience``: one more evaluation counted (the same verdict on every rank: the metrics are)."""
    if run.early_stop is None:
        return
    event = run.early_stop.update(run.state.progress, run.metrics)
    if event is not None:
        run.stop_early = event
        best = "none finite" if event["best"] is None else f"best {event['best']:.4g} at step {event['best_step']}"
        run.log(f"early stop at step {event['step']}: {event['metric']} has not improved for {event['evaluations']} "
                f"evaluations (train.early_stop_patience = {event['patience']}; {best})")
        run.tell("on_early_stop", run.state, event)


def _save(run, **when):
    """Save if ``when`` calls for it (collective); tell the callbacks what was saved."""
    if run.checkpoints is None or not run.state.comm_mode.may_save(run.state.progress.step, **when):
        return None  # may_save False: the mode defers it, the ranks do not hold one model now
    started = time.perf_counter()
    why = "".join(f" ({k.replace('_', ' ')})" for k in ("epoch_end", "final", "requested") if when.get(k))
    with watching(f"checkpoint save at step {run.state.progress.step}{why}"):
        path = run.checkpoints.maybe_save(run.state, **when)
    if path:
        run.tell("on_checkpoint", run.state, path, time.perf_counter() - started)
    return path


def _finish(run, stopped):
    """The mean last loss over ranks; unless stopped, a last evaluation and the final save."""
    with watching("final loss average"):
        train_loss = None if run.last_loss is None else run.backend.allreduce_mean(run.last_loss)
    with watching("the last average of comm.mode"):
        run.state.comm_mode.settle(run.state.progress.step, stopped)
    if not stopped:
        if run.val is not None and run.evaluated_at != run.state.progress.step:  # ended mid-epoch
            evaluate(run)
        _save(run, final=True, metrics=run.metrics or None)
    return train_loss


def _close(run):
    """Collective teardown, so not on an exception: the monitor's ``on_end`` gathers over ranks, and closing
    checkpoints waits for a background save that a rank failing alone never joins (the job aborts then)."""
    with watching("monitor end (last gather of timings)"):
        run.tell("on_end", run.state)
    if run.checkpoints is not None:
        with watching("final wait for a background checkpoint save"):
            run.checkpoints.close()
    run.steps.close()
