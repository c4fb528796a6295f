"""The built-in model for split runs, ``[model] name = "transformer"``: a :class:`~.stack.LayerStack` a
pipeline can cut anywhere (a rank builds only its stage's layers: the model never has to fit one rank), whose
attention and MLP blocks tensor parallelism can split; ``hidden`` must be a multiple of 4 x parallel.tensor.

A sample of ``in_features`` numbers is read as ``in_features / 8`` tokens of 8 features::

    0            Embed:  (N, in_features) -> (N, tokens, hidden)
    1 + 4k       SelfAttention(hidden, 4 heads)      k = 0 .. depth-1
    2 + 4k       LayerNorm(hidden)
    3 + 4k       MLPBlock(hidden, 4 x hidden)
    4 + 4k       LayerNorm(hidden)
    4 depth + 1  Head:   mean over tokens, Linear(hidden, num_classes)

>>> stack = transformer_stack(cfg.model, seed=0)     # doctest: +SKIP
>>> dense = stack.sequential()                        # the same model in one process  # doctest: +SKIP
"""
from torch import nn

from .stack import LayerStack
from .blocks import MLPBlock, SelfAttention

TOKEN_FEATURES = 8
HEADS = 4


class Embed(nn.Module):
    """(N, features) -> (N, features / 8 tokens, width)."""

    def __init__(self, features, width):
        super().__init__()
        self.tokens = features // TOKEN_FEATURES
        self.proj = nn.Linear(TOKEN_FEATURES, width)

    def forward(self, x):
        return self.proj(x.reshape(x.shape[0], self.tokens, TOKEN_FEATURES))


class Head(nn.Module):
    """Mean over the tokens, then the classifier."""

    def __init__(self, width, classes):
        super().__init__()
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        return self.out(x.mean(dim=1))


def transformer_stack(model_cfg, seed=0):
    """The :class:`LayerStack` of ``[model] name = "transformer"`` (see the module docstring)."""
    width, depth = model_cfg.hidden, model_cfg.depth

    def build(i):
        if i == 0:
            return Embed(model_cfg.in_features, width)
        if i == 4 * depth + 1:
            return Head(width, model_cfg.num_classes)
        kind = (i - 1) % 4
        if kind == 0:
            return SelfAttention(width, HEADS)
        if kind == 2:
            return MLPBlock(width, 4 * width)
        return nn.LayerNorm(width)

    return LayerStack(4 * depth + 2, build, seed=seed)
