"""The recipe switches of ``[train]`` that change how the model runs or when training ends:

* ``compile = true``: ``torch.compile`` of the model, in place (``nn.Module.compile``), so its parameter names
  and checkpoints stay the eager model's; where compiling fails, the run says so in one line and goes on eager.
* ``activation_checkpointing = true``: activations recomputed in the backward pass: the model's own
  ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before transformers 5) where it has one,
  else each top-level block (each child module; each member of a top-level ``ModuleList`` or ``Sequential``).
* ``early_stop_patience = N``: :class:`EarlyStop`, after N evaluations in a row that did not improve
  ``checkpoint.best_metric``; its count travels in the checkpoints, so a resumed run counts on.
"""
import functools
import math

EARLY_STOP = "early_stop"  # in Progress.extra: [best value, its step, evaluations since, the step last counted]


def compile_model(model):
    """``model`` compiled in place (its ``__call__``: the same object, the same ``state_dict`` names); a line to
    say. Where ``torch.compile`` cannot even start (no writable cache directory, ...) the model stays eager."""
    name = type(model).__name__
    try:
        model.compile()
    except Exception as exc:
        uncompile(model)
        return compile_failed(name, exc)
    return f"train.compile: {name} compiled with torch.compile (at its first step)"


def compile_failed(name, exc):
    """The one line that says a compilation failed and the run goes on eager."""
    why = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"train.compile: torch.compile of {name} failed ({type(exc).__name__}: {why}); training it eager"


def is_compiled(model):
    return getattr(model, "_compiled_call_impl", None) is not None


def uncompile(model):
    """Back to eager after ``torch.compile`` failed."""
    model._compiled_call_impl = None


def checkpoint_activations(model):
    """Recompute activations in the backward pass; a line saying how."""
    supported = getattr(model, "supports_gradient_checkpointing", True)
    for name, kwargs in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # transformers 5
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        enable = getattr(model, name, None)
        if callable(enable) and supported:
            enable(**{kwargs: {"use_reentrant": False}})
            return f"activation checkpointing: {type(model).__name__}'s own ({name})"
    blocks = list(_blocks(model))
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)
    return f"activation checkpointing: each of {len(blocks)} top-level blocks of {type(model).__name__} recomputed"


def _blocks(model):
    from torch import nn

    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            yield from (m for m in child if any(True for _ in m.parameters()))
        elif any(True for _ in child.parameters()):
            yield child


def _recomputed(forward, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():  # evaluation: nothing to keep or recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


class EarlyStop:
    """Counts evaluations that did not improve the metric; :meth:`update` says when the patience is spent."""

    def __init__(self, patience, metric, mode):
        self.patience, self.metric, self.mode = int(patience), metric, mode

    def update(self, progress, metrics):
        """After an evaluation: None, or the event that ends the run (a dict for the log and the report)."""
        value = metrics.get(self.metric)
        best, best_step, since, counted = progress.extra.get(EARLY_STOP, [None, None, 0, None])
        if counted == progress.step:  # evaluated twice at one step (eval_every at an epoch's end): counted once
            return None
        if value is not None and math.isfinite(value) and (
                best is None or (value < best if self.mode == "min" else value > best)):
            best, best_step, since = float(value), progress.step, 0
        else:
            since += 1
        progress.extra[EARLY_STOP] = [best, best_step, since, progress.step]
        if since < self.patience:
            return None
        return {"step": progress.step, "metric": self.metric, "best": best, "best_step": best_step,
                "evaluations": since, "patience": self.patience}
