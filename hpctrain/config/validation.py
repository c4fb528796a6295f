"""Validation: the one check of choices and ranges, on every rank before any collective (:func:`validate`).

>>> cfg = validate(load_config("examples/digits.toml"), world_size=2)   # doctest: +SKIP
"""
import dataclasses
import math
import os

from ..errors import ConfigError
from . import schema
from .budget import replicas_of, resolve_global_batch
from .schema import closest, section_names
from .usercode import check_user_code


def _check_finite(cfg):
    """NaN and infinity pass every ``< 0`` test, so they are refused by name first."""
    for section in section_names():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                default = f.default if f.default is not dataclasses.MISSING else None
                raise ConfigError(f"{section}.{f.name} = {value!r} is not a finite number",
                                  hint=f"give {section}.{f.name} a finite value, e.g. "
                                       f"{section}.{f.name}={default!r} (the default)")


def check_choice(name, value, choices, otherwise=None):
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``: the value, the choices,
    and the closest choice as the fix (else ``otherwise``, else the list)."""
    if value in choices:
        return
    close = closest(value, choices)
    raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}",
                      hint=f"did you mean {name} = {close!r}?" if close
                      else otherwise or f"set {name} to one of {', '.join(choices)}")


def _positive(name, value, zero_ok=False):
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{name} = {value!r} must be {'>= 0' if zero_ok else '> 0'}",
                          hint=f"set {name} to a {'non-negative' if zero_ok else 'positive'} value")


def _unused_without(section, obj, defaults, needs, now, fix):
    """Refuse a key of ``defaults`` (``(name, default)`` pairs) set away from its default where ``needs``, the
    setting that uses it, does not hold: ``now`` says what holds instead, ``fix`` the setting to make."""
    for name, default in defaults:
        if getattr(obj, name) != default:
            raise ConfigError(f"{section}.{name} = {getattr(obj, name)!r} is only used with {needs}, {now}",
                              hint=f"set {fix}, or remove {section}.{name}")


def validate(cfg, world_size=1, cuda=False, need_data=True):
    """Check what no single field's type can; return a resolved copy: ``train.batch_size`` (per rank) derived
    from ``global_batch_size`` if set, the accumulation raised where needed (:func:`resolve_global_batch`;
    ``cfg.notes`` says what changed). Raises :class:`ConfigError` naming the key, the value and the fix."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train))
    _check_finite(cfg)
    _check_train(cfg, cuda)
    data_ranks = _check_layout(cfg.parallel, world_size)  # the replicas: world_size when not split
    _check_shard(cfg.comm, cfg.train)
    t = cfg.train
    if t.global_batch_size:
        t.batch_size, t.accumulation, note = resolve_global_batch(t.global_batch_size, data_ranks, t.accumulation)
        if note:  # what was changed, for rank 0 to say (not a field: never written to config.toml)
            cfg.notes = (note,)
    _check_model(cfg.model)
    _check_data(cfg, need_data)
    _check_monitor(cfg.monitor)
    _check_comm_mode(cfg)
    _check_checkpoint(cfg.checkpoint)
    if not cfg.run.name or os.sep in cfg.run.name:
        raise ConfigError(f"run.name = {cfg.run.name!r} must be a non-empty name without {os.sep!r}",
                          hint='e.g. run.name = "digits"')
    check_user_code(cfg, need_data=need_data)  # the user's import paths and keyword arguments
    _check_split(cfg)
    return cfg


