"""Configuration: the schema of every section and choice (:mod:`.schema`), how a value is typed
(:mod:`.values`), reading it from TOML, the environment and ``key=value`` overrides (:mod:`.loading`), the one
validation of choices and ranges (:mod:`.validation`), the arithmetic of batches, replicas and step budgets
(:mod:`.budget`), and the user's code named by import path (:mod:`.usercode`).

>>> cfg = load_config("examples/digits.toml", ["train.batch_size=32", "comm.compression=fp16"])  # doctest: +SKIP
>>> cfg = validate(cfg, world_size=2)                                                               # doctest: +SKIP
"""
from .budget import replicas_of, resolve_global_batch, step_budget
from .loading import apply_override, load_config
from .schema import (CheckpointConfig, CommConfig, DataConfig, LoopConfig, ModelConfig, MonitorConfig,
                     ParallelConfig, RunConfig, TrainConfig, section_names)
from .validation import check_choice, is_split, validate
from .values import parse_literal

__all__ = ["CheckpointConfig", "CommConfig", "DataConfig", "LoopConfig", "ModelConfig", "MonitorConfig",
           "ParallelConfig", "RunConfig", "TrainConfig", "apply_override", "check_choice", "is_split",
           "load_config", "parse_literal", "replicas_of", "resolve_global_batch", "section_names",
           "step_budget", "validate"]
