"""Training data: HDF5 datasets read per rank, and the deterministic, resumable sampler.

Sharding. Each epoch has one global order, a permutation drawn from ``(seed, epoch)``.
Every optimizer step consumes the next ``global_batch = batch_size x ranks x accumulation``
samples of that order; rank ``r`` takes the ``r``-th slice of ``batch_size x accumulation``
and splits it into ``accumulation`` micro-batches. The position in the epoch is one global
number (``Progress.samples_in_epoch``), so a run resumes mid-epoch on any number of ranks
and continues the same global order. A last partial global batch is dropped, so every
step averages the same number of samples.

>>> sampler = ShardSampler(len(train), seed=0, batch_size=32, ranks=world.size)     # doctest: +SKIP
>>> for micro_batches in sampler.steps(epoch, samples_in_epoch, world.rank):        # doctest: +SKIP
...     x, y = train.read(micro_batches[0])

Files. :class:`HDF5Dataset` opens the file read-only on each rank (serial h5py) and reads
only the indices that rank asks for, sorted, a chunk at a time. :func:`make_digits_h5` and
:func:`make_teacher_h5` create the examples' files; nothing is downloaded.
"""
import os

import numpy as np

from .errors import ConfigError, HpctrainError


# ---------------------------------------------------------------- sampler
class ShardSampler:
    """Which samples each rank reads at each step (pure: no I/O, no communication)."""

    def __init__(self, num_samples, seed, batch_size, ranks=1, accumulation=1):
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.ranks = int(ranks)
        self.accumulation = int(accumulation)
        self.global_batch = self.batch_size * self.ranks * self.accumulation

    @property
    def steps_per_epoch(self):
        return self.num_samples // self.global_batch

    def permutation(self, epoch):
        """The epoch's global order (the same on every rank and for any rank count)."""
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def steps(self, epoch, samples_in_epoch=0, rank=0):
        """Yield, for each remaining step of the epoch, this rank's ``accumulation``
        micro-batches of indices; starting ``samples_in_epoch`` samples into the epoch."""
        order = self.permutation(epoch)
        per_rank = self.batch_size * self.accumulation
        start = int(samples_in_epoch)
        while start + self.global_batch <= self.num_samples:
            mine = order[start + rank * per_rank: start + (rank + 1) * per_rank]
            yield [mine[i * self.batch_size:(i + 1) * self.batch_size] for i in range(self.accumulation)]
            start += self.global_batch


def eval_shard(num_samples, rank, ranks):
    """This rank's contiguous part of an evaluation set (all samples, none twice)."""
    bounds = np.linspace(0, num_samples, ranks + 1).astype(np.int64)
    return np.arange(bounds[rank], bounds[rank + 1])


# ---------------------------------------------------------------- datasets
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
    """Samples ``x[i]``, labels ``y[i]`` from an HDF5 file; each rank reads only what it asks.

    >>> train = HDF5Dataset("data/digits.h5", x="train/x", y="train/y")     # doctest: +SKIP
    >>> x, y = train.read([5, 1, 3])                                        # doctest: +SKIP
    """

    # Indices per h5py read: one selection of a few thousand points stays fast.
    CHUNK = 4096

    def __init__(self, path, x="x", y="y"):
        self.path, self.x_name, self.y_name = str(path), x, y
        self._file = None
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
        return self._file

    def __len__(self):
        return len(self._x)

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


def as_dataset(data):
    """Anything with ``read(indices)``; a map-style torch dataset is wrapped."""
    if data is None or hasattr(data, "read"):
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return _MapDataset(data)
    raise TypeError(f"cannot read samples from {type(data).__name__}: give an object with "
                    f"read(indices) -> (x, y), or a dataset with __getitem__ and __len__")


class _MapDataset:
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def read(self, indices):
        import torch

        items = [self.data[int(i)] for i in indices]
        # targets of any shape: class numbers, token sequences, regression values
        return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items])


