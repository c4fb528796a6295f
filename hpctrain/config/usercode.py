"""The user's own model, data, loss and metrics, named in the configuration by import path.

    [run]
    python_path = ["src"]                 # importable besides the working directory
    [model]
    factory = "mypkg.models:make_net"     # -> an nn.Module
    kwargs = { width = 256, depth = 4 }   # or a [model.kwargs] table; model.kwargs.width=1024 overrides
    [data]
    factory = "mypkg.data:splits"         # -> (train, val) datasets, or one dataset (no evaluation)
    kwargs = { path = "data/corpus.h5" }
    [train]
    loss = "cross_entropy"                # a name in LOSSES, or "mypkg.losses:my_loss"
    metrics = "mypkg.metrics:scores"      # optional: (output, target) -> {name: (sum, count)}

:func:`check_user_code` runs inside ``config.validate`` (every rank, before any collective): each path is
imported and its keyword arguments are bound to the function's signature, so a typo fails at once, on every
rank alike, as a :class:`ConfigError` naming the key, the path and the fix. The calls happen in the trainer's
set-up: :func:`hpctrain.models.build_model`, :func:`hpctrain.data.build_data`,
:func:`hpctrain.training.losses.build_loss` and ``build_metrics``. A dataset is anything with ``__len__`` and
``read(indices) -> (x, y)`` (see :class:`hpctrain.data.ArrayDataset`), or a map-style torch dataset
(``dataset[i] -> (x, y)``). The data factory runs on rank 0 first and on the other ranks only after it
returned, so a factory that prepares a file when it is missing (download, tokenise, cache as HDF5) does that
once: the other ranks find the file made."""
import importlib
import inspect
import os
import sys
import traceback

from ..errors import ConfigError
from .schema import LOSSES, MODEL_LOSS, is_import_path


# ---------------------------------------------------------------- import paths
def make_importable(python_path=()):
    """Put the working directory and ``run.python_path`` first on ``sys.path`` (once each)."""
    for entry in reversed([os.getcwd(), *python_path]):
        path = os.path.abspath(entry)
        if path not in sys.path:
            sys.path.insert(0, path)


def resolve(spec, key):
    """The object ``"package.module:attribute"`` names; raises :class:`ConfigError` naming setting ``key``."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r} is not an import path of the form \"package.module:function\"",
                          hint=f'e.g. {key} = "mypkg.models:make_net" (a module importable from the working '
                               f'directory or run.python_path, a colon, then the function)')
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{key} = {spec!r}: no module named {exc.name!r} (searched the working directory "
                              f"{os.getcwd()}, run.python_path and the installed packages)",
                              hint=f"check the spelling, run from the directory that holds {module_name.split('.')[0]}/, "
                                   f"or add its parent directory to run.python_path (e.g. run.python_path=src)"
                              ) from None
        raise ConfigError(f"{key} = {spec!r}: importing {module_name} failed: it imports {exc.name!r}, which is "
                          f"not installed", hint=f"install {exc.name} in the environment the ranks run in") from None
    except Exception as exc:  # a syntax error or an exception at import time in the user's module
        raise ConfigError(f"{key} = {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
                          f"{where_raised(exc)}", hint=f"fix {module_name} (try: python -c 'import {module_name}')") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
            raise ConfigError(f"{key} = {spec!r}: module {module_name} ({getattr(module, '__file__', '?')}) has no "
                              f"attribute {attr!r}",
                              hint=f"callables in {module_name}: {', '.join(names) or '(none)'}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} = {spec!r} is a {type(target).__name__}, not a function or class",
                          hint=f"name a function that returns what {key} needs")
    return target


def _signature(fn):
    try:
        return f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def where_raised(exc):
    """`` (at file:line)`` of the innermost frame of an exception, for a one-line message."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def check_arguments(fn, kwargs, key, spec):
    """Bind ``kwargs`` to ``fn``'s signature: a missing or unknown argument is a ConfigError
    with the TypeError's text and the signature."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call will tell
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        table = key.rsplit(".", 1)[0] + ".kwargs"
        raise ConfigError(f"{key} = {spec!r} cannot be called with {table} = {kwargs!r}: {exc}; its signature "
                          f"is {_signature(fn)}",
                          hint=f"give {table} exactly the keyword arguments that signature takes "
                               f"(one from the command line: {table}.NAME=VALUE)") from None


def call(spec, kwargs, key):
    """``spec(**kwargs)``; an exception in the call becomes a ConfigError naming both."""
    fn = resolve(spec, key)
    check_arguments(fn, kwargs, key, spec)
    try:
        return fn(**kwargs)
    except Exception as exc:
        raise ConfigError(f"{key} = {spec!r}: calling it with {kwargs!r} raised {type(exc).__name__}: "
                          f"{exc}{where_raised(exc)}", hint=f"fix the call or its arguments; "
                                                      f"signature {_signature(fn)}") from exc


# ---------------------------------------------------------------- validation
def check_user_code(cfg, need_data=True):
    """Import every path the configuration names and bind its keyword arguments (no call)."""
    make_importable(cfg.run.python_path)
    sections = [("model", cfg.model)] + ([("data", cfg.data)] if need_data else [])
    for section, table in sections:
        if table.factory:
            check_arguments(resolve(table.factory, f"{section}.factory"), table.kwargs, f"{section}.factory",
                            table.factory)
        elif table.kwargs:
            raise ConfigError(f"{section}.kwargs = {table.kwargs!r} is set but {section}.factory is not: "
                              f"nothing to pass them to",
                              hint=f'set {section}.factory = "package.module:function", or remove {section}.kwargs')
    if cfg.train.loss not in LOSSES + (MODEL_LOSS,):
        if not is_import_path(cfg.train.loss):
            raise ConfigError(f"train.loss = {cfg.train.loss!r} is neither a built-in loss ({', '.join(LOSSES)}), "
                              f"{MODEL_LOSS!r} (the model computes it) nor an import path",
                              hint='e.g. train.loss = "mse", or "mypkg.losses:my_loss"')
        resolve(cfg.train.loss, "train.loss")
    for key, spec in (("train.metrics", cfg.train.metrics), ("data.collate", cfg.data.collate)):
        if spec:
            resolve(spec, key)
    if is_import_path(cfg.train.optimizer):
        _check_optimizer_function(cfg.train.optimizer)


OPTIMIZER_CALL = "function(model, lr=..., weight_decay=...)"


def _check_optimizer_function(spec):
    fn = resolve(spec, "train.optimizer")
    try:
        inspect.signature(fn).bind(None, lr=0.1, weight_decay=0.0)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"train.optimizer = {spec!r} cannot be called as {OPTIMIZER_CALL}: {exc}; its "
                          f"signature is {_signature(fn)}",
                          hint="define it as def make(model, lr, weight_decay): returning a torch optimizer over "
                               "model's parameters (groups of your own are fine)") from None