def _check_train(cfg, cuda):
    """``[comm]``'s backend and compression, and ``[train]``."""
    t, c = cfg.train, cfg.comm
    check_choice("comm.backend", c.backend, schema.BACKENDS)
    check_choice("comm.compression", c.compression, schema.COMPRESSIONS)
    _positive("comm.gradient_predivide_factor", c.gradient_predivide_factor)
    if not schema.is_import_path(t.optimizer):  # an import path is checked with the rest of the user's code
        check_choice("train.optimizer", t.optimizer, schema.OPTIMIZERS)
    elif t.weight_decay_on != "all":
        raise ConfigError(f"train.weight_decay_on = {t.weight_decay_on!r} is for the built-in optimizers; "
                          f"train.optimizer = {t.optimizer!r} makes its own parameter groups",
                          hint="leave train.weight_decay_on unset, or group the parameters in your function")
    check_choice("train.weight_decay_on", t.weight_decay_on, schema.DECAY_GROUPS)
    _check_schedule(t)
    check_choice("train.lr_scaling", t.lr_scaling, schema.LR_SCALINGS)
    check_choice("train.precision", t.precision, schema.PRECISIONS)
    if t.precision == "fp16" and not cuda:
        raise ConfigError("train.precision = \"fp16\" needs a GPU (a GradScaler on CUDA); this rank has none",
                          hint='use train.precision = "bf16" (mixed precision on CPU) or "fp32"')
    for name in ("batch_size", "accumulation", "lr"):
        _positive(f"train.{name}", getattr(t, name))
    for name in ("epochs", "max_steps", "global_batch_size", "momentum", "weight_decay", "warmup_steps",
                 "eval_every", "eval_batch_size", "step_timeout", "max_nonfinite_skips", "max_rollbacks",
                 "early_stop_patience"):
        _positive(f"train.{name}", getattr(t, name), zero_ok=True)
    check_choice("train.on_nonfinite", t.on_nonfinite, schema.ON_NONFINITE)
    if not 0 < t.rollback_lr_factor <= 1:
        raise ConfigError(f"train.rollback_lr_factor = {t.rollback_lr_factor!r} must be in (0, 1] (the learning "
                          f"rate is multiplied by it at each rollback)",
                          hint="e.g. train.rollback_lr_factor=0.5 (halve it), or 1 to keep it unchanged")


def _check_schedule(t):
    check_choice("train.lr_schedule", t.lr_schedule, schema.LR_SCHEDULES)
    _positive("train.lr_decay_steps", t.lr_decay_steps, zero_ok=True)
    if not 0 <= t.lr_min_ratio <= 1:
        raise ConfigError(f"train.lr_min_ratio = {t.lr_min_ratio!r} must be in [0, 1] (the floor as a fraction "
                          f"of train.lr)", hint="e.g. train.lr_min_ratio=0.1")
    if t.lr_schedule == "step":
        if t.lr_step_every < 1:
            raise ConfigError(f"train.lr_schedule = \"step\" needs train.lr_step_every > 0 (now "
                              f"{t.lr_step_every}): the steps between two decays",
                              hint="e.g. train.lr_step_every=1000 train.lr_step_gamma=0.1")
        if not 0 < t.lr_step_gamma <= 1:
            raise ConfigError(f"train.lr_step_gamma = {t.lr_step_gamma!r} must be in (0, 1]",
                              hint="e.g. train.lr_step_gamma=0.1 (a tenth at each decay)")
    if t.lr_decay_steps and t.lr_decay_steps <= t.warmup_steps and t.lr_schedule in ("cosine", "linear"):
        raise ConfigError(f"train.lr_decay_steps = {t.lr_decay_steps} ends within the warm-up "
                          f"(train.warmup_steps = {t.warmup_steps})",
                          hint="set train.lr_decay_steps above train.warmup_steps, or 0 for the run's step budget")


def _check_model(m):
    check_choice("model.name", m.name, schema.MODELS)
    for name in ("in_features", "hidden", "depth", "num_classes"):
        _positive(f"model.{name}", getattr(m, name))
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)", hint="e.g. model.dropout=0.1")


def _check_data(cfg, need_data):
    d = cfg.data
    check_choice("data.kind", d.kind, schema.DATA_KINDS)
    check_choice("data.generate", d.generate, schema.GENERATORS)
    if need_data and not d.path and not d.factory:
        raise ConfigError("data.path is not set: no training data",
                          hint='set data.path = "data/train.bin" (the training token file) with data.kind = "tokens"'
                          if d.kind == "tokens" else
                          'set data.path = "data/digits.h5" (with data.generate = "digits" to create it), '
                          'or data.factory = "package.module:function" for your own data')
    if d.generate == "digits" and (cfg.model.in_features, cfg.model.num_classes) != (64, 10):
        raise ConfigError(f"data.generate = \"digits\" makes 64 features and 10 classes, but model.in_features = "
                          f"{cfg.model.in_features} and model.num_classes = {cfg.model.num_classes}",
                          hint="set model.in_features = 64 and model.num_classes = 10")
    _positive("data.workers", d.workers, zero_ok=True)
    _positive("data.prefetch", d.prefetch)
    _positive("data.samples", d.samples)
    _positive("data.val_samples", d.val_samples, zero_ok=True)
    _check_tokens(d)


