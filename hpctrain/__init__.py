"""hpctrain: data-parallel PyTorch training on HPC clusters.

>>> from hpctrain import Trainer, load_config                       # doctest: +SKIP
>>> Trainer(load_config("examples/digits.toml")).fit()               # doctest: +SKIP

Names are imported on first use: ``import hpctrain`` (and ``hpctrain --help``) loads no torch, mpi4py or h5py.
"""
import importlib

__version__ = "0.1.0"

# module -> the public names it defines
_MODULES = {
    "training.trainer": ("Trainer", "FitResult"),
    "config": ("TrainConfig", "load_config", "validate", "CheckpointConfig"),
    "data": ("HDF5Dataset", "ArrayDataset", "ShardSampler", "make_digits_h5", "make_teacher_h5"),
    "models": ("build_model",),
    "monitoring.timing": ("PhaseTimer",),
    "backends": ("get_backend",),
    "runtime.world": ("init_world", "World"),
    "state": ("Progress", "TrainState"),
    "errors": ("HpctrainError", "ConfigError", "LaunchError", "BackendUnavailable", "CheckpointError"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
