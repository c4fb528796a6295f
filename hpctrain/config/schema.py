"""The configuration's schema: one dataclass per TOML section ([run], [model], [data], [train], [comm],
[checkpoint], [monitor], [parallel]) and every choice a key takes (a value typed by :mod:`.values`). Every tuple
of choices lives here; the modules that act on a choice import it from here. Unknown sections and keys are
errors that list the valid ones.

>>> cfg = TrainConfig()
>>> cfg.train.batch_size = 64
"""
import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from .values import Switch, typed_value

# ---------------------------------------------------------------- the choices keys take
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCALINGS = ("none", "linear")
LR_SCHEDULES = ("constant", "cosine", "linear", "step")  # hpctrain.training.optimizers.learning_rate
DECAY_GROUPS = ("all", "matrices")  # train.weight_decay_on: every parameter, or 2-D+ weights but embeddings
PRECISIONS = ("fp32", "bf16", "fp16")
ON_NONFINITE = ("auto", "skip", "rollback", "stop")
GENERATORS = ("none", "digits", "teacher")
DATA_KINDS = ("hdf5", "tokens")  # [data] kind: (x, y) sample files, or one token stream (hpctrain.data.tokens)
TOKEN_DTYPES = ("uint16", "uint32")  # data.dtype of a raw .bin token file
TOKEN_FORMATS = (".bin", ".npy", ".h5", ".hdf5")  # token files by suffix: raw, NumPy, HDF5
MODELS = ("mlp", "transformer")  # hpctrain.models
# loss(output, target) -> scalar, named without an import path (hpctrain.training.losses)
LOSSES = ("cross_entropy", "mse", "l1", "smooth_l1", "bce_with_logits")
MODEL_LOSS = "model"  # train.loss: the model computes its own, model(x, y) (hpctrain.training.losses)
BACKENDS = ("horovod", "mpi")  # hpctrain.backends
COMPRESSIONS = ("none", "fp16")  # hpctrain.backends.compression
COMM_MODES = ("sync", "local_sgd", "stale")  # hpctrain.training.comm_modes
OUTER_OPTIMIZERS = ("none", "nesterov")
SHARD_MODES = ("none", "optimizer", "gradients")  # hpctrain.training.sharding
SHARD_REDUCTIONS = ("auto", "allreduce", "reduce_scatter")
SCHEDULES = ("1f1b", "gpipe")  # hpctrain.parallel.pipeline
BALANCES = ("params", "time")
PROGRESS = ("auto", "bar", "log", "off")
BEST_MODES = ("min", "max")
CONSISTENCY = ("check", "repair", "off")


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
    # The node-local level (docs/checkpoint-format.md, "Node-local checkpoints"): snapshots into storage on
    # each node, with a copy on the next node, between the HDF5 checkpoints; resume takes the newer. "auto": on
    # where they fit in half of local_dir's free space (and the model is not split); true: on, or an error.
    local: Switch = "auto"
    local_every_steps: int = 0  # steps between snapshots; 0: chosen from their cost (auto_interval's budget, else 1%)
    local_dir: str = "/dev/shm"  # RAM-backed by default; a local disk's path works too
    # The file's layout and MPI-IO (docs/checkpoint-format.md, "Aligned layout"): large datasets and each rank's
    # part of them start on a multiple of `alignment` bytes (0: the file system's stripe or block size where it
    # reports one, else 1 MiB; 1: none); `io_hints`, e.g. {striping_factor = 16, cb_nodes = 8}, go to MPI-IO
    # over the defaults chosen for the file system. `direct_io`: on ext4 and XFS each rank writes and re-reads its
    # parts with O_DIRECT, past the page cache (docs/performance.md, "Direct writes": faster in a fresh process,
    # slower in one that has its memory at hand).
    alignment: int = 0
    io_hints: dict = field(default_factory=dict)
    direct_io: bool = False


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
    # Your own model instead (hpctrain/config/usercode.py): "package.module:function" returning an
    # nn.Module, called with the keyword arguments of [model.kwargs]; the fields above are then unused.
    factory: str = ""
    kwargs: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    """``[data]``: an HDF5 file with a training and (optionally) a validation split, or (``kind = "tokens"``)
    a token stream read in windows (docs/data.md)."""

    # "hdf5": samples x[i] and labels y[i] in ``path``; "tokens": ``path`` is one long 1-D token stream
    # (.bin, .npy or a 1-D HDF5 dataset), each sample a window of block_size + 1 tokens (x, then y shifted by one)
    kind: str = "hdf5"
    path: Optional[str] = None  # HDF5 file; with kind "tokens": the training token file
    train: str = "train"  # group holding the training split ("" = the file's root)
    val: str = "val"  # group holding the validation split; "none" for no evaluation
    x: str = "x"  # dataset names inside each group
    y: str = "y"
    generate: str = "none"  # create ``path`` on rank 0 if missing: "digits", "teacher" or "none"
    samples: int = 65536  # teacher corpus: training samples
    val_samples: int = 4096  # teacher corpus: validation samples
    # kind "tokens" only: tokens per sample (the model's context length); windows start every stride tokens
    block_size: int = 0  # required with kind "tokens"
    stride: int = 0  # 0: block_size (windows that do not overlap)
    dtype: str = "uint16"  # of a raw .bin file ("uint16" or "uint32"); .npy and HDF5 files carry their own
    val_path: Optional[str] = None  # the validation token file; not set: no evaluation
    token_dataset: str = "tokens"  # HDF5 token files: the name of the 1-D dataset in path and val_path
    # Your own data instead: "package.module:function" returning (train, val) datasets, or one
    # (no evaluation); called with [data.kwargs], on rank 0 first, then on the other ranks.
    factory: str = ""
    kwargs: dict = field(default_factory=dict)
    # How samples of a map-style dataset become a batch (hpctrain/data/batches.py): pairs (x, y) stacked,
    # dicts stacked key by key; or "package.module:function" called with the list of samples (a padding collator)
    collate: str = ""
    # Processes per rank that read and collate the next batches while the step computes (torch's DataLoader
    # workers; hpctrain/data/loading.py); 0: read in the training process, between steps
    workers: int = 0
    prefetch: int = 2  # batches each worker reads ahead


