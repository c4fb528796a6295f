"""Configuration: one dataclass per TOML section, ``key=value`` overrides, validation.

    [run]   [model]   [data]   [train]   [comm]   [checkpoint]   [monitor]   [parallel]

Sources, each later one winning: the TOML file, ``HPCTRAIN_BACKEND`` (see
:mod:`hpctrain.settings`), ``section.key=value`` overrides typed by the field they set.
Unknown sections and keys are errors that list the valid ones. :func:`validate` checks
what types cannot (choices, divisibility, a GPU for fp16) and is run on every rank before
any collective.

>>> cfg = load_config("examples/digits.toml", ["train.batch_size=32", "comm.compression=fp16"])  # doctest: +SKIP
>>> cfg = validate(cfg, world_size=2)                                                               # doctest: +SKIP
"""
import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from . import settings
from .backends import NAMES as BACKENDS
from .compression import NAMES as COMPRESSIONS
from .errors import ConfigError


@dataclass
class CheckpointConfig:
    """``[checkpoint]`` section."""

    directory: Optional[str] = None  # default: <run_dir>/checkpoints
    every_steps: int = 0  # 0: off
    every_minutes: float = 0.0  # wall clock; 0: off
    on_epoch_end: bool = True
    on_finish: bool = True
    keep_last: int = 3  # 0: keep all
    keep_best: int = 0
    best_metric: str = "val_loss"
    best_mode: str = "min"  # "min" or "max"
    milestone_every: int = 0  # keep every M-th step's checkpoint forever; 0: off
    resume: str = "auto"  # "auto", "none", or a path to a checkpoint file
    async_save: bool = False  # copy to host memory, write while training continues
    verify: bool = True  # verify checksums after write, before rename
    consistency: str = "check"  # "check", "repair" or "off"
    # The interval chosen by hpctrain (docs/performance.md, "Checkpoint interval"): from the
    # measured save cost and step time; every_steps/every_minutes, when set, are upper bounds.
    auto_interval: bool = False
    max_overhead: float = 0.0  # fraction of wall time training may wait for saves, e.g. 0.02; 0: off
    mtbf_hours: float = 0.0  # the job's mean time between failures: Young/Daly interval; 0: off