# ---------------------------------------------------------------- generated files
def _write_atomically(path, write):
    """Write through a temporary name and rename, so no reader sees half a file."""
    import h5py

    from .fsutil import replaced

    path = str(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replaced(path) as tmp, h5py.File(tmp, "w") as f:
        write(f)
    return path


def _split(f, name, x, y, **attrs):
    group = f.create_group(name)
    # ~64 KiB chunks: a rank reading scattered samples touches little beyond them.
    rows = max(1, min(len(x), 65536 // max(1, x[0].nbytes)))
    group.create_dataset("x", data=x, chunks=(rows,) + x.shape[1:])
    group.create_dataset("y", data=y)
    group.attrs.update(attrs)


def make_digits_h5(path, val_fraction=0.2, seed=0):
    """scikit-learn's bundled digits (1797 8x8 images, 10 classes), pixels scaled to [0, 1],
    split deterministically into ``train/{x,y}`` and ``val/{x,y}``. Returns ``path``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise HpctrainError("the digits example needs scikit-learn (it ships the data set)",
                            hint="pip install scikit-learn (make setup installs it)") from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]

    def write(f):
        _split(f, "train", x[train], y[train])
        _split(f, "val", x[val], y[val])
        f.attrs.update(source="sklearn.datasets.load_digits", classes=10, features=64, seed=seed)

    return _write_atomically(path, write)


def make_teacher_h5(path, samples, val_samples, features, classes, seed=0, hidden=256):
    """A synthetic classification corpus: Gaussian inputs labelled by a fixed random
    two-layer "teacher" network drawn from ``seed``. Same arguments, same file contents."""
    rng = np.random.default_rng([seed, 1])
    w1 = rng.standard_normal((features, hidden)).astype(np.float32) / np.sqrt(features)
    w2 = rng.standard_normal((hidden, classes)).astype(np.float32) / np.sqrt(hidden)

    def draw(n, stream):
        gen = np.random.default_rng([seed, 2, stream])
        x = np.empty((n, features), dtype=np.float32)
        y = np.empty(n, dtype=np.int64)
        for lo in range(0, n, 8192):  # bounded memory for large corpora
            part = gen.standard_normal((min(8192, n - lo), features), dtype=np.float32)
            x[lo:lo + len(part)] = part
            y[lo:lo + len(part)] = np.argmax(np.tanh(part @ w1) @ w2, axis=1)
        return x, y

    def write(f):
        _split(f, "train", *draw(samples, 0))
        if val_samples:
            _split(f, "val", *draw(val_samples, 1))
        f.attrs.update(source="teacher network", classes=classes, features=features, seed=seed)

    return _write_atomically(path, write)


def generate(data_cfg, model_cfg, seed=0):
    """Create ``data_cfg.path`` with the generator ``data_cfg.generate`` names."""
    if data_cfg.generate == "digits":
        return make_digits_h5(data_cfg.path, seed=seed)
    if data_cfg.generate == "teacher":
        return make_teacher_h5(data_cfg.path, data_cfg.samples, data_cfg.val_samples,
                               model_cfg.in_features, model_cfg.num_classes, seed=seed)
    raise ConfigError(f"data file {data_cfg.path} does not exist and data.generate = "
                      f"{data_cfg.generate!r}", hint='create it first (python examples/prepare_data.py), '
                                                     'or set data.generate = "digits" or "teacher"')


def open_splits(data_cfg):
    """(train, val or None) :class:`HDF5Dataset` for a :class:`hpctrain.config.DataConfig`."""
    def name(group, key):
        return f"{group}/{key}" if group else key

    train = HDF5Dataset(data_cfg.path, name(data_cfg.train, data_cfg.x), name(data_cfg.train, data_cfg.y))
    val = None
    if data_cfg.val and data_cfg.val != "none":
        val = HDF5Dataset(data_cfg.path, name(data_cfg.val, data_cfg.x), name(data_cfg.val, data_cfg.y))
    return train, val
