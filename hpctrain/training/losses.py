"""The loss and evaluation metrics a configuration names: ``train.loss`` and ``train.metrics``, each a
``"package.module:function"`` (or, for the loss, a built-in name of :data:`hpctrain.config.schema.LOSSES`)."""
import inspect

from ..config.schema import LOSSES
from ..config.usercode import resolve


def build_loss(name):
    """``loss(output, target)`` for ``train.loss``; a class (``torch.nn.HuberLoss``) gets no arguments."""
    if name in LOSSES:
        return _builtin_loss(name)
    fn = resolve(name, "train.loss")
    return fn() if inspect.isclass(fn) else fn


def build_metrics(spec):
    """``metrics(output, target) -> {name: (sum, count)}`` for ``train.metrics``, or None."""
    return resolve(spec, "train.metrics") if spec else None


def _builtin_loss(name):
    import torch.nn.functional as F

    if name == "cross_entropy":
        def cross_entropy(output, target):
            # per-token logits (B, T, C) with targets (B, T): the mean over all tokens
            if output.dim() > 2 and target.dim() == output.dim() - 1 and not target.dtype.is_floating_point:
                return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
            return F.cross_entropy(output, target)
        return cross_entropy
    return {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss,
            "bce_with_logits": F.binary_cross_entropy_with_logits}[name]
