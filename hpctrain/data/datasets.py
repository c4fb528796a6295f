"""Datasets (anything with ``read(indices) -> (x, y)`` or a dict batch, :mod:`.batches`) and how a run opens them
(:func:`open_datasets`)."""
import os

import numpy as np

from ..config.usercode import call
from ..errors import ConfigError, HpctrainError
from ..runtime.coordination import all_or_none, on_root
from .batches import collate, collate_function
from .generated import generate
from .tokens import open_token_splits


class ArrayDataset:
    """In-memory arrays with the same ``read(indices)`` as :class:`HDF5Dataset`."""

    def __init__(self, x, y):
        self.x, self.y = np.asarray(x), np.asarray(y)
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} samples but y has {len(self.y)}")

    def __len__(self):
        return len(self.x)

    def read(self, indices):
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx])


class HDF5Dataset:
    """Samples ``x[i]``, labels ``y[i]`` from an HDF5 file, opened read-only on each rank (serial h5py); each
    rank reads only the indices it asks for, sorted, a chunk at a time.

    >>> train = HDF5Dataset("data/digits.h5", x="train/x", y="train/y")     # doctest: +SKIP
    >>> x, y = train.read([5, 1, 3])                                        # doctest: +SKIP
    """

    # Indices per h5py read: one selection of a few thousand points stays fast.
    CHUNK = 4096

    def __init__(self, path, x="x", y="y"):
        self.path, self.x_name, self.y_name, self._file = str(path), x, y, None
        f = self._open()
        for name in (x, y):
            if name not in f:
                raise HpctrainError(f"{self.path} has no dataset {name!r}",
                                    hint=f"datasets there: {', '.join(_datasets(f))}")
        self._x, self._y = f[x], f[y]
        if len(self._x) != len(self._y):
            raise HpctrainError(f"{self.path}: {x} has {len(self._x)} samples but {y} has {len(self._y)}")

    def _open(self):
        if self._file is None:
            import h5py

            try:
                self._file = h5py.File(self.path, "r")
            except FileNotFoundError:
                raise HpctrainError(f"data file {self.path} does not exist",
                                    hint="create it (examples/prepare_data.py), or set data.generate") from None
            except OSError as exc:  # a directory, no permission, or not HDF5 at all
                raise HpctrainError(f"data file {self.path} cannot be read as HDF5 ({exc})",
                                    hint="data.path takes an HDF5 file with datasets x and y "
                                         "(examples/prepare_data.py writes one); check the path and its "
                                         "permissions") from None
        return self._file

    def __len__(self):
        return len(self._x)

    def after_fork(self):
        """In a forked worker process (``data.workers``): the file opened anew; HDF5 handles do not survive a fork."""
        self._file = None
        f = self._open()
        self._x, self._y = f[self.x_name], f[self.y_name]

    def read(self, indices):
        """(x, y) as torch tensors in the order of ``indices``."""
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        # h5py selections must be increasing and unique: read sorted, then put back in order.
        wanted, inverse = np.unique(idx, return_inverse=True)
        x = np.empty((len(wanted),) + self._x.shape[1:], dtype=self._x.dtype)
        y = np.empty((len(wanted),) + self._y.shape[1:], dtype=self._y.dtype)
        for lo in range(0, len(wanted), self.CHUNK):
            part = wanted[lo:lo + self.CHUNK]
            x[lo:lo + len(part)] = self._x[part]
            y[lo:lo + len(part)] = self._y[part]
        return torch.from_numpy(x[inverse]), torch.from_numpy(y[inverse])

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def _datasets(f):
    names = []
    f.visititems(lambda name, obj: names.append(name) if hasattr(obj, "shape") else None)
    return names


def as_dataset(data, collate_spec=""):
    """Anything with ``read(indices)``; a map-style dataset (torch, torchvision, Hugging Face ``datasets``) is
    wrapped, its samples collated by ``data.collate`` (``collate_spec``) or by :func:`.batches.collate`."""
    if data is None or hasattr(data, "read"):
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return MapDataset(data, collate_function(collate_spec), collate_spec)
    raise TypeError(f"cannot read samples from {type(data).__name__}: give an object with "
                    f"read(indices) -> (x, y), or a dataset with __getitem__ and __len__")


class MapDataset:
    """A map-style dataset read a batch at a time: ``dataset[i]`` for each index, then collated."""

    def __init__(self, data, collate_fn=None, collate_spec=""):
        self.data, self.collate_fn, self.collate_spec = data, collate_fn, collate_spec

    def __len__(self):
        return len(self.data)

    def read(self, indices):
        # targets of any shape: class numbers, token sequences, regression values; or dicts by key
        return collate([self.data[int(i)] for i in indices], self.collate_fn, self.collate_spec)


def open_splits(data_cfg):
    """(train, val or None) :class:`HDF5Dataset` for a :class:`hpctrain.config.DataConfig`, or
    :class:`~.tokens.TokenWindows` where ``data.kind = "tokens"``."""
    def split(group):
        prefix = f"{group}/" if group else ""
        return HDF5Dataset(data_cfg.path, prefix + data_cfg.x, prefix + data_cfg.y)

    if data_cfg.kind == "tokens":
        return open_token_splits(data_cfg)
    return split(data_cfg.train), (split(data_cfg.val) if data_cfg.val and data_cfg.val != "none" else None)


def build_data(data_cfg, comm):
    """(train, val or None) from ``[data] factory``, as datasets with ``read(indices)``. Collective: rank 0
    calls the factory first, the others after it returned; an error on any rank is raised on all."""
    def made():
        return _splits(call(data_cfg.factory, data_cfg.kwargs, "data.factory"), data_cfg)

    kept = {}
    on_root(lambda: kept.update(data=made()), comm)  # only the outcome (None) travels; the datasets stay on rank 0
    return all_or_none(lambda: kept["data"] if comm.Get_rank() == 0 else made(), comm)


def _splits(result, data_cfg):
    train, val = result if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)
    try:
        return as_dataset(train, data_cfg.collate), as_dataset(val, data_cfg.collate)
    except TypeError as exc:
        raise ConfigError(f"data.factory = {data_cfg.factory!r} returned {type(result).__name__}: {exc}",
                          hint="return (train, val) (val may be None) or one dataset") from None


def open_datasets(cfg, comm, train=None, val=None):
    """Collective: a run's (train, val or None): ``train``/``val`` when handed in, else the
    factory's (rank 0 first: a cache it writes), else the ``[data]`` file's (one rank generates
    it where ``data.generate`` says and it is missing; the others wait for it or its error)."""
    if train is not None:
        return all_or_none(lambda: (as_dataset(train, cfg.data.collate), as_dataset(val, cfg.data.collate)), comm)
    if cfg.data.factory:
        return build_data(cfg.data, comm)
    if cfg.data.generate != "none":
        on_root(lambda: None if os.path.exists(cfg.data.path)
                else generate(cfg.data, cfg.model, seed=cfg.run.seed), comm)
    return all_or_none(lambda: open_splits(cfg.data), comm)
