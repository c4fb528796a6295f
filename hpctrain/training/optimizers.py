"""The optimizer ``train.optimizer`` names (with ``lr``, ``momentum``, ``weight_decay``) and its warm-up."""


def make_optimizer(model, t, lr):
    """The torch optimizer of ``[train]`` (``t``) over ``model``'s trainable parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)


def set_lr(optimizer, base_lr, warmup_steps, step):
    """Linear warm-up, computed from the step alone (nothing to save for resume)."""
    lr = base_lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else base_lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
