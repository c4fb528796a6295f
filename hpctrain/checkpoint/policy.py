"""When to save and what to keep: the pure rules (:func:`save_reason`; :func:`select_keep`, which
:class:`~.commit.Retention` applies after each save). How often when hpctrain chooses: :mod:`.interval`."""
import math


def select_keep(checkpoints, keep_last=3, keep_best=0, best_mode="min", milestone_every=0):
    """Steps to keep among ``checkpoints`` = ``[(step, metric_or_None)]``: the newest ``keep_last`` (0: keep
    all), the ``keep_best`` best by metric (``best_mode`` "min" or "max"; newer wins ties; missing or NaN
    metrics never count), and every step divisible by ``milestone_every`` (0: off); always the newest."""
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    steps = sorted({step for step, _ in checkpoints}, reverse=True)
    if not steps or keep_last <= 0:
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
    reasons = (("requested", requested), ("final", final and on_finish), ("epoch_end", epoch_end and on_epoch_end),
               ("steps", every_steps > 0 and step % every_steps == 0),
               ("time", every_minutes > 0 and seconds_since_save >= every_minutes * 60.0), ("auto", auto_due))
    return next((reason for reason, due in reasons if due), None)