# ---------------------------------------------------------------- the other sections
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCALINGS = ("none", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
ON_NONFINITE = ("auto", "skip", "rollback", "stop")
GENERATORS = ("none", "digits", "teacher")


@dataclass
class RunConfig:
    """``[run]``: where the run's files go and its seed."""

    name: str = "run"
    root: Optional[str] = None  # default: $HPCTRAIN_RUN_ROOT or ./runs
    run_dir: Optional[str] = None  # default: <root>/<name>-<YYYYmmdd-HHMMSS>; reuse one to resume
    seed: int = 0
    # directories put first on the import path (with the working directory) for the factories
    # that [model], [data] and [train] name; relative to the working directory
    python_path: list = field(default_factory=list)


@dataclass
class ModelConfig:
    """``[model]``: one of the models in :mod:`hpctrain.models`."""

    name: str = "mlp"
    in_features: int = 64
    hidden: int = 128  # width of every hidden layer
    depth: int = 1  # number of hidden layers (residual blocks when ``residual``)
    num_classes: int = 10
    residual: bool = False
    layer_norm: bool = False
    dropout: float = 0.0
    # Your own model instead (hpctrain/factories.py): "package.module:function" returning an
    # nn.Module, called with the keyword arguments of [model.kwargs]; the fields above are then unused.
    factory: str = ""
    kwargs: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    """``[data]``: an HDF5 file with a training and (optionally) a validation split."""

    path: Optional[str] = None  # HDF5 file
    train: str = "train"  # group holding the training split ("" = the file's root)
    val: str = "val"  # group holding the validation split; "none" for no evaluation
    x: str = "x"  # dataset names inside each group
    y: str = "y"
    generate: str = "none"  # create ``path`` on rank 0 if missing: "digits", "teacher" or "none"
    samples: int = 65536  # teacher corpus: training samples
    val_samples: int = 4096  # teacher corpus: validation samples
    # Your own data instead: "package.module:function" returning (train, val) datasets, or one
    # (no evaluation); called with [data.kwargs], on rank 0 first, then on the other ranks.
    factory: str = ""
    kwargs: dict = field(default_factory=dict)


@dataclass
class LoopConfig:
    """``[train]``: the training loop."""

    epochs: int = 1
    max_steps: int = 0  # stop after this many optimizer steps; 0: no limit
    batch_size: int = 32  # per rank and backward pass
    global_batch_size: int = 0  # if set: batch_size = global_batch_size / (ranks x accumulation)
    accumulation: int = 1  # backward passes per optimizer step
    lr: float = 0.1
    optimizer: str = "sgd"  # sgd, adam, adamw
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_scaling: str = "none"  # "linear": lr x ranks
    warmup_steps: int = 0  # linear warm-up from lr/warmup_steps to lr
    precision: str = "fp32"  # fp32, bf16 (CPU or GPU), fp16 (GPU only, with a GradScaler)
    eval_every: int = 0  # steps between evaluations; 0: at the end of each epoch only
    eval_batch_size: int = 0  # 0: batch_size
    step_timeout: float = 0.0  # seconds; a longer step aborts the job (0: HPCTRAIN_WATCHDOG_TIMEOUT, else off)
    # A step whose averaged gradients hold NaN or infinity is never applied. What follows:
    # "auto" (default, for unattended jobs): skip the update; after max_nonfinite_skips
    #   consecutive skipped steps, roll back to the newest checkpoint with the learning rate
    #   multiplied by rollback_lr_factor; after max_rollbacks rollbacks (or with no checkpoint
    #   to go back to), stop with an error naming the step and the first non-finite gradient.
    # "skip": skip, and stop after max_nonfinite_skips consecutive skips.
    # "rollback": roll back at once (then as "auto"). "stop": stop at the first one.
    # With fp16 the GradScaler skips such steps itself (and lowers its scale); nothing more.
    on_nonfinite: str = "auto"
    max_nonfinite_skips: int = 3  # consecutive skipped steps tolerated
    max_rollbacks: int = 2  # rollbacks per run (counted across resumes) before stopping
    rollback_lr_factor: float = 0.5  # learning-rate multiplier per rollback, kept across resumes; 1: unchanged
    # loss(output, target) -> scalar: a built-in name (factories.LOSSES) or "package.module:function"
    loss: str = "cross_entropy"
    # evaluation metrics besides val_loss: "package.module:function" (output, target) -> {name: (sum, count)}
    metrics: str = ""
    clip_grad_norm: float = 0.0  # clip the averaged gradients to this global L2 norm; 0: off


@dataclass
class CommConfig:
    """``[comm]``: gradient communication."""

    backend: str = "horovod"  # or "mpi"; HPCTRAIN_BACKEND overrides the file
    compression: str = "none"  # or "fp16"
    gradient_predivide_factor: float = 1.0  # divide before the sum, the rest after (fp16 range)
    # When ranks exchange what (docs/asynchronous.md): "sync" (every step), "local_sgd" (each rank
    # steps alone; parameters averaged every sync_every steps), "stale" (gradients averaged while
    # the next step computes, applied one step late).
    mode: str = "sync"
    sync_every: int = 1  # local_sgd: steps between parameter averages
    sync_warmup: int = 0  # local_sgd: first steps trained fully synchronous
    outer_optimizer: str = "none"  # local_sgd: "none" (plain average) or "nesterov" on the averaged change
    outer_lr: float = 1.0  # local_sgd with nesterov
    outer_momentum: float = 0.0  # local_sgd with nesterov, e.g. 0.9
    check_replicas: bool = True  # local_sgd: compare the replicas' fingerprints after every average
    # "optimizer" (ZeRO stage 1): each rank keeps and updates 1/N of the optimizer state;
    # "gradients" (stage 2): also only 1/N of the gradients after the reduce-scatter. docs/sharding.md
    shard: str = "none"
    # How a sharded run reduces the gradients: "allreduce" (buckets during the backward pass, each
    # rank keeps its slice), "reduce_scatter" (after it: half the bytes on a ring network), or "auto"
    # (all-reduce on CPUs, where it measured faster here; reduce-scatter on GPUs). docs/sharding.md
    shard_reduce: str = "auto"


@dataclass
class MonitorConfig:
    """``[monitor]``."""

    log_every: int = 10  # steps between progress lines on rank 0
    progress: str = "auto"  # "auto" (a bar on a terminal, lines otherwise), "bar", "log", "off"
    # the rest: see docs/monitoring.md
    gather_every: int = 0  # steps between gathers of per-rank phase timings; 0: log_every
    slow_rank_factor: float = 1.3  # a rank whose work per step exceeds factor x median ...
    slow_rank_window: int = 3  # ... in this many consecutive gathers is reported
    slow_rank_min_seconds: float = 0.005  # ... and only if it is also this much slower per step
    consistency_every: int = 0  # steps between parameter checksums compared across ranks; 0: off
    tensorboard: bool = False  # also write TensorBoard events (needs the tensorboard package)
    horovod_timeline: bool = False  # Horovod timeline to <run_dir>/horovod_timeline.json


@dataclass
class ParallelConfig:
    """``[parallel]``: split the model over ranks (docs/parallelism.md). Each replica is
    ``stages x tensor`` ranks; replicas = ranks / (stages x tensor). With ``stages = tensor = 1``
    (the default) training is data-parallel and nothing here is used. In a split run
    ``train.batch_size`` is per replica (one pipeline pass, cut into ``micro_batches``)."""

    stages: int = 1  # pipeline stages (consecutive layers per stage)
    tensor: int = 1  # tensor-parallel ranks per stage (attention heads and MLP widths split)
    schedule: str = "1f1b"  # "1f1b" (less activation memory) or "gpipe"
    micro_batches: int = 1  # per replica and step; use several per stage to keep the pipeline busy
    balance: str = "params"  # layers per stage by parameter count, or "time" (measured per layer)


@dataclass
class TrainConfig:
    """A whole run's configuration: one attribute per TOML section.

    >>> cfg = TrainConfig()
    >>> cfg.train.batch_size = 64
    >>> cfg = load_config("examples/digits.toml", ["train.lr=0.05"])   # doctest: +SKIP
    """

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_dict(cls, data, source="configuration"):
        """Build from nested dicts (as TOML gives); unknown sections or keys are errors."""
        cfg = cls()
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table of sections, found {type(data).__name__}")
        for section, values in data.items():
            target = _section(cfg, section, source)
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table of keys, found {values!r}",
                                  hint=f"write it as\n[{section}]\nkey = value")
            for key, value in values.items():
                _set(target, section, key, value, source)
        return cfg

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_toml(self):
        """TOML text that :func:`load_config` reads back to an equal configuration."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    lines.append(f"# {key} = (not set)")
                elif isinstance(value, bool):
                    lines.append(f"{key} = {'true' if value else 'false'}")
                elif isinstance(value, (int, float)):
                    lines.append(f"{key} = {value!r}")
                elif isinstance(value, (dict, list)):
                    lines.append(f"{key} = {_toml_value(value)}")
                else:
                    lines.append(f"{key} = {json.dumps(str(value))}")
            lines.append("")
        return "\n".join(lines)


def section_names():
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _closest(name, choices):
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return close[0] if close else None


def _section(cfg, section, source):
    names = section_names()
    if section not in names:
        close = _closest(section, names)
        raise ConfigError(f"{source}: unknown section [{section}]; valid sections: {', '.join(names)}",
                          hint=f"did you mean [{close}]?" if close else "remove it")
    return getattr(cfg, section)


def _fields(obj):
    return {f.name: f for f in dataclasses.fields(obj)}


def _field_type(obj, key):
    hints = typing.get_type_hints(type(obj))
    kind = hints[key]
    args = typing.get_args(kind)
    optional = type(None) in args
    if optional:
        kind = next(a for a in args if a is not type(None))
    return kind, optional


def _set(obj, section, key, value, source, from_text=False):
    """Set ``obj.key`` (in ``[section]``) from a TOML value or, with ``from_text``, a string."""
    fields = _fields(obj)
    if key not in fields:
        valid = ", ".join(fields)
        close = _closest(key, fields)
        raise ConfigError(f"{source}: unknown key {section}.{key}; valid keys in [{section}]: {valid}",
                          hint=f"did you mean {section}.{close}?" if close else "remove it")
    kind, optional = _field_type(obj, key)
    setattr(obj, key, _convert(value, kind, optional, f"{section}.{key}", source, from_text))


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _convert(value, kind, optional, name, source, from_text):
    def bad(expected):
        return ConfigError(f"{source}: {name} = {value!r} is not {expected}",
                           hint=f"give {name} {expected}, e.g. {name}={_example(kind)}")

    if kind in (dict, list):
        return _convert_table(value, kind, name, source, from_text)
    if from_text:
        text = value.strip()
        if optional and text.lower() in ("", "none", "null"):
            return None
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise bad("a boolean (true or false)")
        if kind is int:
            try:
                return int(text)
            except ValueError:
                raise bad("an integer") from None
        if kind is float:
            try:
                return float(text)
            except ValueError:
                raise bad("a number") from None
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        return text
    if value is None and optional:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise bad("a boolean (true or false)")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if not isinstance(value, str):
        raise bad("a string")
    return value


def _example(kind):
    return {bool: "true", int: "10", float: "0.5", dict: "{width = 64}", list: '["src"]'}.get(kind, "name")


def parse_literal(text):
    """A ``key=value`` override's value for a keyword argument: a TOML literal (``64``, ``0.5``,
    ``true``, ``"text"``, ``[1, 2]``, ``{a = 1}``); anything that is not one is taken as a string.

    >>> parse_literal("1024"), parse_literal("[1, 2]"), parse_literal("gelu")
    (1024, [1, 2], 'gelu')
    """
    import tomllib

    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def _convert_table(value, kind, name, source, from_text):
    """``dict`` fields (keyword arguments: any TOML values) and ``list`` fields (of strings)."""
    if from_text:
        text = value.strip()
        if kind is list and not text.startswith("["):
            value = [part.strip() for part in text.split(",") if part.strip()]  # a,b,c
        else:
            value = parse_literal(text)
    if kind is dict and not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} = {value!r} is not a table of keyword arguments",
                          hint=f"write it as [{name}] with one key = value per line, or {name} = {{width = 64}}; "
                               f"one argument from the command line: {name}.width=64")
    if kind is list and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{source}: {name} = {value!r} is not a list of strings",
                          hint=f'e.g. {name} = ["src", "../shared"] (or {name}=src,../shared on the command line)')
    return dict(value) if kind is dict else list(value)


def _toml_value(value):
    """TOML text for a value of a ``dict``/``list`` field (inline tables and arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def apply_override(cfg, text, source="command line"):
    """Apply one ``section.key=value`` override (the value typed by the field)."""
    if "=" not in text:
        raise ConfigError(f"{source}: {text!r} is not a key=value override",
                          hint="write overrides as section.key=value, e.g. train.batch_size=32")
    dotted, value = text.split("=", 1)
    dotted = dotted.strip()
    if dotted.count(".") == 2:  # section.kwargs.name=value: one keyword argument of a factory
        return _apply_argument_override(cfg, dotted, value, source)
    if dotted.count(".") != 1:
        raise ConfigError(f"{source}: {dotted!r} is not a section.key name",
                          hint=f"valid sections: {', '.join(section_names())}; e.g. train.lr=0.1")
    section, key = dotted.split(".")
    _set(_section(cfg, section, source), section, key, value, source, from_text=True)
    return cfg


def _apply_argument_override(cfg, dotted, value, source):
    section, key, name = dotted.split(".")
    target = _section(cfg, section, source)
    if key not in _fields(target) or _field_type(target, key)[0] is not dict:
        tables = [f"{s}.{f}" for s in section_names() for f, _ in _fields(getattr(cfg, s)).items()
                  if _field_type(getattr(cfg, s), f)[0] is dict]
        raise ConfigError(f"{source}: {dotted!r}: {section}.{key} is not a table of keyword arguments",
                          hint=f"section.key=value for a setting; section.table.name=value only for "
                               f"{', '.join(tables)} (e.g. model.kwargs.width=1024)")
    if not name:
        raise ConfigError(f"{source}: {dotted!r} names no argument", hint=f"e.g. {section}.{key}.width=1024")
    getattr(target, key)[name] = parse_literal(value)
    return cfg


def _read_toml(path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package",
                              hint="pip install tomli") from None
    if str(path).endswith(".py"):
        raise ConfigError(f"{path} is a Python script, not a TOML configuration",
                          hint=f"run a training script as it is: mpirun -n 2 python {path} section.key=value ... "
                               f"(the job scripts in slurm/ take it in place of the TOML file)")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist",
                          hint="give the path of a TOML file, e.g. examples/digits.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}", hint="fix the line named above") from None


