"""The loss and evaluation metrics a configuration names: ``train.loss`` and ``train.metrics``, each a
``"package.module:function"`` (or, for the loss, a built-in name of :data:`hpctrain.config.schema.LOSSES`),
and how a batch goes through the model (:func:`forward`): pairs or dicts, plain modules or Hugging Face ones."""
import inspect
from typing import Any, NamedTuple

from ..config.schema import LOSSES, MODEL_LOSS
from ..config.usercode import resolve
from ..data.batches import IGNORE, LABELS, samples_in
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


class Outcome(NamedTuple):
    """What one forward pass of a batch gave."""

    output: Any  # the logits (or other output) to score, or None where the model returned only its loss
    loss: Any  # the model's own loss (train.loss = "model"), else None: the caller's loss_fn computes it
    target: Any  # what ``output`` is scored against, position by position (-100: a position not scored)
    samples: int


def forward(model, batch, loss_fn):
    """One batch through ``model``. With a ``loss_fn`` the model is called for its output (a Hugging Face
    ``ModelOutput`` gives its ``.logits``) and the loss is the caller's to compute (it chooses the precision);
    with None (``train.loss = "model"``) the model computes it: ``model(input_ids=x, labels=y)`` where its forward
    takes those keywords, else ``model(x, y)``, returning a scalar loss, ``(output, loss)``, or an object with
    ``.loss`` (and ``.logits``). A dict batch is passed as ``model(**batch)``. A causal LM that shifts its
    labels itself is given labels it can shift, so a token stream's next-token targets are never shifted twice."""
    how = calling(model)
    if isinstance(batch, dict):
        return _forward_dict(model, how, batch, loss_fn)
    x, y = batch
    if loss_fn is not None:
        return Outcome(_output_of(model(x), how), None, y, len(y))
    if how.keywords:
        kwargs = {"input_ids": x, "labels": y}
        if how.shifts_labels and y.shape == x.shape:  # y is x shifted by one already (a token stream)
            kwargs.update(labels=x, shift_labels=y.contiguous())
        output, loss = _unpack(model(**kwargs), how)
    else:
        if not how.takes_target:
            raise _no_target(how)
        output, loss = _unpack(model(x, y), how)
    return Outcome(output, loss, y, len(y))


def _forward_dict(model, how, batch, loss_fn):
    unknown = [k for k in batch if k not in how.parameters] if (how.strict or not how.var_keyword) else []
    if unknown:
        raise HpctrainError(f"the batch has key(s) {', '.join(map(repr, unknown))} that {how.name}.forward does not "
                            f"take (it takes {', '.join(how.parameters) or 'nothing by name'})",
                            hint="drop those columns from the dataset (Hugging Face datasets: "
                                 "dataset.remove_columns([...])) or rename them to the model's argument names")
    labels = batch.get(LABELS)
    samples = samples_in(batch)
    if loss_fn is not None:
        if labels is None:
            raise HpctrainError(f"train.loss = a built-in loss needs targets, but the batch has no {LABELS!r} key "
                                f"(it has {', '.join(map(repr, batch))})",
                                hint=f"put the targets under {LABELS!r}, or let the model compute its loss: "
                                     f'train.loss = "model"')
        inputs = {k: v for k, v in batch.items() if k != LABELS}
        return Outcome(_output_of(model(**inputs), how), None, _aligned(labels, how), samples)
    if labels is None and not how.var_keyword:
        raise HpctrainError(f"train.loss = \"model\": the batch has no {LABELS!r} key, so {how.name} computes no loss",
                            hint=f"give each sample its targets under {LABELS!r}, or name the loss "
                                 f'(train.loss = "cross_entropy")')
    output, loss = _unpack(model(**batch), how)
    return Outcome(output, loss, None if labels is None else _aligned(labels, how), samples)


def _aligned(labels, how):
    """Labels position by position with the logits: a causal LM's labels are its inputs, which it shifts
    itself; the last position has no next token (-100, not scored)."""
    if not how.shifts_labels or labels.dim() < 2:
        return labels
    import torch

    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


class Calling(NamedTuple):
    """How a model's forward is called, read once from its signature."""

    name: str
    parameters: tuple  # named parameters (not self, not *args/**kwargs)
    var_keyword: bool  # takes **kwargs
    takes_target: bool  # model(x, y) is a valid call
    keywords: bool  # Hugging Face style: input_ids= and labels=
    shifts_labels: bool  # a Hugging Face causal LM: it shifts labels itself
    strict: bool  # its **kwargs take no batch keys (a Hugging Face model's are for attention and loss options)


_CALLING = {}


def calling(model):
    """The :class:`Calling` of ``model`` (the module under ``torch.compile``'s wrapper)."""
    inner = getattr(model, "_orig_mod", model)
    # a module is read once per class; a plain function (a model may be any callable) each time
    cls = type(inner) if hasattr(inner, "forward") else inner
    if cls not in _CALLING:
        from ..models.huggingface import is_causal_lm, is_transformers_model

        try:
            params = inspect.signature(getattr(inner, "forward", inner)).parameters.values()
        except (TypeError, ValueError):
            params = ()
        kinds = inspect.Parameter
        named = tuple(p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY))
        positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        var_keyword = any(p.kind == kinds.VAR_KEYWORD for p in params)
        takes_target = len(positional) >= 2 or any(p.kind == kinds.VAR_POSITIONAL for p in params)
        _CALLING[cls] = Calling(getattr(cls, "__name__", type(inner).__name__), named, var_keyword, takes_target,
                                keywords="input_ids" in named and "labels" in named, shifts_labels=is_causal_lm(inner),
                                strict=is_transformers_model(inner))
    return _CALLING[cls]


def _no_target(how):
    return HpctrainError(f"train.loss = \"model\", but {how.name}.forward takes no targets "
                         f"(its parameters: {', '.join(how.parameters) or 'none'})",
                         hint="make forward(x, targets) return the loss (or (output, loss)), or name the loss: "
                              'train.loss = "cross_entropy" (or "mse", ...)')


def _output_of(result, how):
    """The output to compute a loss on: a tensor as it is, a ``ModelOutput``'s ``.logits``."""
    import torch

    if isinstance(result, torch.Tensor):
        return result
    logits = getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise HpctrainError(f"{how.name} returned a {type(result).__name__}, not a tensor to compute the loss on",
                        hint="return the output (logits) or an object with .logits; or, if the model computes "
                             'its own loss, set train.loss = "model"')


def _unpack(result, how=None):
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
    if getattr(result, "loss", False) is None and hasattr(result, "logits"):
        raise HpctrainError(f"train.loss = \"model\": {how.name if how else 'the model'} returned no loss (its "
                            f".loss is None): it was given no labels it computes a loss from",
                            hint=f"give each sample its targets ({LABELS!r} in a dict sample, y in (x, y)), or name "
                                 f'the loss: train.loss = "cross_entropy"')
    raise HpctrainError(f"train.loss = \"model\": model(x, y) returned {type(result).__name__}{shape}, not its loss",
                        hint="return a scalar loss, (output, loss), or an object with .loss (and .logits); or "
                             "name the loss instead (train.loss = \"cross_entropy\") and return the output")