@dataclass
class LoopConfig:
    """``[train]``: the training loop."""

    # The budget: whichever of the two ends first; with neither set, one epoch. max_steps alone trains
    # that many optimizer steps (epochs follow from it), epochs alone that many passes over the data.
    epochs: int = 0
    max_steps: int = 0
    batch_size: int = 32  # per rank and backward pass
    global_batch_size: int = 0  # if set: batch_size = global_batch_size / (ranks x accumulation)
    accumulation: int = 1  # backward passes per optimizer step
    lr: float = 0.1
    # sgd, adam, adamw, or "package.module:function" called as function(model, lr=..., weight_decay=...) and
    # returning a torch optimizer (its parameter groups are its own)
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_scaling: str = "none"  # "linear": lr x ranks
    warmup_steps: int = 0  # linear warm-up from lr/warmup_steps to lr
    # After the warm-up: "constant"; "cosine" or "linear" down to lr x lr_min_ratio at step lr_decay_steps
    # (0: the run's step budget, train.max_steps or epochs x steps per epoch); "step": x lr_step_gamma every
    # lr_step_every steps (not below lr x lr_min_ratio). From the step alone: a resume continues it exactly.
    lr_schedule: str = "constant"
    lr_decay_steps: int = 0
    lr_min_ratio: float = 0.0  # e.g. 0.1, as nanoGPT's min_lr = lr / 10
    lr_step_every: int = 0
    lr_step_gamma: float = 0.1
    # "all": weight_decay on every parameter; "matrices": only on 2-D and larger weights, not on biases,
    # norms (1-D) and embeddings (torch.nn.Embedding), the usual recipe for transformers
    weight_decay_on: str = "all"
    precision: str = "fp32"  # fp32, bf16 (CPU or GPU), fp16 (GPU only, with a GradScaler)
    eval_every: int = 0  # steps between evaluations; 0: at the end of each epoch only
    eval_batch_size: int = 0  # 0: batch_size
    step_timeout: float = 0.0  # seconds; a longer step aborts the job (0: HPCTRAIN_WATCHDOG_TIMEOUT, else off)
    # A step whose averaged gradients hold NaN or infinity is never applied. Then: "auto" (default, for
    # unattended jobs): skip the update; after max_nonfinite_skips skips in a row, roll back to the newest
    # checkpoint with the learning rate x rollback_lr_factor; after max_rollbacks rollbacks (or with no
    # checkpoint), stop with an error naming the step and the first non-finite gradient. "skip": skip; stop
    # after max_nonfinite_skips in a row. "rollback": roll back at once (then as "auto"). "stop": stop at the
    # first one. With fp16 the GradScaler skips such steps itself (and lowers its scale); nothing more.
    on_nonfinite: str = "auto"
    max_nonfinite_skips: int = 3  # consecutive skipped steps tolerated
    max_rollbacks: int = 2  # rollbacks per run (counted across resumes) before stopping
    rollback_lr_factor: float = 0.5  # learning-rate multiplier per rollback, kept across resumes; 1: unchanged
    # loss(output, target) -> scalar: a built-in name (LOSSES above) or "package.module:function"; "model":
    # the model computes it, called as model(x, y) and returning a scalar loss, (output, loss) as nanoGPT's
    # GPT does, or an object with .loss (and .logits) as Hugging Face models do
    loss: str = "cross_entropy"
    # evaluation metrics besides val_loss: "package.module:function" (output, target) -> {name: (sum, count)}
    metrics: str = ""
    clip_grad_norm: float = 0.0  # clip the averaged gradients to this global L2 norm; 0: off
    compile: bool = False  # torch.compile the model (its checkpoints stay those of the eager model)
    # Stop after this many evaluations in a row without improving checkpoint.best_metric; 0: off
    early_stop_patience: int = 0
    # Recompute activations in the backward pass instead of keeping them: the model's own
    # gradient_checkpointing_enable() where it has one (Hugging Face models), else each top-level block
    activation_checkpointing: bool = False


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
    """``[parallel]``: split the model over ranks (docs/parallelism.md); each replica is ``stages x tensor``
    ranks. With ``stages = tensor = 1`` (the default) training is data-parallel and nothing here is used. In a
    split run ``train.batch_size`` is per replica (one pipeline pass, cut into ``micro_batches``)."""

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
            target = section_of(cfg, section, source)
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table of keys, found {values!r}",
                                  hint=f"write it as\n[{section}]\nkey = value")
            for key, value in values.items():
                set_field(target, section, key, value, source)
        return cfg

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_toml(self):
        """TOML text that :func:`load_config` reads back to an equal configuration."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"# {key} = (not set)" if value is None else f"{key} = {_toml_value(value)}"
                      for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)


def is_import_path(value):
    """True when a key's value names the user's code (``"package.module:function"``) rather than a built-in
    choice (``train.optimizer``, ``train.loss``)."""
    return ":" in value


def section_names():
    return [f.name for f in dataclasses.fields(TrainConfig)]


def closest(name, choices):
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return close[0] if close else None


def section_of(cfg, section, source):
    names = section_names()
    if section not in names:
        close = closest(section, names)
        raise ConfigError(f"{source}: unknown section [{section}]; valid sections: {', '.join(names)}",
                          hint=f"did you mean [{close}]?" if close else "remove it")
    return getattr(cfg, section)


def fields_of(obj):
    return {f.name: f for f in dataclasses.fields(obj)}


def field_type(obj, key):
    kind = typing.get_type_hints(type(obj))[key]
    args = typing.get_args(kind)
    optional = type(None) in args
    if optional:
        kind = next(a for a in args if a is not type(None))
    return kind, optional


def set_field(obj, section, key, value, source, from_text=False):
    """Set ``obj.key`` (in ``[section]``) from a TOML value or, with ``from_text``, a string."""
    fields = fields_of(obj)
    if key not in fields:
        close = closest(key, fields)
        raise ConfigError(f"{source}: unknown key {section}.{key}; valid keys in [{section}]: {', '.join(fields)}",
                          hint=f"did you mean {section}.{close}?" if close else "remove it")
    kind, optional = field_type(obj, key)
    setattr(obj, key, typed_value(value, kind, optional, f"{section}.{key}", source, from_text))


def _toml_value(value):
    """TOML text for a value (``dict``/``list`` fields as inline tables and arrays)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))

