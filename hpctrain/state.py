"""What a training run consists of at a step boundary: the object that checkpoints save
and restore, and that the trainer advances."""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class Progress:
    """Where the run is, the same on every rank. ``samples_in_epoch`` counts global samples of the current
    epoch already consumed, so a run can resume mid-epoch on a different number of ranks. Random numbers are
    re-seeded from ``(seed, step, rank)`` at every step, so no generator state is needed to resume."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    seed: int = 0
    best_metric: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainState:
    """The model (unwrapped ``nn.Module``), its optimizer, and the run's progress."""

    model: Any
    optimizer: Any
    progress: Progress = field(default_factory=Progress)
    scaler: Any = None  # torch.cuda.amp.GradScaler when fp16 autocast on GPU
    # The communication mode (``comm.mode``, hpctrain.training.comm_modes): its tensors
    # (local_sgd's outer momentum, stale's pending average) are saved and restored with the rest.
    comm_mode: Any = None
