"""What the trainer does with a step whose averaged gradients are not finite.

After the all-reduce every rank holds the same averaged gradients (a NaN in one rank's
loss reaches all of them through the average), so one fused check gives the same verdict
everywhere without another collective. A bad step is never applied; then, as
``train.on_nonfinite`` says: ``skip`` it (up to ``max_nonfinite_skips`` in a row),
``rollback`` to the newest checkpoint with the learning rate times ``rollback_lr_factor``
(up to ``max_rollbacks``), or ``stop``; ``auto`` skips, then rolls back, then stops.
"""
from ..errors import HpctrainError


class NonFiniteError(HpctrainError):
    """Training stopped because the averaged gradients were not finite (``train.on_nonfinite``)."""

    exit_code = 5


# Kept in Progress.extra, so in every checkpoint: how often this run rolled back, and the
# learning-rate multiplier those rollbacks left.
ROLLBACKS, LR_FACTOR = "nonfinite_rollbacks", "lr_factor"


def grads_finite(optimizer):
    """True if every gradient is finite: one fused pass (``_foreach_norm``) and one host sync,
    right after the all-reduce wait. The same verdict on every rank: they hold the same
    averaged gradients. A sum of squares that overflows counts as non-finite too: such a
    step is blowing up anyway."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]).sum()))


def first_nonfinite(model):
    """``name (NaN)`` or ``name (inf)`` of the first parameter whose gradient is not finite."""
    import torch

    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return f"{name} ({'NaN' if bool(torch.isnan(p.grad).any()) else 'inf'})"
    return "none: every element is finite, but their norm overflows"


def stop_message(step, tensor, t, event):
    """Why training stopped at ``step`` (``t``: the ``[train]`` section)."""
    why = {"stop": "train.on_nonfinite = \"stop\"",
           "skip": f"{event['consecutive']} consecutive non-finite steps, more than train.max_nonfinite_skips "
                   f"= {t.max_nonfinite_skips}",
           "rollback": f"{event['rollbacks']} rollbacks already, train.max_rollbacks = {t.max_rollbacks}",
           "auto": f"{event['consecutive']} consecutive non-finite steps and {event['rollbacks']} rollbacks "
                   f"(train.max_rollbacks = {t.max_rollbacks})"}[t.on_nonfinite]
    if event.get("why"):
        why = event["why"]
    return (f"training stopped at step {step}: the averaged gradients are not finite; first non-finite "
            f"gradient: {tensor}; {why}. The update of step {step} was not applied")


def stop_hint(checkpoints):
    newest = getattr(checkpoints, "last_path", None)
    where = (f"; the newest checkpoint {newest} holds the last good state (a new job resumes from it "
             f"with checkpoint.resume=auto)" if newest else "")
    return "lower train.lr, add train.warmup_steps, or look for NaN/inf in the data" + where


def choose_action(t, skips, rollbacks, can_roll_back):
    """``"skip"``, ``"rollback"`` or ``"stop"`` for the ``skips``-th bad step in a row, after
    ``rollbacks`` rollbacks (``t``: the ``[train]`` section; pure)."""
    if t.on_nonfinite in ("auto", "skip") and skips <= t.max_nonfinite_skips:
        return "skip"
    if t.on_nonfinite in ("auto", "rollback") and can_roll_back and rollbacks < t.max_rollbacks:
        return "rollback"
    return "stop"
