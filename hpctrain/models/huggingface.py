"""Hugging Face ``transformers`` models, trained as they are (``pip install hpctrain[hf]``; imported only here
and only when a model is one).

* :func:`from_config`: a model of any architecture from its configuration's fields, with random weights and
  nothing downloaded::

      [model]
      factory = "hpctrain.models.huggingface:from_config"
      kwargs = { architecture = "GPT2LMHeadModel", vocab_size = 256, n_positions = 64, n_embd = 64 }

  Local weights need no function of the user's either:
  ``factory = "transformers:AutoModelForCausalLM.from_pretrained"`` with
  ``kwargs = { pretrained_model_name_or_path = "path/to/dir" }``.
* :func:`is_causal_lm`: the models that shift their ``labels`` themselves (``hpctrain.training.losses``).
* :func:`save_pretrained`: a checkpoint's weights as a ``from_pretrained`` directory (``hpctrain ckpt export
  --format hf``).
"""
import sys

from ..errors import ConfigError, HpctrainError

INSTALL = "pip install 'hpctrain[hf]' (or: pip install transformers)"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("this needs the transformers package, which is not installed", hint=INSTALL) from None
    return transformers


def from_config(architecture, **config):
    """``transformers.<architecture>`` built from its configuration class with ``config`` (random weights). Special
    token ids left at defaults outside a smaller ``vocab_size`` (GPT-2's 50256) are unset."""
    transformers = _transformers()
    cls = getattr(transformers, architecture, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise ConfigError(f"transformers {transformers.__version__} has no model class {architecture!r}",
                          hint="name a model class, e.g. GPT2LMHeadModel, LlamaForCausalLM, "
                               "BertForSequenceClassification")
    defaults = cls.config_class()
    vocab = config.get("vocab_size", getattr(defaults, "vocab_size", None))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the default ids of a larger vocabulary
        default = getattr(defaults, key, None)
        if key not in config and vocab is not None and isinstance(default, int) and default >= vocab:
            config[key] = None
    return cls(cls.config_class(**config))


def is_transformers_model(model):
    """A ``transformers`` model (without importing ``transformers`` where it is not loaded)."""
    return "transformers" in sys.modules and isinstance(model, sys.modules["transformers"].PreTrainedModel)


def is_causal_lm(model):
    """A ``transformers`` causal language model: it shifts ``labels`` by one position itself."""
    if not is_transformers_model(model):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(c.__name__ in names or c.__name__.endswith(("ForCausalLM", "LMHeadModel")) for c in type(model).__mro__)


def save_pretrained(state_dict, model_cfg, directory):
    """Write ``state_dict`` (a checkpoint's model tensors) as a ``save_pretrained`` directory: the model of
    ``model_cfg`` (the run's ``[model]``) is built, given the weights and saved (config.json,
    model.safetensors; tied weights stay tied)."""
    from . import build_model

    _transformers()
    model = build_model(model_cfg)
    if not is_transformers_model(model):
        raise HpctrainError(f"--format hf: the run's model ({type(model).__name__}, from model.factory = "
                            f"{model_cfg.factory or model_cfg.name!r}) is not a transformers model",
                            hint="export it as a torch state dict (--to model.pt) or .safetensors instead")
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if missing or unexpected:
        raise HpctrainError(f"the checkpoint's tensors do not fit {type(model).__name__}: missing "
                            f"{missing[:5]}, unexpected {unexpected[:5]}",
                            hint="export from a checkpoint of the same [model] configuration")
    model.save_pretrained(directory)
    return model
