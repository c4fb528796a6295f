"""When to save and what to keep: the pure rules (:func:`save_reason`, :func:`select_keep`), and
:class:`Retention`, which applies the second to a checkpoint directory after each save. How
often to save when hpctrain chooses: :mod:`.interval`."""
import logging
import math
import os

from ..errors import CheckpointError
from ..runtime import fsutil
from . import reader
from .directory import read_latest, scan

log = logging.getLogger("hpctrain.checkpoint")


def select_keep(checkpoints, keep_last=3, keep_best=0, best_mode="min", milestone_every=0):
    """Steps to keep among ``checkpoints`` = ``[(step, metric_or_None)]``.

    Keeps the newest ``keep_last`` (0: keep all), the ``keep_best`` best by metric
    (``best_mode`` "min" or "max"; newer wins ties; missing or NaN metrics never count),
    and every step divisible by ``milestone_every`` (0: off). The newest is always kept.
    """
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    steps = sorted({step for step, _ in checkpoints}, reverse=True)
    if not steps:
        return set()
    if keep_last <= 0:
        return set(steps)
    keep = set(steps[:keep_last]) | {steps[0]}
    if keep_best > 0:
        scored = [(metric, step) for step, metric in checkpoints
                  if metric is not None and not (isinstance(metric, float) and math.isnan(metric))]
        sign = 1 if best_mode == "min" else -1
        scored.sort(key=lambda ms: (sign * ms[0], -ms[1]))
        keep |= {step for _, step in scored[:keep_best]}
    if milestone_every > 0:
        keep |= {step for step in steps if step > 0 and step % milestone_every == 0}
    return keep


def save_reason(step, last_saved_step, seconds_since_save, every_steps=0, every_minutes=0.0,
                on_epoch_end=True, on_finish=True, epoch_end=False, final=False, requested=False,
                auto_due=False):
    """Why to save now (``"requested"``, ``"final"``, ``"epoch_end"``, ``"steps"``, ``"time"``,
    ``"auto"``: the interval hpctrain chose has passed) or None. Never twice for the same step."""
    if step == last_saved_step:
        return None
    if requested:
        return "requested"
    if final and on_finish:
        return "final"
    if epoch_end and on_epoch_end:
        return "epoch_end"
    if every_steps > 0 and step % every_steps == 0:
        return "steps"
    if every_minutes > 0 and seconds_since_save >= every_minutes * 60.0:
        return "time"
    if auto_due:
        return "auto"
    return None




class Retention:
    """What ``[checkpoint]`` keeps of ``directory`` (rank 0): the rules of :func:`select_keep`,
    with the metric of each checkpoint remembered from its save or read from its header once."""

    def __init__(self, directory, cfg):
        self.directory, self.cfg = directory, cfg
        self._metrics = {}

    def remember(self, name, metric):
        self._metrics[name] = metric

    def _metric_of(self, name):
        if name not in self._metrics:
            try:
                h = reader.read_header(os.path.join(self.directory, name))
                self._metrics[name] = h.metrics.get(self.cfg.best_metric)
            except CheckpointError:
                self._metrics[name] = None
        return self._metrics[name]

    def apply(self):
        """Delete what the rules no longer keep (never the file ``latest`` names)."""
        found = scan(self.directory)
        c = self.cfg
        need_metric = c.keep_best > 0
        keep = select_keep([(s, self._metric_of(n) if need_metric else None) for s, n in found],
                           c.keep_last, c.keep_best, c.best_mode, c.milestone_every)
        latest = read_latest(self.directory)
        for step, name in found:
            if step not in keep and name != latest:
                fsutil.remove_quietly(os.path.join(self.directory, name))
                self._metrics.pop(name, None)
                log.info("retention: removed %s", name)
