"""The training loop, data-parallel over MPI ranks.

Launch (every rank runs the same command)::

    mpirun -n 4 hpctrain train examples/digits.toml train.batch_size=32
    srun --mpi=pmix -n 4 hpctrain train examples/digits.toml comm.backend=mpi

From Python, with your own model and data (anything with ``read(indices) -> (x, y)``, or a
map-style torch dataset), launched the same way::

    from hpctrain import ArrayDataset, TrainConfig, Trainer

    cfg = TrainConfig()
    cfg.train.epochs, cfg.train.batch_size, cfg.train.lr = 5, 32, 0.05
    result = Trainer(cfg, model=my_model, train_data=ArrayDataset(x, y),
                     val_data=ArrayDataset(x_val, y_val)).fit()
    print(result.metrics["val_accuracy"], result.run_dir)

One step: read this rank's micro-batches, forward and backward each (gradients summed
locally), wait for the all-reduce that averages them over ranks, apply them. The random
generators are re-seeded from ``(seed, step, rank)`` every step and the data order comes
from ``(seed, epoch)``, so ``Progress`` alone says where to resume.
"""
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np

from ..config import TrainConfig, is_split, load_config, validate
from ..coordination import all_or_none, any_rank, everywhere, on_root
from ..errors import ConfigError
from ..job import rundir, runlock
from ..job.watchdog import Watchdog, watching
from ..monitoring.monitor import Monitor, build_callbacks
from ..monitoring.timing import PhaseTimer
from ..state import Progress, TrainState
from . import comm_modes, nonfinite
from .nonfinite import NonFiniteError


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns (the same on every rank)."""

    run_dir: str
    steps: int
    epoch: int
    stopped: bool  # True when stop_requested() ended the run early
    train_loss: Optional[float] = None  # mean over ranks, last step
    metrics: Dict[str, float] = field(default_factory=dict)  # last evaluation


# Why an epoch of training returned.
EPOCH_END, MAX_STEPS, STOP_REQUESTED, ROLLED_BACK = "epoch_end", "max_steps", "stop_requested", "rolled_back"


@dataclass
class Run:
    """One call of :meth:`Trainer.fit`: what set-up built, and what the loop carries between steps."""

    world: Any
    cfg: TrainConfig
    backend: Any
    run_dir: str
    train: Any
    val: Any
    sampler: Any
    state: TrainState
    checkpoints: Any
    callbacks: list
    timer: PhaseTimer
    watchdog: Watchdog
    loss_fn: Any
    base_lr: float
    last_loss: Optional[float] = None  # this rank's, of the last step
    skips: int = 0  # consecutive steps whose non-finite gradients were not applied
    metrics: Dict[str, float] = field(default_factory=dict)  # of the last evaluation
    evaluated_at: Optional[int] = None  # the step of the last evaluation
    metrics_fn: Any = None  # train.metrics: (output, target) -> {name: (sum, count)}
    split: Any = None  # a parallel.strategy.SplitModel when [parallel] splits the model, else None


class Trainer:
    """Data-parallel training of one model.

    ``config``: a :class:`~hpctrain.config.TrainConfig`, a dict of sections, or a TOML path.
    ``model``: an ``nn.Module`` (default: built from ``[model]``). ``train_data``/``val_data``:
    datasets (default: the HDF5 file of ``[data]``). ``checkpoints``: an object with
    ``resume(state)``, ``maybe_save(state, ...)``, ``close()`` (and ``load_latest(state)`` to roll
    back after non-finite gradients, see ``train.on_nonfinite``); ``"auto"`` uses
    ``hpctrain.checkpoint.CheckpointManager`` when that package is installed, ``None`` none.
    ``callbacks``: objects with any of ``on_step(state, metrics, phase_times)``,
    ``on_eval(state, metrics)``, ``on_checkpoint(state, path, seconds)``,
    ``on_nonfinite(state, event)``, ``on_end(state)``.
    ``stop_requested``: a callable; when it returns True on any rank, every rank saves
    (``requested=True``) and stops.

    >>> result = Trainer(cfg, model=net, train_data=train, val_data=val).fit()   # doctest: +SKIP
    """

    def __init__(self, config, model=None, train_data=None, val_data=None, *, world=None,
                 loss_fn=None, checkpoints="auto", callbacks=(), stop_requested=None):
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config)
        elif isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        self.config = config
        self.model = model
        self.train_data, self.val_data = train_data, val_data
        self.world = world
        self.loss_fn = loss_fn
        self.checkpoints = checkpoints
        self.callbacks = list(callbacks)
        self.stop_requested = stop_requested
        self.run = None  # the Run of the current or last fit()

    @property
    def state(self):
        """The model, optimizer and progress of the current or last run."""
        return None if self.run is None else self.run.state

    # ------------------------------------------------------------------ the run
    def fit(self):
        # What one rank can clean up alone (watchdog, run lock) is undone on every way out;
        # the collective rest (_close) only when no exception left other ranks behind.
        with contextlib.ExitStack() as local:
            run = self.run = self._set_up(local)
            why = EPOCH_END
            while why in (EPOCH_END, ROLLED_BACK) and run.state.progress.epoch < run.cfg.train.epochs:
                why = self._train_epoch(run)  # after a rollback: again from where it went back to
                if why == EPOCH_END:
                    self._end_epoch(run)
            stopped = why == STOP_REQUESTED
            if stopped:
                self._log(f"stop requested: saving at step {run.state.progress.step}")
                self._save(run, requested=True)
            train_loss = self._finish(run, stopped)
            self._close(run)
        progress, metrics = run.state.progress, run.metrics
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._log(f"{'stopped' if stopped else 'done'} at step {progress.step}, epoch {progress.epoch}: "
                  f"train loss {train_loss if train_loss is None else round(train_loss, 4)} {shown}")
        return FitResult(run.run_dir, progress.step, progress.epoch, stopped, train_loss, dict(metrics))

    def _set_up(self, local):
        """Validate, then build the run in an order every rank follows; ``local`` gets the
        cleanup of what needs it."""
        import torch

        from ..backends import get_backend
        from ..data import ShardSampler
        from ..factories import build_loss, build_metrics, build_model
        from ..models import count_parameters
        from ..world import init_world

        world = self.world = self.world or init_world()
        comm = world.comm
        cuda = world.device.startswith("cuda")
        # Every rank checks the same thing before any collective; all fail alike or none.
        cfg = all_or_none(
            lambda: validate(self.config, world.size, cuda=cuda, need_data=self.train_data is None), comm)
        t = cfg.train
        # A step, or any other collective phase (watching(...)), that outlives step_timeout (a
        # rank stuck in a collective) ends the whole job. Made first: the set-up below already waits.
        watchdog = local.enter_context(Watchdog(t.step_timeout or None, comm=comm, where=world.where()))
        split = None
        if is_split(cfg):  # pipeline/tensor parallel: the grid and the replicas' backend
            from ..parallel.strategy import SplitModel

            with watching("building the process grid"):
                split = SplitModel(cfg, world)
        backend = split.backend if split is not None else get_backend(
            cfg.comm.backend, world, cfg.comm.compression, cfg.comm.gradient_predivide_factor)
        with watching("creating the run directory"):
            run_dir = on_root(lambda: rundir.create(cfg, world, backend), comm)
        if world.is_root:
            local.callback(runlock.release, run_dir)

        with watching("opening the data set"):
            train, val = self._datasets(cfg, world)
            # Split runs: each replica (not each rank) reads train.batch_size samples per step.
            sampler = ShardSampler(len(train), cfg.run.seed, t.batch_size,
                                   split.replicas if split is not None else world.size, t.accumulation)
            all_or_none(lambda: _check_enough_data(sampler), comm)

        torch.manual_seed(cfg.run.seed)  # the same initial weights everywhere (broadcast anyway)
        loss_fn = self.loss_fn or build_loss(cfg.train.loss)
        if split is not None:
            with watching("building this rank's pipeline stage"):
                model = split.build(self.model, train, loss_fn)
        else:
            # [model] factory (or the built-in MLP); a failure on one rank is raised on all
            model = self.model if self.model is not None else all_or_none(lambda: build_model(cfg.model), comm)
            model.to(world.device)
        base_lr = t.lr * (world.size if t.lr_scaling == "linear" else 1)
        mode = comm_modes.build(cfg.comm, backend, model)  # comm.mode: sync, local_sgd, stale
        if cfg.comm.shard != "none":  # each rank updates its slice (hpctrain.sharding); comm.mode is sync
            from ..sharding import ShardedOptimizer

            optimizer = all_or_none(lambda: ShardedOptimizer(
                _make_optimizer(model, t, base_lr), model, backend, cfg.comm.shard,
                accumulation=t.accumulation, reduction=cfg.comm.shard_reduce), comm)
        else:
            optimizer = mode.wrap_optimizer(_make_optimizer(model, t, base_lr), model, t.accumulation)
        scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
        state = TrainState(model, optimizer, Progress(seed=cfg.run.seed), scaler, comm=mode)

        checkpoints = self.checkpoints
        if checkpoints == "auto":
            checkpoints = _default_checkpoints(cfg, world, run_dir, split)
        with watching("resume from a checkpoint"):
            if checkpoints is not None and checkpoints.resume(state):
                sampler.seed = state.progress.seed  # the data order of the run being resumed
            if getattr(optimizer, "sharded", False):
                optimizer.broadcast_parameters()  # each rank keeps its own optimizer slice
            else:
                backend.broadcast_state(model, optimizer)  # rank 0's weights and optimizer state win
            mode.start(state)

        total_steps = sampler.steps_per_epoch * t.epochs
        if t.max_steps:
            total_steps = min(total_steps, t.max_steps)
        if cfg.monitor.horovod_timeline:
            backend.start_timeline(os.path.join(run_dir, "horovod_timeline.json"))
        callbacks = self.callbacks
        if not any(isinstance(cb, Monitor) for cb in callbacks):
            # Every rank builds it: the monitor gathers timings across ranks.
            with watching("monitor set-up"):
                callbacks = build_callbacks(cfg.monitor, run_dir, comm=comm, total_steps=total_steps,
                                            samples_per_step=sampler.global_batch) + callbacks
        params, tensors = count_parameters(model)
        self._log(f"{world.size} ranks ({world.launcher}), {backend.describe()}, {mode.describe()}; "
                  f"{'rank 0 stage' if split else 'model'} {params:,} parameters in {tensors} tensors; "
                  f"global batch {sampler.global_batch} = {t.batch_size} x "
                  f"{sampler.ranks} {'replicas' if split else 'ranks'} x {t.accumulation}; "
                  f"{sampler.steps_per_epoch} steps/epoch; "
                  f"run dir {run_dir}")
        from .. import allocator
        from ..world import mpi_settings

        self._log(allocator.tune())  # what hpctrain set for the user (docs/performance.md)
        if mpi_settings():
            self._log(mpi_settings())
        for note in getattr(cfg, "notes", ()):  # what validate() changed, e.g. the accumulation
            self._log(note)
        if split is not None:
            self._log(f"split model: {split.describe()}")
        model.train()
        return Run(world, cfg, backend, run_dir, train, val, sampler, state, checkpoints, callbacks,
                   PhaseTimer(sync=torch.cuda.synchronize if cuda else None), watchdog,
                   loss_fn, base_lr, metrics_fn=build_metrics(cfg.train.metrics), split=split)

    def _train_epoch(self, run):
        """Train from where the run stands to the end of its epoch, or until it must stop."""
        t, progress = run.cfg.train, run.state.progress
        data_rank = run.split.replica if run.split is not None else run.world.rank
        for micro_batches in run.sampler.steps(progress.epoch, progress.samples_in_epoch, data_rank):
            if t.max_steps and progress.step >= t.max_steps:
                return MAX_STEPS
            if self._step(run, micro_batches) == ROLLED_BACK:
                return ROLLED_BACK  # the epoch, its position and the sampler are the checkpoint's now
            # Agree at every step boundary, so all ranks save and stop after the same step.
            if self.stop_requested is not None:
                with watching(f"stop agreement after step {progress.step}"):
                    if any_rank(bool(self.stop_requested()), run.world.comm):
                        return STOP_REQUESTED
        return EPOCH_END

    def _end_epoch(self, run):
        progress = run.state.progress
        run.state.comm.sync_now(progress.step)  # local_sgd: evaluate and save one model
        progress.epoch += 1
        progress.samples_in_epoch = 0
        if run.val is not None:
            self._evaluate(run)
        self._save(run, epoch_end=True, metrics=run.metrics or None)

    def _finish(self, run, stopped):
        """The mean last loss over ranks; unless stopped, a last evaluation and the final save."""
        with watching("final loss average"):
            train_loss = None if run.last_loss is None else run.backend.allreduce_mean(run.last_loss)
        with watching("the last average of comm.mode"):
            run.state.comm.end(run.state.progress.step, stopped)  # one model; stale: nothing left unapplied
        if not stopped:
            if run.val is not None and run.evaluated_at != run.state.progress.step:  # ended mid-epoch
                self._evaluate(run)
            self._save(run, final=True, metrics=run.metrics or None)
        return train_loss

    def _close(self, run):
        """Collective teardown, so not on an exception: the monitor's ``on_end`` gathers over
        ranks and closing checkpoints waits for a background save, which a rank that failed
        alone never joins; the job is being aborted then anyway."""
        with watching("monitor end (last gather of timings)"):
            for cb in run.callbacks:
                _call(cb, "on_end", run.state)
        if run.checkpoints is not None:
            with watching("final wait for a background checkpoint save"):
                run.checkpoints.close()
        run.backend.close()
        if run.split is not None:
            run.split.close()

    # ------------------------------------------------------------------ one step
    def _step(self, run, micro_batches):
        """One optimizer step, then the evaluation and checkpoint it is due and the callbacks.
        Returns ROLLED_BACK when non-finite gradients sent the run back to a checkpoint."""
        t, progress, timer = run.cfg.train, run.state.progress, run.timer
        timer.start_step()
        lr = _set_lr(run.state.optimizer, run.base_lr * progress.extra.get(nonfinite.LR_FACTOR, 1.0), t.warmup_steps,
                     progress.step)
        with run.watchdog.step(progress.step + 1):
            run.last_loss, bad = self._train_step(run, micro_batches)
        if bad is None:
            run.skips = 0
        elif self._nonfinite(run, bad) == ROLLED_BACK:
            return ROLLED_BACK
        progress.step += 1
        progress.samples_in_epoch += run.sampler.global_batch
        step_metrics = {"loss": run.last_loss, "lr": lr, "epoch": progress.epoch, "step": progress.step}

        fresh = None  # metrics go to the checkpoints only on the step that measured them
        if t.eval_every and progress.step % t.eval_every == 0 and run.val is not None:
            run.state.comm.sync_now(progress.step)  # local_sgd: score one model
            fresh = self._evaluate(run)
        with timer.phase("checkpoint"):
            self._save(run, metrics=fresh)
        phase_times = timer.times()
        with watching(f"callbacks (monitor gathers) at step {progress.step}"):
            for cb in run.callbacks:
                _call(cb, "on_step", run.state, step_metrics, phase_times)
        return None

    def _train_step(self, run, micro_batches):
        """Forward/backward every micro-batch, average gradients, apply them; mean loss."""
        state, backend, timer, device = run.state, run.backend, run.timer, run.world.device
        model, optimizer, scaler = state.model, state.optimizer, state.scaler
        _seed_step(state.progress.seed, state.progress.step, run.world.rank)
        total = 0.0
        for indices in micro_batches:
            if run.split is not None:  # reads, forward and backward passes through the pipeline
                total += run.split.forward_backward(run, indices)
                continue
            with timer.phase("data"):
                x, y = run.train.read(indices)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with timer.phase("forward_backward"):
                with _autocast(run.cfg.train.precision, device):
                    loss = run.loss_fn(model(x), y)
                # Dividing by the micro-batch count makes the summed gradient a mean.
                scaled = loss / len(micro_batches)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += float(loss.detach())
        step = state.progress.step + 1
        sharded = getattr(optimizer, "sharded", False)  # comm.shard: the verdict and norm need the other slices
        with timer.phase("allreduce_wait"):
            if sharded:
                optimizer.synchronize()
                apply = True
            else:
                apply = state.comm.synchronize_gradients(optimizer, step)  # stale: False at its first step
        with timer.phase("optimizer"):
            # With a GradScaler, inf/NaN gradients are its own business: it skips the step
            # and lowers the scale. Otherwise a non-finite step is never applied.
            bad = None  # the first parameter whose gradient is not finite
            if sharded:  # one verdict over all slices
                finite = optimizer.grads_finite()
            else:
                finite = not apply or scaler is not None or nonfinite.grads_finite(optimizer)
            if run.split is not None:  # each rank holds a part of the model: one verdict for all
                finite = run.split.all_finite(finite)
            if not finite:  # the slow search, on this path only
                bad = optimizer.first_nonfinite() if sharded else nonfinite.first_nonfinite(model)
            elif apply:  # comm.mode = stale applies nothing at its first step
                if run.cfg.train.clip_grad_norm:
                    _clip(optimizer, model, scaler, run.cfg.train.clip_grad_norm)
                optimizer.step() if sharded else state.comm.step(optimizer, scaler)
            optimizer.zero_grad()
        with timer.phase("allreduce_wait"):
            state.comm.after_step(step)  # local_sgd: the parameter average at its synchronisation points
        return total / len(micro_batches), bad

    def _nonfinite(self, run, tensor):
        """The averaged gradients of the step just taken were not finite (the same verdict on
        every rank: they hold the same averaged gradients); its update was not applied. Skip,
        roll back (returns ROLLED_BACK) or raise :class:`NonFiniteError`, as
        ``train.on_nonfinite`` says. ``tensor``: the first parameter whose gradient is not finite."""
        t, progress = run.cfg.train, run.state.progress
        step = progress.step + 1
        run.skips += 1
        rollbacks = progress.extra.get(nonfinite.ROLLBACKS, 0)
        policy = t.on_nonfinite
        can_roll_back = hasattr(run.checkpoints, "load_latest")
        action = nonfinite.choose_action(t, run.skips, rollbacks, can_roll_back)
        event = {"step": step, "action": action, "tensor": tensor, "policy": policy,
                 "consecutive": run.skips, "rollbacks": rollbacks}
        if action == "rollback":
            factor = progress.extra.get(nonfinite.LR_FACTOR, 1.0) * t.rollback_lr_factor
            with watching(f"rollback to the newest checkpoint after step {step}"):
                path = run.checkpoints.load_latest(run.state)
            if path is not None:
                progress = run.state.progress
                # The run's own history, not the checkpoint's: kept across later resumes.
                progress.extra.update({nonfinite.ROLLBACKS: rollbacks + 1, nonfinite.LR_FACTOR: factor})
                run.sampler.seed = progress.seed
                run.skips, run.evaluated_at = 0, None
                event.update(rollbacks=rollbacks + 1, to_step=progress.step, lr_factor=factor, path=path)
                self._tell_nonfinite(run, event)
                return ROLLED_BACK
            action = event["action"] = "stop"
            event["why"] = "no checkpoint of this run to roll back to"
        elif action == "stop" and policy in ("auto", "rollback") and not can_roll_back \
                and rollbacks < t.max_rollbacks and (policy == "rollback" or run.skips > t.max_nonfinite_skips):
            event["why"] = "no checkpoints to roll back to (the trainer's checkpoints have no load_latest)"
        self._tell_nonfinite(run, event)
        if action == "skip":
            return None
        # Every rank reached the same verdict on the same gradients: all raise it alike.
        raise everywhere(NonFiniteError(nonfinite.stop_message(step, tensor, t, event),
                                         hint=nonfinite.stop_hint(run.checkpoints)))

    def _tell_nonfinite(self, run, event):
        with watching(f"callbacks (non-finite step {event['step']})"):
            for cb in run.callbacks:
                _call(cb, "on_nonfinite", run.state, dict(event))

    def _save(self, run, **when):
        """Save if ``when`` calls for it (collective); tell the callbacks what was saved."""
        if run.checkpoints is None:
            return None
        if not run.state.comm.may_save(run.state.progress.step, **when):
            return None  # local_sgd between synchronisation points: a due save waits for the next one
        started = time.perf_counter()
        why = "".join(f" ({k.replace('_', ' ')})" for k in ("epoch_end", "final", "requested") if when.get(k))
        with watching(f"checkpoint save at step {run.state.progress.step}{why}"):
            path = run.checkpoints.maybe_save(run.state, **when)
        if path:
            for cb in run.callbacks:
                _call(cb, "on_checkpoint", run.state, path, time.perf_counter() - started)
        return path

    def _evaluate(self, run):
        """Loss and accuracy over the whole validation set, each rank scoring its part."""
        with watching(f"evaluation at step {run.state.progress.step}"):
            return self._evaluate_watched(run)

    def _evaluate_watched(self, run):
        import torch

        from ..data import eval_shard
        from . import evaluation

        model, val, world, t = run.state.model, run.val, run.world, run.cfg.train
        size = t.eval_batch_size or t.batch_size
        if run.split is not None:  # through the pipeline; the last stages score
            return self._evaluated(run, run.split.eval_totals(run, size))
        indices = eval_shard(len(val), world.rank, world.size)
        totals = {"loss": (0.0, 0)}  # name -> (sum, count): val_loss, val_accuracy where it applies, train.metrics
        model.eval()
        with torch.no_grad():
            for lo in range(0, len(indices), size):
                x, y = val.read(indices[lo:lo + size])
                x, y = x.to(world.device), y.to(world.device)
                with _autocast(t.precision, world.device):
                    out = model(x)
                evaluation.add(totals, evaluation.score_batch(out.float(), y, run.loss_fn, run.metrics_fn))
        model.train()
        return self._evaluated(run, totals)

    def _evaluated(self, run, totals):
        from . import evaluation

        # Sums, not per-rank means: ranks may hold different numbers of samples. Added in rank
        # order on every rank, so all report the same numbers.
        run.metrics = evaluation.means(evaluation.combine(run.world.comm.allgather(totals)))
        run.evaluated_at = run.state.progress.step
        for cb in run.callbacks:
            _call(cb, "on_eval", run.state, run.metrics)
        return run.metrics

    # ------------------------------------------------------------------ helpers
    def _datasets(self, cfg, world):
        from ..data import as_dataset, generate, open_splits
        from ..factories import build_data

        if self.train_data is not None:
            return as_dataset(self.train_data), as_dataset(self.val_data)
        if cfg.data.factory:  # the user's datasets: rank 0 builds them first (a cache it writes)
            return build_data(cfg.data, world.comm)
        if cfg.data.generate != "none":
            # One rank writes the file; the others wait for it (or for its error).
            on_root(lambda: None if os.path.exists(cfg.data.path)
                    else generate(cfg.data, cfg.model, seed=cfg.run.seed), world.comm)
        return all_or_none(lambda: open_splits(cfg.data), world.comm)

    def _log(self, text):
        if self.world.is_root:
            print(f"hpctrain: {text}", flush=True)


# ---------------------------------------------------------------- pieces of fit()
def _make_optimizer(model, t, lr):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)


def _clip(optimizer, model, scaler, max_norm):
    """``train.clip_grad_norm``: the global norm of the averaged gradients (over the slices
    of every rank when sharded)."""
    import torch

    if getattr(optimizer, "sharded", False):
        return optimizer.clip_grad_norm(max_norm)
    if scaler is not None:
        scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)


def _set_lr(optimizer, base_lr, warmup_steps, step):
    """Linear warm-up, computed from the step alone (nothing to save for resume)."""
    lr = base_lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else base_lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _seed_step(seed, step, rank):
    import torch

    torch.manual_seed(int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0]))


def _autocast(precision, device):
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


def _check_enough_data(sampler):
    if sampler.steps_per_epoch < 1:
        raise ConfigError(
            f"the global batch ({sampler.batch_size} per rank x {sampler.ranks} ranks x "
            f"{sampler.accumulation} accumulation = {sampler.global_batch}) is larger than the "
            f"{sampler.num_samples} training samples", hint="lower train.batch_size or train.accumulation")


def _default_checkpoints(cfg, world, run_dir, split=None):
    from ..checkpoint import CheckpointManager

    directory = cfg.checkpoint.directory or os.path.join(run_dir, "checkpoints")
    if split is not None:  # the same manager, with the split model's plan of who writes what
        return split.checkpoints(directory, cfg.to_dict())
    return CheckpointManager(directory, world, cfg.checkpoint, run_config=cfg.to_dict())


def _call(callback, name, *args):
    method = getattr(callback, name, None)
    if method is not None:
        method(*args)
