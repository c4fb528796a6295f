"""hpctrain: data-parallel PyTorch training on HPC clusters.

>>> from hpctrain import Trainer, load_config                       # doctest: +SKIP
>>> Trainer(load_config("examples/digits.toml")).fit()               # doctest: +SKIP

Names are imported on first use: ``import hpctrain`` (and ``hpctrain --help``) loads no torch, mpi4py or h5py.
"""
import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Trainer": "training.trainer",
    "FitResult": "training.trainer",
    "TrainConfig": "config",
    "load_config": "config",
    "validate": "config",
    "CheckpointConfig": "config",
    "HDF5Dataset": "data",
    "ArrayDataset": "data",
    "ShardSampler": "data",
    "make_digits_h5": "data",
    "make_teacher_h5": "data",
    "build_model": "models",
    "PhaseTimer": "monitoring.timing",
    "get_backend": "backends",
    "init_world": "runtime.world",
    "World": "runtime.world",
    "Progress": "state",
    "TrainState": "state",
    "HpctrainError": "errors",
    "ConfigError": "errors",
    "LaunchError": "errors",
    "BackendUnavailable": "errors",
    "CheckpointError": "errors",
}

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
