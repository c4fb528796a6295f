"""The models that configurations name (``[model] name = ...``).

Your own model instead: name its function in the configuration (``[model] factory =
"mypkg.models:build"`` with ``[model.kwargs]``, see :mod:`hpctrain.factories`), or pass the
module to :class:`hpctrain.training.trainer.Trainer` from a script.

* ``mlp``: flatten, ``depth`` hidden layers of width ``hidden``, a linear classifier. With
  ``residual = true`` the hidden layers are pre-norm residual blocks
  (``x + W relu(LayerNorm(x))``), which keeps a deep, wide MLP trainable: that is the
  ~25M-parameter model of ``examples/large_mlp.toml``.
* ``transformer``: attention and MLP blocks as a stack of layers, the model that
  ``[parallel]`` splits into pipeline stages and tensor-parallel ranks
  (:mod:`hpctrain.parallel.transformer`).
"""
NAMES = ("mlp", "transformer")


def build_model(cfg):
    """An ``nn.Module`` for a :class:`hpctrain.config.ModelConfig`."""
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

    if cfg.name == "transformer":  # a stack of layers that pipeline stages build separately
        from .parallel.transformer import transformer_stack

        return transformer_stack(cfg, seed=torch.initial_seed()).sequential()
    if cfg.name != "mlp":
        raise ValueError(f"unknown model {cfg.name!r}")  # validate() has said so with a hint already
    layers = [nn.Flatten(), nn.Linear(cfg.in_features, cfg.hidden)]
    if cfg.residual:
        layers += [Block(cfg.hidden, cfg.layer_norm, cfg.dropout) for _ in range(cfg.depth)]
        layers += [nn.LayerNorm(cfg.hidden)] if cfg.layer_norm else []
        layers += [nn.ReLU()]
    else:
        for i in range(cfg.depth):
            if i:
                layers.append(nn.Linear(cfg.hidden, cfg.hidden))
            if cfg.layer_norm:
                layers.append(nn.LayerNorm(cfg.hidden))
            layers.append(nn.ReLU())
            if cfg.dropout:
                layers.append(nn.Dropout(cfg.dropout))
    layers.append(nn.Linear(cfg.hidden, cfg.num_classes))
    return nn.Sequential(*layers)


def count_parameters(model):
    """(number of parameters, number of parameter tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