def load_config(path=None, overrides=(), environ=None):
    """Read a TOML file (or start from defaults), then apply environment variables
    (``HPCTRAIN_BACKEND``), then ``key=value`` overrides; each later source wins.

    >>> cfg = load_config("examples/digits.toml", ["train.batch_size=32", "comm.backend=mpi"])  # doctest: +SKIP
    """
    cfg = TrainConfig() if path is None else TrainConfig.from_dict(_read_toml(path), source=str(path))
    backend = settings.get("BACKEND", environ=environ)
    if backend:
        cfg.comm.backend = backend.strip()
    for text in overrides:
        apply_override(cfg, text)
    return cfg


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


def resolve_global_batch(global_batch, ranks, accumulation=1):
    """``(batch_size, accumulation, note)`` that make ``global_batch = batch_size x ranks x
    accumulation`` on ``ranks`` ranks: the smallest accumulation >= the configured one for which
    the global batch divides evenly, so that the same samples make each step on any number of
    ranks. ``note`` says what changed (``None`` when the accumulation is the configured one).
    Raises :class:`ConfigError` naming what to set when no accumulation fits (pure).

    >>> resolve_global_batch(48, 3, 1)
    (16, 1, None)
    >>> resolve_global_batch(64, 4, 3)[:2]
    (4, 4)
    """
    per_rank = global_batch // ranks
    chosen = None
    if global_batch % ranks == 0:
        chosen = next((a for a in range(accumulation, per_rank + 1) if per_rank % a == 0), None)
    if chosen is None:
        per_step = ranks * accumulation
        lower = max(per_step, global_batch // per_step * per_step)
        raise ConfigError(
            f"train.global_batch_size = {global_batch} is not divisible by ranks x accumulation = {ranks} x "
            f"{accumulation} = {per_step}, nor by {ranks} x any larger accumulation",
            hint=f"use a multiple of {per_step} (e.g. {lower} or {lower + per_step}), run on a number of ranks "
                 f"that divides it, or set the per-rank train.batch_size instead. A global batch divisible by "
                 f"every rank count a relaunch may use (e.g. 48 for 1 to 4 ranks) trains the same on each")
    note = None
    if chosen != accumulation:
        note = (f"train.accumulation {accumulation} -> {chosen}: the global batch {global_batch} over {ranks} "
                f"ranks is {per_rank} per rank, which {accumulation} micro-batches do not divide")
    return per_rank // chosen, chosen, note


def _check_auto_interval(k):
    """``[checkpoint]``: auto_interval needs a rule, and the rules need auto_interval."""
    if k.auto_interval and not (k.max_overhead or k.mtbf_hours):
        raise ConfigError("checkpoint.auto_interval = true, but neither checkpoint.max_overhead nor "
                          "checkpoint.mtbf_hours is set: no rule to choose the interval by",
                          hint="e.g. checkpoint.max_overhead=0.02 (2% of wall time) and/or "
                               "checkpoint.mtbf_hours=24 (the job's mean time between failures)")
    if not k.auto_interval:
        for name in ("max_overhead", "mtbf_hours"):
            if getattr(k, name):
                raise ConfigError(f"checkpoint.{name} = {getattr(k, name)!r} is only used with "
                                  f"checkpoint.auto_interval = true, which is false",
                                  hint=f"set checkpoint.auto_interval=true, or remove checkpoint.{name}")
    if k.max_overhead >= 0.5:
        raise ConfigError(f"checkpoint.max_overhead = {k.max_overhead!r} must be below 0.5 (a fraction of wall "
                          f"time, not a percentage)", hint="e.g. checkpoint.max_overhead=0.02 for 2%")


def _check_comm_mode(cfg, choice):
    """``comm.mode`` and the keys that only it uses (:mod:`hpctrain.training.comm_modes`)."""
    from .training.comm_modes import MODES, OUTER_OPTIMIZERS

    c = cfg.comm
    choice("comm.mode", c.mode, MODES)
    choice("comm.outer_optimizer", c.outer_optimizer, OUTER_OPTIMIZERS)
    if c.sync_every < 1:
        raise ConfigError(f"comm.sync_every = {c.sync_every!r} must be >= 1 (steps between parameter averages)",
                          hint="e.g. comm.sync_every=16; 1 averages after every step")
    if c.sync_warmup < 0:
        raise ConfigError(f"comm.sync_warmup = {c.sync_warmup!r} must be >= 0",
                          hint="e.g. comm.sync_warmup=100 (fully synchronous steps first), or 0")
    if c.mode != "local_sgd":
        for name, default in (("sync_every", 1), ("sync_warmup", 0), ("outer_optimizer", "none")):
            if getattr(c, name) != default:
                raise ConfigError(f"comm.{name} = {getattr(c, name)!r} is only used with comm.mode = \"local_sgd\", "
                                  f"but comm.mode = {c.mode!r}",
                                  hint=f"set comm.mode=local_sgd, or remove comm.{name}")
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
    t = cfg.train
    if t.precision == "fp16":
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


def validate(cfg, world_size=1, cuda=False, need_data=True):
    """Check values that no single field's type can; return a resolved copy.

    The copy has ``train.batch_size`` (per rank) derived from ``global_batch_size`` when that
    is set, with the accumulation raised where needed (:func:`resolve_global_batch`; ``cfg.notes``
    then says what changed). Raises :class:`ConfigError` naming the key, the value and the fix.
    """
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train))

    def choice(name, value, choices, hint=None):
        if value not in choices:
            close = _closest(value, choices)
            raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}",
                              hint=hint or (f"did you mean {name} = {close!r}?" if close
                                            else f"set {name} to one of {', '.join(choices)}"))

    def positive(name, value, zero_ok=False):
        if value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"{name} = {value!r} must be {'>= 0' if zero_ok else '> 0'}",
                              hint=f"set {name} to a {'non-negative' if zero_ok else 'positive'} value")

    _check_finite(cfg)
    t, c = cfg.train, cfg.comm
    choice("comm.backend", c.backend, BACKENDS)
    choice("comm.compression", c.compression, COMPRESSIONS)
    positive("comm.gradient_predivide_factor", c.gradient_predivide_factor)
    choice("train.optimizer", t.optimizer, OPTIMIZERS)
    choice("train.lr_scaling", t.lr_scaling, LR_SCALINGS)
    choice("train.precision", t.precision, PRECISIONS)
    if t.precision == "fp16" and not cuda:
        raise ConfigError("train.precision = \"fp16\" needs a GPU (a GradScaler on CUDA); this rank has none",
                          hint='use train.precision = "bf16" (mixed precision on CPU) or "fp32"')
    for name in ("batch_size", "accumulation", "epochs"):
        positive(f"train.{name}", getattr(t, name))
    positive("train.lr", t.lr)
    for name in ("max_steps", "global_batch_size", "momentum", "weight_decay", "warmup_steps",
                 "eval_every", "eval_batch_size", "step_timeout", "max_nonfinite_skips", "max_rollbacks"):
        positive(f"train.{name}", getattr(t, name), zero_ok=True)
    choice("train.on_nonfinite", t.on_nonfinite, ON_NONFINITE)
    if not 0 < t.rollback_lr_factor <= 1:
        raise ConfigError(f"train.rollback_lr_factor = {t.rollback_lr_factor!r} must be in (0, 1] (the learning "
                          f"rate is multiplied by it at each rollback)",
                          hint="e.g. train.rollback_lr_factor=0.5 (halve it), or 1 to keep it unchanged")
    data_ranks = _check_layout(cfg.parallel, world_size)  # the replicas: world_size when not split
    _check_shard(c, t)
    if t.global_batch_size:
        t.batch_size, t.accumulation, note = resolve_global_batch(t.global_batch_size, data_ranks, t.accumulation)
        if note:  # what was changed, for rank 0 to say (not a field: never written to config.toml)
            cfg.notes = (note,)
    from .models import NAMES as MODELS

    choice("model.name", cfg.model.name, MODELS)
    for name in ("in_features", "hidden", "depth", "num_classes"):
        positive(f"model.{name}", getattr(cfg.model, name))
    if not 0 <= cfg.model.dropout < 1:
        raise ConfigError(f"model.dropout = {cfg.model.dropout} must be in [0, 1)", hint="e.g. model.dropout=0.1")
    choice("data.generate", cfg.data.generate, GENERATORS)
    if need_data and not cfg.data.path and not cfg.data.factory:
        raise ConfigError("data.path is not set: no training data",
                          hint='set data.path = "data/digits.h5" (with data.generate = "digits" to create it), '
                               'or data.factory = "package.module:function" for your own data')
    if cfg.data.generate == "digits" and (cfg.model.in_features, cfg.model.num_classes) != (64, 10):
        raise ConfigError(f"data.generate = \"digits\" makes 64 features and 10 classes, but model.in_features = "
                          f"{cfg.model.in_features} and model.num_classes = {cfg.model.num_classes}",
                          hint="set model.in_features = 64 and model.num_classes = 10")
    positive("data.samples", cfg.data.samples)
    positive("data.val_samples", cfg.data.val_samples, zero_ok=True)
    m = cfg.monitor
    positive("monitor.log_every", m.log_every)
    choice("monitor.progress", m.progress, ("auto", "bar", "log", "off"))
    positive("monitor.slow_rank_window", m.slow_rank_window)
    for name in ("gather_every", "consistency_every", "slow_rank_min_seconds"):
        positive(f"monitor.{name}", getattr(m, name), zero_ok=True)
    if m.slow_rank_factor <= 1:
        raise ConfigError(f"monitor.slow_rank_factor = {m.slow_rank_factor} must be > 1 (a ratio to the median rank)",
                          hint="e.g. monitor.slow_rank_factor = 1.3")
    _check_comm_mode(cfg, choice)
    k = cfg.checkpoint
    choice("checkpoint.best_mode", k.best_mode, ("min", "max"))
    for name in ("every_steps", "every_minutes", "keep_last", "keep_best", "milestone_every", "max_overhead",
                 "mtbf_hours"):
        positive(f"checkpoint.{name}", getattr(k, name), zero_ok=True)
    _check_auto_interval(k)
    if not cfg.run.name or os.sep in cfg.run.name:
        raise ConfigError(f"run.name = {cfg.run.name!r} must be a non-empty name without {os.sep!r}",
                          hint='e.g. run.name = "digits"')
    from .factories import check_factories

    check_factories(cfg, need_data=need_data)  # the user's import paths and keyword arguments
    _check_split(cfg)
    return cfg


