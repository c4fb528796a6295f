"""The built-in MLP: flatten, ``depth`` hidden layers of width ``hidden``, a linear classifier. Pre-norm
residual blocks (``x + W relu(LayerNorm(x))``) with ``residual = true`` keep a deep, wide MLP trainable."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, layer_norm, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(width) if layer_norm else nn.Identity()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return x + self.drop(self.linear(torch.relu(self.norm(x))))


def mlp(cfg):
    """The ``nn.Sequential`` of a :class:`hpctrain.config.ModelConfig` with ``name = "mlp"``."""
    layers = [nn.Flatten(), nn.Linear(cfg.in_features, cfg.hidden)]
    if cfg.residual:
        layers += [Block(cfg.hidden, cfg.layer_norm, cfg.dropout) for _ in range(cfg.depth)]
        layers += [nn.LayerNorm(cfg.hidden)] if cfg.layer_norm else []
        layers += [nn.ReLU()]
    else:
        for i in range(cfg.depth):
            layers += [nn.Linear(cfg.hidden, cfg.hidden)] if i else []
            layers += [nn.LayerNorm(cfg.hidden)] if cfg.layer_norm else []
            layers += [nn.ReLU()] + ([nn.Dropout(cfg.dropout)] if cfg.dropout else [])
    layers.append(nn.Linear(cfg.hidden, cfg.num_classes))
    return nn.Sequential(*layers)