# the [data] keys that only kind "tokens" reads, with their defaults
_TOKEN_KEYS = (("block_size", 0), ("stride", 0), ("dtype", "uint16"), ("val_path", None), ("token_dataset", "tokens"))


def _check_tokens(d):
    """The keys of a token stream (``data.kind = "tokens"``, docs/data.md)."""
    check_choice("data.dtype", d.dtype, schema.TOKEN_DTYPES)
    _positive("data.stride", d.stride, zero_ok=True)  # 0: block_size
    if d.kind != "tokens":
        _unused_without("data", d, _TOKEN_KEYS, 'data.kind = "tokens"', f"but data.kind = {d.kind!r}",
                        "data.kind=tokens")
        return
    if not d.block_size:
        raise ConfigError("data.kind = \"tokens\" needs data.block_size (tokens per sample), which is not set",
                          hint="set data.block_size to the model's context length, e.g. data.block_size=256")
    _positive("data.block_size", d.block_size)
    for name, value in (("factory", d.factory), ("generate", d.generate if d.generate != "none" else "")):
        if value:
            raise ConfigError(f"data.{name} = {value!r} and data.kind = \"tokens\" do not go together: the "
                              f"tokens are read from data.path", hint=f"remove data.{name}, or data.kind")
    for name in ("path", "val_path"):
        path = getattr(d, name)
        if path is not None and os.path.splitext(path)[1].lower() not in schema.TOKEN_FORMATS:
            raise ConfigError(f"data.{name} = {path!r} is not a token file this reads (by its suffix: "
                              f"{', '.join(schema.TOKEN_FORMATS)})",
                              hint="a raw token array (.bin, with data.dtype), a NumPy .npy array, or an HDF5 "
                                   "file with a 1-D dataset data.token_dataset")


def _check_monitor(m):
    _positive("monitor.log_every", m.log_every)
    check_choice("monitor.progress", m.progress, schema.PROGRESS)
    _positive("monitor.slow_rank_window", m.slow_rank_window)
    for name in ("gather_every", "consistency_every", "slow_rank_min_seconds"):
        _positive(f"monitor.{name}", getattr(m, name), zero_ok=True)
    if m.slow_rank_factor <= 1:
        raise ConfigError(f"monitor.slow_rank_factor = {m.slow_rank_factor} must be > 1 (a ratio to the median rank)",
                          hint="e.g. monitor.slow_rank_factor = 1.3")


def _check_checkpoint(k):
    check_choice("checkpoint.best_mode", k.best_mode, schema.BEST_MODES)
    check_choice("checkpoint.consistency", k.consistency, schema.CONSISTENCY)
    for name in ("every_steps", "every_minutes", "keep_last", "keep_best", "milestone_every", "max_overhead",
                 "mtbf_hours", "local_every_steps", "alignment"):
        _positive(f"checkpoint.{name}", getattr(k, name), zero_ok=True)
    # auto_interval needs a rule, and the rules need auto_interval
    if k.auto_interval and not (k.max_overhead or k.mtbf_hours):
        raise ConfigError("checkpoint.auto_interval = true, but neither checkpoint.max_overhead nor "
                          "checkpoint.mtbf_hours is set: no rule to choose the interval by",
                          hint="e.g. checkpoint.max_overhead=0.02 (2% of wall time) and/or "
                               "checkpoint.mtbf_hours=24 (the job's mean time between failures)")
    if not k.auto_interval:
        _unused_without("checkpoint", k, (("max_overhead", 0.0), ("mtbf_hours", 0.0)),
                        "checkpoint.auto_interval = true", "which is false", "checkpoint.auto_interval=true")
    if k.max_overhead >= 0.5:
        raise ConfigError(f"checkpoint.max_overhead = {k.max_overhead!r} must be below 0.5 (a fraction of wall "
                          f"time, not a percentage)", hint="e.g. checkpoint.max_overhead=0.02 for 2%")
    if k.local is False:  # "auto" may be off at run time, but a given interval is not a mistake
        _unused_without("checkpoint", k, (("local_every_steps", 0),), "checkpoint.local = true", "which is false",
                        "checkpoint.local=true")
    for key, value in k.io_hints.items():  # MPI_Info takes strings: numbers and booleans become strings
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"checkpoint.io_hints.{key} = {value!r}: an MPI-IO hint is one value, not a "
                              f"{type(value).__name__}",
                              hint='e.g. checkpoint.io_hints = {striping_factor = 16, romio_cb_write = "enable"}')


