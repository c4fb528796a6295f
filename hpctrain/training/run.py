"""One call of :meth:`hpctrain.Trainer.fit`: what set-up built (:mod:`.setup`) and what the loop
carries from step to step; why an epoch of training returned; how the callbacks are told."""
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

EPOCH_END, MAX_STEPS, STOP_REQUESTED, ROLLED_BACK = "epoch_end", "max_steps", "stop_requested", "rolled_back"
EARLY_STOPPED = "early_stopped"  # train.early_stop_patience evaluations without improving


@dataclass
class Run:
    world: Any
    cfg: Any  # the validated TrainConfig
    steps: Any  # how a step runs (hpctrain.training.steps): the backend, the model's split, ...
    run_dir: str
    train: Any
    val: Any
    sampler: Any
    state: Any  # hpctrain.state.TrainState
    checkpoints: Any
    callbacks: list
    timer: Any  # hpctrain.monitoring.timing.PhaseTimer
    watchdog: Any
    loss_fn: Any
    base_lr: float
    metrics_fn: Any = None  # train.metrics: (output, target) -> {name: (sum, count)}
    budget: tuple = (1, 0, "")  # (epochs or None, steps, what ends the run): config.step_budget
    decay_steps: int = 0  # where train.lr_schedule reaches its floor (setup._decay_steps)
    last_loss: Optional[float] = None  # this rank's, of the last step
    skips: int = 0  # consecutive steps whose non-finite gradients were not applied
    metrics: Dict[str, float] = field(default_factory=dict)  # of the last evaluation
    evaluated_at: Optional[int] = None  # the step of the last evaluation
    early_stop: Any = None  # train.early_stop_patience: hpctrain.training.recipes.EarlyStop
    stop_early: Any = None  # the event of the evaluation that spent the patience
    # Held while a step's update and its count change the state: a survivor's save (hpctrain.job.survivor) waits
    settling: Any = field(default_factory=threading.Lock)

    @property
    def backend(self):
        return self.steps.backend

    def log(self, text):
        """A line of the run's own output, on rank 0."""
        if self.world.is_root:
            print(f"hpctrain: {text}", flush=True)

    def tell(self, name, *args):
        """Call ``name`` (``on_step``, ``on_eval``, ...) of every callback that has it."""
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(*args)
