"""The optimizer ``train.optimizer`` names (built in, or the user's function), which parameters weight decay
applies to (``train.weight_decay_on``), and the learning rate of each step (``train.lr_schedule``)."""
import math

from ..config.schema import is_import_path
from ..config.usercode import OPTIMIZER_CALL, resolve
from ..errors import ConfigError


def make_optimizer(model, t, lr):
    """The torch optimizer of ``[train]`` (``t``) over ``model``'s trainable parameters."""
    import torch

    if is_import_path(t.optimizer):
        return _users_optimizer(model, t, lr)
    params = decay_groups(model, t.weight_decay) if t.weight_decay_on == "matrices" else \
        [p for p in model.parameters() if p.requires_grad]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}.get(t.optimizer, torch.optim.AdamW)
    extra = {"momentum": t.momentum} if t.optimizer == "sgd" else {}
    return cls(params, lr=lr, weight_decay=t.weight_decay, **extra)


def decay_groups(model, weight_decay):
    """Two parameter groups: weights of 2 or more dimensions with ``weight_decay``; biases, norms (1-D) and
    embeddings (``nn.Embedding``, also when tied to an output layer) without. Empty groups are left out."""
    from torch import nn

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, plain = [], []
    for p in model.parameters():  # each parameter once, also a tied one
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else plain).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _users_optimizer(model, t, lr):
    import torch

    fn = resolve(t.optimizer, "train.optimizer")
    try:
        optimizer = fn(model, lr=lr, weight_decay=t.weight_decay)
    except Exception as exc:
        raise ConfigError(f"train.optimizer = {t.optimizer!r}, called as {OPTIMIZER_CALL}, raised "
                          f"{type(exc).__name__}: {exc}", hint="fix the function (it gets the model on its device)") \
            from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"train.optimizer = {t.optimizer!r} returned {type(optimizer).__name__}, not a torch "
                          f"optimizer", hint="return e.g. torch.optim.AdamW(groups, lr=lr)")
    for group in optimizer.param_groups:  # a group's own learning rate follows the schedule in proportion
        if group.get("lr", lr) != lr and lr:
            group.setdefault("lr_scale", group["lr"] / lr)
    known = {id(p) for p in model.parameters()}
    if any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError(f"train.optimizer = {t.optimizer!r} returned an optimizer over tensors that are not the "
                          f"model's parameters", hint="build its groups from model.parameters() or "
                                                      "model.named_parameters()")
    return optimizer


def learning_rate(t, base_lr, step, decay_steps):
    """The learning rate of the step after ``step`` steps: a linear warm-up over ``train.warmup_steps``, then
    ``train.lr_schedule`` (its floor ``base_lr x train.lr_min_ratio``, reached at ``decay_steps``). From the
    step alone, so a resume, a relaunch on other ranks and a rollback all continue it exactly.

    >>> from hpctrain.config.schema import LoopConfig
    >>> t = LoopConfig(warmup_steps=10, lr_schedule="cosine", lr_min_ratio=0.1)
    >>> [round(learning_rate(t, 1.0, s, 110), 3) for s in (0, 9, 10, 60, 110, 200)]
    [0.1, 1.0, 1.0, 0.55, 0.1, 0.1]
    """
    if t.warmup_steps and step < t.warmup_steps:
        return base_lr * ((step + 1) / t.warmup_steps)
    floor = base_lr * t.lr_min_ratio
    if t.lr_schedule == "constant":
        return base_lr
    if t.lr_schedule == "step":
        return max(floor, base_lr * t.lr_step_gamma ** ((step - t.warmup_steps) // t.lr_step_every))
    done = min(1.0, (step - t.warmup_steps) / max(1, decay_steps - t.warmup_steps))
    left = 0.5 * (1.0 + math.cos(math.pi * done)) if t.lr_schedule == "cosine" else 1.0 - done
    return floor + (base_lr - floor) * left


def set_lr(optimizer, lr):
    """Every group's learning rate: ``lr``, times the group's ``lr_scale`` where it has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr
    return lr
