"""The loss and evaluation metrics a configuration names: ``train.loss`` and ``train.metrics``, each a
``"package.module:function"`` (or, for the loss, a built-in name of :data:`hpctrain.config.schema.LOSSES`)."""
import inspect

from ..config.schema import LOSSES, MODEL_LOSS
from ..config.usercode import resolve
from ..errors import HpctrainError


def build_loss(name):
    """``loss(output, target)`` for ``train.loss``; a class (``torch.nn.HuberLoss``) gets no arguments; None
    for ``"model"``: the model computes its own (:func:`forward`)."""
    if name == MODEL_LOSS:
        return None
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


def forward(model, x, y, loss_fn):
    """``(output or None, loss or None)`` of one batch. With a ``loss_fn`` the model is called as ``model(x)``
    and the loss is the caller's to compute (it chooses the precision); with None (``train.loss = "model"``) as
    ``model(x, y)``, which returns a scalar loss, ``(output, loss)``, or an object with ``.loss`` (and
    ``.logits``)."""
    if loss_fn is not None:
        return model(x), None
    return _unpack(model(x, y))


def _unpack(result):
    import torch

    def scalar(value):
        return isinstance(value, torch.Tensor) and value.dim() == 0

    loss = getattr(result, "loss", None)  # a Hugging Face ModelOutput (also a tuple: look at .loss first)
    if scalar(loss):
        return getattr(result, "logits", None), loss
    if scalar(result):
        return None, result
    if isinstance(result, (tuple, list)) and len(result) == 2 and scalar(result[1]):
        return result[0], result[1]
    shape = f" of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else ""
    raise HpctrainError(f"train.loss = \"model\": model(x, y) returned {type(result).__name__}{shape}, not its loss",
                        hint="return a scalar loss, (output, loss), or an object with .loss (and .logits); or "
                             "name the loss instead (train.loss = \"cross_entropy\") and return the output")
