"""What an evaluation measures, batch by batch, and how the ranks' parts add up.

Every score is a pair ``(sum, count)`` summed over batches and then over ranks, in rank
order (exact: no mean of means), and reported as ``val_<name> = sum / count``:

* ``loss``: the loss of each batch times its number of samples; always.
* ``accuracy``: only where it means something: logits ``(B, C)`` with integer targets ``(B,)`` (correct
  samples), or per-token logits ``(B, T, C)`` with integer targets ``(B, T)`` (correct tokens).
* the ``train.metrics`` function's, ``metrics(output, target) -> {name: (sum, count)}``; a plain
  number instead of a pair is taken as the batch's mean over its ``len(target)`` samples.

>>> totals = {}
>>> add(totals, {"loss": (2.0, 4), "accuracy": (3.0, 4)})
>>> add(totals, {"loss": (1.0, 2), "accuracy": (1.0, 2)})
>>> means(combine([totals]))
{'val_loss': 0.5, 'val_accuracy': 0.6666666666666666}
"""
import math

from ..data.batches import IGNORE
from ..errors import HpctrainError


def score_batch(output, target, loss_fn, metrics_fn=None, loss=None, samples=None):
    """``{name: (sum, count)}`` of one batch (output in fp32) of ``samples`` samples (default: ``len(target)``):
    its ``loss`` where the model computed it (``output`` may then be None), else ``loss_fn``'s. Target
    positions of -100 (not scored, as in torch's ``cross_entropy``) count for no accuracy."""
    n = samples if samples is not None else len(target)
    scores = {"loss": (float(loss if loss is not None else loss_fn(output, target)) * n, n)}
    if output is None:
        if metrics_fn is not None:
            raise HpctrainError("train.metrics needs the model's output, but model(x, y) returned only its loss",
                                hint="return (output, loss) or an object with .logits, or leave train.metrics unset")
        return scores
    if target is not None and hasattr(target, "dtype") and not target.dtype.is_floating_point:
        scored = target != IGNORE
        dims = (output.dim(), target.dim())
        if dims == (2, 1) or dims == (3, 2) and output.shape[:2] == target.shape:
            scores["accuracy"] = (float(((output.argmax(dim=-1) == target) & scored).sum()), int(scored.sum()))
    if metrics_fn is not None:
        scores.update(_user_scores(metrics_fn(output, target), n))
    return scores


def _user_scores(result, n):
    if not isinstance(result, dict):
        raise TypeError(f"train.metrics returned {type(result).__name__}, not a dict of name -> (sum, count)")
    # a pair: (sum, count); a plain number: a mean over the batch's samples
    return {str(name): (float(v[0]), float(v[1])) if isinstance(v, (tuple, list)) and len(v) == 2 else (float(v) * n, n)
            for name, v in result.items()}


def add(totals, scores):
    """Add one batch's scores to running ``totals`` (in place)."""
    for name, (s, c) in scores.items():
        ts, tc = totals.get(name, (0.0, 0))
        totals[name] = (ts + s, tc + c)


def combine(per_rank):
    """The totals of every rank (a list in rank order, as ``comm.allgather`` gives) added up."""
    totals = {}
    for part in per_rank:
        add(totals, part)
    return totals


def means(totals):
    """``{"val_<name>": sum / count}``; loss first, then accuracy, then the rest by name."""
    order = sorted(totals, key=lambda k: ({"loss": 0, "accuracy": 1}.get(k, 2), k))
    return {f"val_{name}": (totals[name][0] / totals[name][1] if totals[name][1] else math.nan) for name in order}


def evaluate(run):
    """Collective: each rank scores its part (``run.steps``); the means go to ``run.metrics``, ``on_eval``."""
    from ..job.watchdog import watching

    t = run.cfg.train
    with watching(f"evaluation at step {run.state.progress.step}"):
        totals = run.steps.eval_totals(run, t.eval_batch_size or t.batch_size)
        # Sums, not means: ranks may hold different numbers of samples; in rank order, so every rank agrees.
        run.metrics = means(combine(run.world.comm.allgather(totals)))
        run.evaluated_at = run.state.progress.step
        run.tell("on_eval", run.state, run.metrics)
    return run.metrics
