"""The data sets hpctrain makes (``data.generate``), written atomically as HDF5; nothing is downloaded."""
import os

import numpy as np

from ..errors import ConfigError, HpctrainError
from ..runtime.fsutil import replaced


def _write_atomically(path, write):
    """Write through a temporary name and rename, so no reader sees half a file."""
    import h5py

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