def _check_comm_mode(cfg):
    """``comm.mode`` and the keys that only it uses (:mod:`hpctrain.training.comm_modes`)."""
    c = cfg.comm
    check_choice("comm.mode", c.mode, schema.COMM_MODES)
    check_choice("comm.outer_optimizer", c.outer_optimizer, schema.OUTER_OPTIMIZERS)
    if c.sync_every < 1:
        raise ConfigError(f"comm.sync_every = {c.sync_every!r} must be >= 1 (steps between parameter averages)",
                          hint="e.g. comm.sync_every=16; 1 averages after every step")
    if c.sync_warmup < 0:
        raise ConfigError(f"comm.sync_warmup = {c.sync_warmup!r} must be >= 0",
                          hint="e.g. comm.sync_warmup=100 (fully synchronous steps first), or 0")
    if c.mode != "local_sgd":
        _unused_without("comm", c, (("sync_every", 1), ("sync_warmup", 0), ("outer_optimizer", "none")),
                        'comm.mode = "local_sgd"', f"but comm.mode = {c.mode!r}", "comm.mode=local_sgd")
    if c.outer_optimizer == "none" and (c.outer_lr != 1.0 or c.outer_momentum != 0.0):
        raise ConfigError("comm.outer_lr or comm.outer_momentum is set, but comm.outer_optimizer = \"none\" "
                          "(the averaged parameters are taken as they are)",
                          hint="set comm.outer_optimizer=nesterov (with comm.mode=local_sgd), or remove them")
    if c.outer_lr <= 0:
        raise ConfigError(f"comm.outer_lr = {c.outer_lr!r} must be > 0", hint="e.g. comm.outer_lr=0.7")
    if not 0 <= c.outer_momentum < 1:
        raise ConfigError(f"comm.outer_momentum = {c.outer_momentum!r} must be in [0, 1)",
                          hint="e.g. comm.outer_momentum=0.9")
    if c.mode == "sync":
        return
    if cfg.train.precision == "fp16":
        raise ConfigError(f"comm.mode = {c.mode!r} does not support train.precision = \"fp16\": its GradScaler "
                          f"decides per rank which steps to skip, and the ranks' scales would drift apart",
                          hint='use train.precision = "bf16" (no scaler), or comm.mode=sync')
    if c.mode != "local_sgd":
        return
    # Step-interval checkpoints and the monitor's replica check see one model only at
    # synchronisation points (every sync_every steps). (An evaluation between them averages first.)
    for key, value in (("checkpoint.every_steps", cfg.checkpoint.every_steps),
                       ("monitor.consistency_every", cfg.monitor.consistency_every)):
        if value and value % c.sync_every:
            lower = max(c.sync_every, value // c.sync_every * c.sync_every)
            raise ConfigError(f"{key} = {value} is not a multiple of comm.sync_every = {c.sync_every}: with "
                              f"comm.mode = \"local_sgd\" the ranks hold one model only every {c.sync_every} steps",
                              hint=f"set {key}={lower} (or another multiple of comm.sync_every)")


# ---------------------------------------------------------------- [parallel]
def is_split(cfg):
    """True when ``[parallel]`` splits the model (more than one stage or tensor rank)."""
    return cfg.parallel.stages * cfg.parallel.tensor > 1


def _check_layout(p, world_size):
    """The number of replicas (data-parallel ranks) of ``[parallel]`` on ``world_size`` ranks."""
    for name in ("stages", "tensor", "micro_batches"):
        value = getattr(p, name)
        if value < 1:
            raise ConfigError(f"parallel.{name} = {value!r} must be >= 1",
                              hint=f"set parallel.{name} to a positive integer, e.g. parallel.{name}=2")
    check_choice("parallel.schedule", p.schedule, schema.SCHEDULES)
    check_choice("parallel.balance", p.balance, schema.BALANCES)
    return replicas_of(p.stages, p.tensor, world_size)


def _check_split(cfg):
    """What a split run cannot do (yet), each with the setting to change."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if m.name == "transformer":
        if m.in_features % 8:
            raise ConfigError(f"model.in_features = {m.in_features} is not a multiple of 8: the transformer reads "
                              f"a sample as tokens of 8 features", hint="use a multiple of 8, e.g. 64")
        if m.hidden % (4 * p.tensor):
            raise ConfigError(f"model.hidden = {m.hidden} does not split into 4 attention heads over "
                              f"parallel.tensor = {p.tensor} rank(s)",
                              hint=f"use a multiple of {4 * p.tensor} for model.hidden, or fewer tensor ranks")
    if not is_split(cfg):
        return
    why = "in a split run (parallel.stages x parallel.tensor > 1)"
    if t.loss == schema.MODEL_LOSS:
        raise ConfigError(f"train.loss = {t.loss!r} (the model computes its loss) needs the whole model on a rank, "
                          f"not {why}: the last stage computes the loss there",
                          hint='name the loss instead, e.g. train.loss = "cross_entropy" (per-token logits are '
                               'fine), or run unsplit (parallel.stages = 1, parallel.tensor = 1)')
    if t.accumulation != 1:
        raise ConfigError(f"train.accumulation = {t.accumulation} is not used {why}: the pipeline's micro-batches "
                          f"accumulate the gradients", hint=f"set train.accumulation=1 and parallel.micro_batches="
                                                               f"{p.micro_batches * t.accumulation}")
    if t.batch_size < p.micro_batches:
        raise ConfigError(f"train.batch_size = {t.batch_size} (per replica) cannot be cut into parallel.micro_batches "
                          f"= {p.micro_batches} micro-batches", hint=f"use train.batch_size >= {p.micro_batches}, or "
                                                                     f"fewer micro-batches")
    if t.precision != "fp32":
        raise ConfigError(f"train.precision = {t.precision!r} is not supported {why}",
                          hint='use train.precision = "fp32"')
    if cfg.checkpoint.async_save:
        raise ConfigError(f"checkpoint.async_save is not supported {why}: each rank writes its part of the "
                          f"model in place", hint="set checkpoint.async_save=false")
    if cfg.checkpoint.local is True:  # "auto" is off here (training.setup says so)
        raise ConfigError(f"checkpoint.local (node-local checkpoints) is not supported {why} yet: a snapshot "
                          f"is recovered as a data-parallel state", hint="set checkpoint.local=false")
    if cfg.monitor.consistency_every:
        raise ConfigError(f"monitor.consistency_every compares all ranks' models, but {why} the ranks hold "
                          f"different parts; checkpoints still compare the replicas of each stage",
                          hint="set monitor.consistency_every=0")
    if cfg.comm.mode != "sync":
        raise ConfigError(f"comm.mode = {cfg.comm.mode!r} is not supported {why}: the replicas of each stage "
                          f"average their gradients at every step", hint='set comm.mode = "sync"')
    if t.clip_grad_norm:
        raise ConfigError(f"train.clip_grad_norm is not supported {why}: no rank holds every gradient to take "
                          f"the global norm of", hint="set train.clip_grad_norm=0")
    if cfg.comm.shard != "none":
        raise ConfigError(f"comm.shard = {cfg.comm.shard!r} is not supported {why}: each stage's optimizer "
                          f"already holds only its own layers' state", hint='set comm.shard = "none"')


def _check_shard(c, t):
    """``comm.shard`` and ``train.clip_grad_norm``: the choices, and what sharding cannot do."""
    check_choice("comm.shard", c.shard, schema.SHARD_MODES,
                 'comm.shard = "optimizer" (ZeRO stage 1), "gradients" (stage 2) or "none"')
    check_choice("comm.shard_reduce", c.shard_reduce, schema.SHARD_REDUCTIONS,
                 'comm.shard_reduce = "auto", "allreduce" or "reduce_scatter"')
    if t.clip_grad_norm < 0:
        raise ConfigError(f"train.clip_grad_norm = {t.clip_grad_norm!r} must be >= 0",
                          hint="e.g. train.clip_grad_norm=1.0, or 0 for no clipping")
    if c.shard != "none" and t.precision == "fp16":
        raise ConfigError(f"comm.shard = {c.shard!r} does not support train.precision = \"fp16\" (its GradScaler "
                          f"steps the whole optimizer, not one rank's shard)",
                          hint='use train.precision = "bf16", or comm.shard = "none" with fp16')
    if c.shard != "none" and c.mode != "sync":
        raise ConfigError(f"comm.shard = {c.shard!r} and comm.mode = {c.mode!r} do not go together: a sharded "
                          f"step reduce-scatters the gradients of that very step",
                          hint='set comm.mode = "sync" with comm.shard, or comm.shard = "none" with local_sgd/stale')
