"""Setting up a run: the named steps of :meth:`hpctrain.Trainer.fit` before its first step, in
the order every rank follows (each collective one is entered by every rank, or fails on all).

    (a warm spare's call) -> validate -> watchdog -> steps (backend, process grid) -> run directory and its
    lock -> data and sampler -> model -> optimizer and state -> checkpoints -> resume -> the backend started
    (data-parallel steps start it here, not with the steps), the optimizer wrapped, rank 0's state broadcast
    -> monitor -> the run's first lines
"""
import dataclasses
import os

from ..checkpoint import CheckpointManager
from ..config import is_split, step_budget, validate
from ..data import ShardSampler, open_datasets
from ..data.loading import PrefetchingReader
from ..errors import ConfigError
from ..job import rundir, runlock, spares, survivor
from ..job.watchdog import Watchdog, watching
from ..models import count_parameters
from ..monitoring.monitor import Monitor, build_callbacks
from ..monitoring.timing import PhaseTimer
from ..runtime import allocator, startup
from ..runtime.coordination import all_or_none, on_root
from ..runtime.world import init_world, mpi_settings
from ..state import Progress, TrainState
from . import comm_modes, recipes
from .losses import build_loss, build_metrics
from .optimizers import make_optimizer
from .run import Run
from .split import SplitSteps
from .steps import DataParallelSteps, ShardedSteps

LR_DECAY = "lr_decay_steps"  # in Progress.extra: [the step where the schedule ends, the settings it came from]


