"""What the trainer does with a step whose averaged gradients are not finite.

After the all-reduce all ranks hold the same averaged gradients (one rank's NaN reaches all), so one fused
check, no other collective, gives one verdict. A bad step is never applied; then, per ``train.on_nonfinite``:
``skip`` it (up to ``max_nonfinite_skips`` in a row), ``rollback`` to the newest checkpoint with the lr times
``rollback_lr_factor`` (up to ``max_rollbacks``), or ``stop``; ``auto`` skips, then rolls back, then stops.
"""
from ..errors import EXIT_DIVERGED, HpctrainError
from ..job.watchdog import watching
from ..runtime.coordination import everywhere
from .run import ROLLED_BACK


class NonFiniteError(HpctrainError):
    """Training stopped because the averaged gradients were not finite (``train.on_nonfinite``)."""

    exit_code = EXIT_DIVERGED


# Kept in Progress.extra, so in every checkpoint: how often this run rolled back, and the lr factor it left.
ROLLBACKS, LR_FACTOR = "nonfinite_rollbacks", "lr_factor"


def grads_finite(optimizer):
    """True if every gradient is finite: one fused pass (``_foreach_norm``) and one host sync, just after the
    all-reduce wait. An overflowing sum of squares counts as non-finite too: the step is blowing up anyway."""
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
    why = event.get("why") or why
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


def handle(run, tensor):
    """Skip, roll back (returns ROLLED_BACK) or raise :class:`NonFiniteError`, as ``train.on_nonfinite`` says:
    the step just taken had non-finite averaged gradients (the first: ``tensor``) and was not applied."""
    t, progress = run.cfg.train, run.state.progress
    step = progress.step + 1
    run.skips += 1
    rollbacks = progress.extra.get(ROLLBACKS, 0)
    policy = t.on_nonfinite
    can_roll_back = hasattr(run.checkpoints, "load_latest")
    action = choose_action(t, run.skips, rollbacks, can_roll_back)
    event = {"step": step, "action": action, "tensor": tensor, "policy": policy,
             "consecutive": run.skips, "rollbacks": rollbacks}
    if action == "rollback":
        factor = progress.extra.get(LR_FACTOR, 1.0) * t.rollback_lr_factor
        with watching(f"rollback to the newest checkpoint after step {step}"):
            path = run.checkpoints.load_latest(run.state)
        if path is not None:
            progress = run.state.progress
            # The run's own history, not the checkpoint's: kept across later resumes.
            progress.extra.update({ROLLBACKS: rollbacks + 1, LR_FACTOR: factor})
            run.sampler.seed = progress.seed
            run.skips, run.evaluated_at = 0, None
            event.update(rollbacks=rollbacks + 1, to_step=progress.step, lr_factor=factor, path=path)
            _tell(run, event)
            return ROLLED_BACK
        action = event["action"] = "stop"
        event["why"] = "no checkpoint of this run to roll back to"
    elif action == "stop" and policy in ("auto", "rollback") and not can_roll_back \
            and rollbacks < t.max_rollbacks and (policy == "rollback" or run.skips > t.max_nonfinite_skips):
        event["why"] = "no checkpoints to roll back to (the trainer's checkpoints have no load_latest)"
    _tell(run, event)
    if action == "skip":
        return None
    raise everywhere(NonFiniteError(stop_message(step, tensor, t, event), hint=stop_hint(run.checkpoints)))


def _tell(run, event):
    with watching(f"callbacks (non-finite step {event['step']})"):
        run.tell("on_nonfinite", run.state, dict(event))
