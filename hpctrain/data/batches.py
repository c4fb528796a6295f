"""What a batch is, and the few things done to one.

A batch is either a pair ``(x, y)`` of tensors (``read(indices) -> (x, y)``), or a dict of tensors by
name, as Hugging Face datasets give them (``input_ids``, ``attention_mask``, ``labels``), passed to the
model as ``model(**batch)``. Samples of a map-style dataset are put together by :func:`collate`: pairs
stacked, dicts key by key, or by the user's ``data.collate`` function (e.g. a padding collator).

>>> batch = collate([{"input_ids": [1, 2], "labels": 0}, {"input_ids": [3, 4], "labels": 1}])
>>> batch["input_ids"].tolist(), batch["labels"].tolist()
([[1, 2], [3, 4]], [0, 1])
>>> samples_in(batch)
2
"""
from collections.abc import Mapping

from ..errors import ConfigError, HpctrainError

LABELS = "labels"  # the key of a dict batch that holds the targets (as Hugging Face names it)
IGNORE = -100  # a target position not scored (torch's cross_entropy and Hugging Face's default ignore_index)


def collate(samples, fn=None, spec=""):
    """One batch of ``samples`` (a list): ``fn(samples)`` where given (``data.collate = spec``), else pairs
    stacked into ``(x, y)`` and dicts stacked key by key."""
    if fn is not None:
        try:
            batch = fn(samples)
        except Exception as exc:
            raise HpctrainError(f"data.collate = {spec!r} raised {type(exc).__name__}: {exc}",
                                hint="fix the function: it is called with a list of samples, as "
                                     "torch's DataLoader calls a collate_fn") from exc
        return dict(batch) if isinstance(batch, Mapping) else batch
    if isinstance(samples[0], Mapping):
        return {key: _stack_key(samples, key) for key in samples[0]}
    try:
        xs, ys = zip(*samples)
    except (TypeError, ValueError):
        raise HpctrainError(f"a sample of the dataset is a {type(samples[0]).__name__}, neither a pair (x, y) "
                            f"nor a dict of tensors",
                            hint="make __getitem__ return (x, y) or a dict such as {'input_ids': ..., "
                                 "'labels': ...}, or set data.collate to a function that makes a batch") from None
    return _stack(xs, "x"), _stack(ys, "y")


def _stack_key(samples, key):
    try:
        values = [s[key] for s in samples]
    except KeyError:
        raise HpctrainError(f"samples of one batch have different keys: {sorted(samples[0])} and "
                            f"{sorted(next(s for s in samples if key not in s))}",
                            hint="give every sample the same keys") from None
    if any(isinstance(v, (str, bytes)) for v in values):
        return list(values)  # text columns stay lists (the model is told if it does not take them)
    return _stack(values, key)


def _stack(values, what):
    import torch

    tensors = [torch.as_tensor(v) for v in values]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise HpctrainError(f"samples' {what} have different shapes in one batch ({', '.join(map(str, sorted(shapes)[:4]))})",
                            hint='pad them to one length: set data.collate = "pkg.module:fn", e.g. a function '
                                 "that returns transformers' DataCollatorWithPadding(tokenizer)(samples)")
    return torch.stack(tensors)


def collate_function(spec):
    """The function ``data.collate`` names, or None (the default collation)."""
    if not spec:
        return None
    from ..config.usercode import resolve

    fn = resolve(spec, "data.collate")
    if isinstance(fn, type):  # a class: made with no arguments (a collator needing a tokenizer: a factory function)
        try:
            fn = fn()
        except TypeError as exc:
            raise ConfigError(f"data.collate = {spec!r} is a class that cannot be made without arguments ({exc})",
                              hint="name a function that collates a list of samples, e.g. one that builds the "
                                   "collator once and calls it") from None
    return fn


def to_device(batch, device):
    """``batch`` with its tensors on ``device`` (asynchronously where the memory is pinned)."""
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def samples_in(batch):
    if isinstance(batch, dict):
        for value in batch.values():
            if hasattr(value, "shape") and len(value.shape):
                return int(value.shape[0])
        return len(next(iter(batch.values())))
    return len(batch[1])