def set_up(trainer, local):
    """``trainer``'s :class:`~.run.Run`; ``local`` (an ExitStack) gets the cleanup one rank can do alone."""
    import torch

    world = trainer.world = trainer.world or init_world()
    spares.wait_until_called(world)  # a warm spare rank of hpctrain launch waits here for its call
    cfg = _validated(trainer.config, world, need_data=trainer.train_data is None)
    t = cfg.train
    # A step, or any other collective phase (watching(...)), that outlives step_timeout (a
    # rank stuck in a collective) ends the whole job. Made first: the set-up below already waits.
    watchdog = local.enter_context(Watchdog(t.step_timeout or None, comm=world.comm, where=world.where()))
    steps = steps_for(cfg, world)
    startup.mark("backend")
    run_dir = _run_directory(cfg, world, steps, local)
    startup.mark("run_dir")
    with watching("opening the data set"):
        train, val = open_datasets(cfg, world.comm, trainer.train_data, trainer.val_data)
        # Split runs: each replica (not each rank) reads train.batch_size samples per step.
        sampler = ShardSampler(len(train), cfg.run.seed, t.batch_size, steps.data_ranks, t.accumulation)
        all_or_none(lambda: _check_enough_data(sampler), world.comm)
    if cfg.data.workers:  # the next batches read by worker processes while the step computes
        train = PrefetchingReader(train, cfg.data.workers, cfg.data.prefetch, pin_memory=world.device.startswith("cuda"),
                                  seed=cfg.run.seed, rank=steps.data_rank)
        local.callback(train.close)
    startup.mark("data")
    torch.manual_seed(cfg.run.seed)  # the same initial weights everywhere (broadcast anyway)
    loss_fn = trainer.loss_fn or build_loss(t.loss)
    model = steps.build_model(trainer.model, train, loss_fn)
    said = _recipes(cfg, model, val) + ([train.describe()] if cfg.data.workers else [])
    base_lr = t.lr * (world.size if t.lr_scaling == "linear" else 1)
    state = _state(cfg, steps, model, base_lr)
    startup.mark("model")
    checkpoints = trainer.checkpoints
    if t.early_stop_patience and not cfg.checkpoint.keep_best:  # the best checkpoint outlives the patience
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, keep_best=1)
        said.append("early stopping keeps the best checkpoint (checkpoint.keep_best = 1)")
    if cfg.checkpoint.local == "auto" and is_split(cfg):  # its snapshots are recovered as a data-parallel state
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, local=False)
        said.append('node-local checkpoints: off (checkpoint.local = "auto"): not yet for a split model')
    if checkpoints == "auto":
        checkpoints = CheckpointManager(rundir.checkpoint_dir(cfg, run_dir), world, cfg.checkpoint,
                                        run_config=cfg.to_dict(), planner=steps.planner())
    with watching("resume from a checkpoint"):
        if checkpoints is not None and checkpoints.resume(state):
            sampler.seed = state.progress.seed  # the data order of the run being resumed
    startup.mark("resume")  # the checkpoint found and read (or none)
    with watching("starting the backend and sharing rank 0's state"):
        steps.start(state)  # Horovod's thread not beside the MPI-IO above (DataParallelSteps.starts_after_resume)
        steps.broadcast(state)
        state.comm_mode.start(state)
    startup.mark("backend start")  # started, and the state shared
    p = state.progress
    budget = step_budget(t, sampler.steps_per_epoch, p.step, p.epoch,
                         max(0, sampler.num_samples - p.samples_in_epoch) // sampler.global_batch)
    callbacks = _callbacks(trainer.callbacks, cfg, steps, run_dir, sampler, total_steps=budget[1], start_step=p.step)
    run = Run(world, cfg, steps, run_dir, train, val, sampler, state, checkpoints, callbacks,
              PhaseTimer(sync=torch.cuda.synchronize if world.device.startswith("cuda") else None), watchdog,
              loss_fn, base_lr, metrics_fn=build_metrics(t.metrics), budget=budget,
              decay_steps=_decay_steps(t, budget, state.progress))
    if t.early_stop_patience:
        run.early_stop = recipes.EarlyStop(t.early_stop_patience, cfg.checkpoint.best_metric, cfg.checkpoint.best_mode)
    _say_first_lines(run)
    for line in said:
        run.log(line)
    model.train()
    return run


def _recipes(cfg, model, val):
    """``train.activation_checkpointing`` and ``train.compile`` applied to ``model``; what to say of them."""
    t, said = cfg.train, []
    if t.early_stop_patience and val is None:
        raise ConfigError(f"train.early_stop_patience = {t.early_stop_patience} needs evaluations, but the run has no "
                          f"validation data", hint="give validation data (data.val, data.val_path, or (train, val) "
                                                   "from data.factory), or leave train.early_stop_patience at 0")
    if t.activation_checkpointing:
        said.append(recipes.checkpoint_activations(model))
    if t.compile:
        said.append(recipes.compile_model(model))
    return said


def steps_for(cfg, world):
    """The steps of ``cfg`` on ``world`` (collective: backends, process grids)."""
    if is_split(cfg):
        with watching("building the process grid"):
            return SplitSteps(cfg, world)
    return (ShardedSteps if cfg.comm.shard != "none" else DataParallelSteps)(cfg, world)


def _validated(config, world, need_data):
    # Every rank checks the same thing before any collective; all fail alike or none.
    return all_or_none(lambda: validate(config, world.size, cuda=world.device.startswith("cuda"),
                                        need_data=need_data), world.comm)


def _run_directory(cfg, world, steps, local):
    with watching("creating the run directory"):
        run_dir = on_root(lambda: rundir.create(cfg, world, steps.backend), world.comm)
    if world.is_root:
        local.callback(runlock.release, run_dir)
    return run_dir


def _check_enough_data(sampler):
    if sampler.steps_per_epoch < 1:
        raise ConfigError(
            f"the global batch ({sampler.batch_size} per rank x {sampler.ranks} ranks x "
            f"{sampler.accumulation} accumulation = {sampler.global_batch}) is larger than the "
            f"{sampler.num_samples} training samples", hint="lower train.batch_size or train.accumulation")


def _state(cfg, steps, model, base_lr):
    """The model, its optimizer as ``comm.mode``/``comm.shard`` have it, fp16's GradScaler, the comm mode."""
    import torch

    t = cfg.train
    mode = comm_modes.build(cfg.comm, steps.backend, model)  # comm.mode: sync, local_sgd, stale
    optimizer = steps.wrap_optimizer(lambda: make_optimizer(model, t, base_lr), model, mode)
    scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
    return TrainState(model, optimizer, Progress(seed=cfg.run.seed), scaler, comm_mode=mode)


def _decay_steps(t, budget, progress):
    """The step where ``train.lr_schedule`` reaches its floor: ``train.lr_decay_steps``, else the step budget as
    the run first had it. Kept in the checkpoints, so that a relaunch on other ranks (other steps per epoch)
    decays the same; recomputed where the settings it came from changed."""
    if t.lr_schedule not in ("cosine", "linear"):
        return 0
    settings = [t.lr_decay_steps, t.max_steps, t.epochs]
    saved = progress.extra.get(LR_DECAY)
    if saved is None or saved[1] != settings:
        progress.extra[LR_DECAY] = saved = [t.lr_decay_steps or budget[1], settings]
    return saved[0]


def _callbacks(given, cfg, steps, run_dir, sampler, total_steps, start_step=0):
    if cfg.monitor.horovod_timeline:
        steps.backend.start_timeline(os.path.join(run_dir, "horovod_timeline.json"))
    callbacks = list(given)
    if not any(isinstance(cb, Monitor) for cb in callbacks):
        # Every rank builds it: the monitor gathers timings across ranks.
        with watching("monitor set-up"):
            callbacks = build_callbacks(cfg.monitor, run_dir, comm=steps.world.comm, total_steps=total_steps,
                                        samples_per_step=sampler.global_batch, startup=startup.take(),
                                        start_step=start_step) + callbacks
    return callbacks


def _say_first_lines(run):
    t, steps, sampler, world = run.cfg.train, run.steps, run.sampler, run.world
    params, tensors = count_parameters(run.state.model)
    run.log(f"{world.size} ranks ({world.launcher}), {steps.backend.describe()}, {run.state.comm_mode.describe()}; "
            f"{steps.holds} {params:,} parameters in {tensors} tensors; "
            f"global batch {sampler.global_batch} = {t.batch_size} x {sampler.ranks} {steps.data_ranks_are} x "
            f"{t.accumulation}; {sampler.steps_per_epoch} steps/epoch; until step {run.budget[1]} ({run.budget[2]}); "
            f"run dir {run.run_dir}")
    if t.lr_schedule != "constant":
        ends = f"x {t.lr_step_gamma:g} every {t.lr_step_every} steps" if t.lr_schedule == "step" else \
            f"to {run.base_lr * t.lr_min_ratio:.3g} at step {run.decay_steps}"
        run.log(f"learning rate: warm-up over {t.warmup_steps} steps to {run.base_lr:.3g}, then {t.lr_schedule} "
                f"{ends}")
    run.log(allocator.tune())  # what hpctrain set for the user (docs/performance.md)
    if mpi_settings():
        run.log(mpi_settings())
    if getattr(run.checkpoints, "io", None) is not None:  # a user's own manager may not have it
        run.log(run.checkpoints.io.describe())
    if getattr(run.checkpoints, "local", None) is not None:
        run.log(run.checkpoints.local.describe())
        if startup.forked() or survivor.asked_by_srun():
            run.log(_offer_survivors_state(run))
    for note in getattr(run.cfg, "notes", ()):  # what validate() changed, e.g. the accumulation
        run.log(note)
    if steps.describe():
        run.log(steps.describe())


def _offer_survivors_state(run):
    """A rank forked from the warm pool, or a task of an srun step of hpctrain launch, offers to keep its state
    should another rank fail (:mod:`..job.survivor`); what the run says of it."""
    level, cfg = run.checkpoints.local, run.cfg
    why = survivor.unsuited(cfg, run.state.model, cfg.comm.shard == "none" and not is_split(cfg))
    who = None if why or level.off else survivor.offer(level, run.state, run.settling, run.checkpoints.run_config)
    if who:
        return ("a failed rank costs the step in flight: a rank that survives it writes the state of its last step "
                f"to the node-local level before the launch ends ({who})")
    return (f"a failed rank costs the steps since the newest snapshot: the ranks that survive it cannot keep their "
            f"state ({why or level.off or 'no one took the offer'})")
