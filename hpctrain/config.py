"""Configuration as dataclasses, validated once, before any collective.

(The training sections are filled in by the training module's owner; the checkpoint and
monitor sections are fixed here so that those modules can rely on them.)
"""
from dataclasses import dataclass
from typing import Optional


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
