"""The models a configuration names (``[model]``), and the user's own.

* ``name = "mlp"`` (:mod:`.mlp`): flatten, hidden layers, a linear classifier; pre-norm residual blocks with
  ``residual = true`` (the ~25M-parameter model of ``examples/large_mlp.toml``).
* ``name = "transformer"`` (:mod:`.transformer`): attention and MLP blocks (:mod:`.blocks`, split by
  :mod:`hpctrain.parallel.tensor`) in a stack of layers (:mod:`.stack`), a part per pipeline stage.
* ``factory = "mypkg.models:build"`` with ``[model.kwargs]``: your own ``nn.Module``
  (:mod:`hpctrain.config.usercode`); or pass the module to :class:`hpctrain.Trainer` from a script.
* Hugging Face ``transformers`` models, trained as they are (:mod:`.huggingface`).
"""
from ..config.usercode import call
from ..errors import ConfigError


def build_model(model_cfg):
    """The ``nn.Module`` of a :class:`hpctrain.config.ModelConfig`: the factory's, else the named built-in."""
    if model_cfg.factory:
        from torch import nn

        model = call(model_cfg.factory, model_cfg.kwargs, "model.factory")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory = {model_cfg.factory!r} returned a {type(model).__name__}, not a "
                              f"torch nn.Module", hint="return the model (an nn.Module) from the factory")
        return model
    if model_cfg.name == "transformer":  # a stack of layers that pipeline stages build separately
        import torch

        from .transformer import transformer_stack

        return transformer_stack(model_cfg, seed=torch.initial_seed()).sequential()
    if model_cfg.name != "mlp":
        raise ValueError(f"unknown model {model_cfg.name!r}")  # validate() has said so with a hint already
    from .mlp import mlp

    return mlp(model_cfg)


def count_parameters(model):
    """(number of parameters, number of parameter tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), len(params)