# ---------------------------------------------------------------- [parallel]
SCHEDULES = ("1f1b", "gpipe")
BALANCES = ("params", "time")


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
    for name, choices in (("schedule", SCHEDULES), ("balance", BALANCES)):
        value = getattr(p, name)
        if value not in choices:
            close = _closest(value, choices)
            raise ConfigError(f"parallel.{name} = {value!r} is not one of {', '.join(choices)}",
                              hint=f"did you mean parallel.{name} = {close!r}?" if close
                              else f"set parallel.{name} to one of {', '.join(choices)}")
    from .parallel.layout import Layout

    return Layout(p.stages, None, p.tensor).resolve(world_size).replicas


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


SHARD_MODES = ("none", "optimizer", "gradients")
SHARD_REDUCTIONS = ("auto", "allreduce", "reduce_scatter")


def _check_shard(c, t):
    """``comm.shard`` and ``train.clip_grad_norm``: the choices, and what sharding cannot do."""
    if c.shard not in SHARD_MODES:
        close = _closest(c.shard, SHARD_MODES)
        raise ConfigError(f"comm.shard = {c.shard!r} is not one of {', '.join(SHARD_MODES)}",
                          hint=f"did you mean comm.shard = {close!r}?" if close else
                          'comm.shard = "optimizer" (ZeRO stage 1), "gradients" (stage 2) or "none"')
    if c.shard_reduce not in SHARD_REDUCTIONS:
        close = _closest(c.shard_reduce, SHARD_REDUCTIONS)
        raise ConfigError(f"comm.shard_reduce = {c.shard_reduce!r} is not one of {', '.join(SHARD_REDUCTIONS)}",
                          hint=f"did you mean comm.shard_reduce = {close!r}?" if close else
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
