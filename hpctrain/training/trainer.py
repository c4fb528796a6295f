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
import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from ..job import rundir, runlock
from ..config import TrainConfig, load_config, validate
from ..coordination import all_or_none, any_rank, on_root
from ..errors import ConfigError
from ..monitoring.monitor import Monitor, build_callbacks
from ..state import Progress, TrainState
from ..monitoring.timing import PhaseTimer
from ..job.watchdog import Watchdog


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

    ``config``: a :class:`~hpctrain.config.TrainConfig`, a dict of sections, or a TOML path.
    ``model``: an ``nn.Module`` (default: built from ``[model]``). ``train_data``/``val_data``:
    datasets (default: the HDF5 file of ``[data]``). ``checkpoints``: an object with
    ``resume(state)``, ``maybe_save(state, ...)``, ``close()``; ``"auto"`` uses
    ``hpctrain.checkpoint.CheckpointManager`` when that package is installed, ``None`` none.
    ``callbacks``: objects with any of ``on_step(state, metrics, phase_times)``,
    ``on_eval(state, metrics)``, ``on_checkpoint(state, path, seconds)``, ``on_end(state)``.
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

    # ------------------------------------------------------------------ the run
    def fit(self):
        import torch

        from ..backends import get_backend
        from ..data import ShardSampler
        from ..world import init_world

        world = self.world = self.world or init_world()
        comm = world.comm
        cuda = world.device.startswith("cuda")
        # Every rank checks the same thing before any collective; all fail alike or none.
        cfg = self.config = all_or_none(
            lambda: validate(self.config, world.size, cuda=cuda, need_data=self.train_data is None), comm)
        t = cfg.train
        backend = self.backend = get_backend(cfg.comm.backend, world, cfg.comm.compression,
                                             cfg.comm.gradient_predivide_factor)
        run_dir = on_root(lambda: rundir.create(cfg, world, backend), comm)

        train, val = self._datasets(cfg, world)
        sampler = ShardSampler(len(train), cfg.run.seed, t.batch_size, world.size, t.accumulation)
        all_or_none(lambda: _check_enough_data(sampler), comm)

        torch.manual_seed(cfg.run.seed)  # the same initial weights everywhere (broadcast anyway)
        model = self.model if self.model is not None else _build_model(cfg)
        model.to(world.device)
        base_lr = t.lr * (world.size if t.lr_scaling == "linear" else 1)
        optimizer = backend.distributed_optimizer(_make_optimizer(model, t, base_lr), model, t.accumulation)
        scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
        state = self.state = TrainState(model, optimizer, Progress(seed=cfg.run.seed), scaler)

        checkpoints = self.checkpoints
        if checkpoints == "auto":
            checkpoints = _default_checkpoints(cfg, world, run_dir)
        if checkpoints is not None and checkpoints.resume(state):
            sampler.seed = state.progress.seed  # the data order of the run being resumed
        backend.broadcast_state(model, optimizer)  # rank 0's weights and optimizer state win

        progress = state.progress
        loss_fn = self.loss_fn or torch.nn.CrossEntropyLoss()
        timer = PhaseTimer(sync=torch.cuda.synchronize if cuda else None)
        total_steps = sampler.steps_per_epoch * t.epochs
        if t.max_steps:
            total_steps = min(total_steps, t.max_steps)
        if cfg.monitor.horovod_timeline:
            backend.start_timeline(os.path.join(run_dir, "horovod_timeline.json"))
        callbacks = self.callbacks
        if not any(isinstance(cb, Monitor) for cb in callbacks):
            # Every rank builds it: the monitor gathers timings across ranks.
            callbacks = build_callbacks(cfg.monitor, run_dir, comm=comm, total_steps=total_steps,
                                        samples_per_step=sampler.global_batch) + callbacks
        self._callbacks = callbacks
        self._log(f"{world.size} ranks ({world.launcher}), {backend.describe()}; model "
                  f"{_size(model)}; global batch {sampler.global_batch} = {t.batch_size} x {world.size} "
                  f"ranks x {t.accumulation}; {sampler.steps_per_epoch} steps/epoch; run dir {run_dir}")

        metrics, last_loss, stopped, evaluated_at = {}, None, False, None
        # A step that outlives step_timeout (a rank stuck in a collective) ends the whole job.
        watchdog = Watchdog(t.step_timeout or None, comm=comm, where=world.where())
        model.train()
        while progress.epoch < t.epochs and not stopped:
            for micro_batches in sampler.steps(progress.epoch, progress.samples_in_epoch, world.rank):
                if t.max_steps and progress.step >= t.max_steps:
                    break
                timer.start_step()
                lr = _set_lr(optimizer, base_lr, t.warmup_steps, progress.step)
                with watchdog.step(progress.step + 1):
                    last_loss = self._train_step(micro_batches, train, loss_fn, timer, cfg, world)
                progress.step += 1
                progress.samples_in_epoch += sampler.global_batch
                step_metrics = {"loss": last_loss, "lr": lr, "epoch": progress.epoch, "step": progress.step}

                fresh = None  # metrics go to the checkpoints only on the step that measured them
                if t.eval_every and progress.step % t.eval_every == 0 and val is not None:
                    metrics = fresh = self._evaluate(val, loss_fn, cfg, world)
                    evaluated_at = progress.step
                with timer.phase("checkpoint"):
                    self._save(checkpoints, metrics=fresh)
                phase_times = timer.times()
                for cb in callbacks:
                    _call(cb, "on_step", state, step_metrics, phase_times)

                # Agree at every step boundary, so all ranks save and stop after the same step.
                if self.stop_requested is not None and any_rank(bool(self.stop_requested()), comm):
                    self._log(f"stop requested: saving at step {progress.step}")
                    self._save(checkpoints, requested=True)
                    stopped = True
                    break
            else:  # the epoch ran to its end
                progress.epoch += 1
                progress.samples_in_epoch = 0
                if val is not None:
                    metrics = self._evaluate(val, loss_fn, cfg, world)
                    evaluated_at = progress.step
                self._save(checkpoints, epoch_end=True, metrics=metrics or None)
                continue
            break  # max_steps or a stop

        train_loss = None if last_loss is None else backend.allreduce_mean(last_loss)
        if val is not None and not stopped and evaluated_at != progress.step:  # ended mid-epoch
            metrics = self._evaluate(val, loss_fn, cfg, world)
        if not stopped:
            self._save(checkpoints, final=True, metrics=metrics or None)
        for cb in callbacks:
            _call(cb, "on_end", state)
        watchdog.close()
        if checkpoints is not None:
            checkpoints.close()
        backend.close()
        if world.is_root:
            runlock.release(run_dir)
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self._log(f"{'stopped' if stopped else 'done'} at step {progress.step}, epoch {progress.epoch}: "
                  f"train loss {train_loss if train_loss is None else round(train_loss, 4)} {shown}")
        return FitResult(run_dir, progress.step, progress.epoch, stopped, train_loss, dict(metrics))

    # ------------------------------------------------------------------ one step
    def _train_step(self, micro_batches, train, loss_fn, timer, cfg, world):
        """Forward/backward every micro-batch, average gradients, apply them; mean loss."""
        state, backend = self.state, self.backend
        model, optimizer, scaler = state.model, state.optimizer, state.scaler
        _seed_step(state.progress.seed, state.progress.step, world.rank)
        total = 0.0
        for indices in micro_batches:
            with timer.phase("data"):
                x, y = train.read(indices)
                x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
            with timer.phase("forward_backward"):
                with _autocast(cfg.train.precision, world.device):
                    loss = loss_fn(model(x), y)
                # Dividing by the micro-batch count makes the summed gradient a mean.
                scaled = loss / len(micro_batches)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                total += float(loss.detach())
        with timer.phase("allreduce_wait"):
            backend.synchronize(optimizer)
        with timer.phase("optimizer"):
            backend.step(optimizer, scaler)
            optimizer.zero_grad()
        return total / len(micro_batches)

    def _save(self, checkpoints, **when):
        """Save if ``when`` calls for it (collective); tell the callbacks what was saved."""
        if checkpoints is None:
            return None
        started = time.perf_counter()
        path = checkpoints.maybe_save(self.state, **when)
        if path:
            for cb in self._callbacks:
                _call(cb, "on_checkpoint", self.state, path, time.perf_counter() - started)
        return path

    def _evaluate(self, val, loss_fn, cfg, world):
        """Loss and accuracy over the whole validation set, each rank scoring its part."""
        import torch

        from ..data import eval_shard

        model = self.state.model
        indices = eval_shard(len(val), world.rank, world.size)
        size = cfg.train.eval_batch_size or cfg.train.batch_size
        sums = torch.zeros(3, dtype=torch.float64)  # loss x count, correct, count
        model.eval()
        with torch.no_grad():
            for lo in range(0, len(indices), size):
                x, y = val.read(indices[lo:lo + size])
                x, y = x.to(world.device), y.to(world.device)
                with _autocast(cfg.train.precision, world.device):
                    out = model(x)
                sums[0] += float(loss_fn(out.float(), y)) * len(y)
                if out.dim() == 2 and not y.dtype.is_floating_point:
                    sums[1] += float((out.argmax(dim=1) == y).sum())
                sums[2] += len(y)
        model.train()
        # Sums, not per-rank means: ranks may hold different numbers of samples.
        loss_sum, correct, count = self.backend.allreduce_mean(sums).tolist()
        metrics = {"val_loss": loss_sum / max(count, 1), "val_accuracy": correct / max(count, 1)}
        for cb in self._callbacks:
            _call(cb, "on_eval", self.state, metrics)
        return metrics

    # ------------------------------------------------------------------ helpers
    def _datasets(self, cfg, world):
        from ..data import as_dataset, generate, open_splits

        if self.train_data is not None:
            return as_dataset(self.train_data), as_dataset(self.val_data)
        if cfg.data.generate != "none":
            # One rank writes the file; the others wait for it (or for its error).
            on_root(lambda: None if os.path.exists(cfg.data.path)
                    else generate(cfg.data, cfg.model, seed=cfg.run.seed), world.comm)
        return all_or_none(lambda: open_splits(cfg.data), world.comm)

    def _log(self, text):
        if self.world.is_root:
            print(f"hpctrain: {text}", flush=True)


# ---------------------------------------------------------------- pieces of fit()
def _build_model(cfg):
    from ..models import build_model

    return build_model(cfg.model)


def _make_optimizer(model, t, lr):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)


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


def _default_checkpoints(cfg, world, run_dir):
    if importlib.util.find_spec("hpctrain.checkpoint") is None:
        return None
    from ..checkpoint import CheckpointManager

    directory = cfg.checkpoint.directory or os.path.join(run_dir, "checkpoints")
    return CheckpointManager(directory, world, cfg.checkpoint, run_config=cfg.to_dict())


def _call(callback, name, *args):
    method = getattr(callback, name, None)
    if method is not None:
        method(*args)


def _size(model):
    from ..models import count_parameters

    params, tensors = count_parameters(model)
    return f"{params:,} parameters in {tensors} tensors"
