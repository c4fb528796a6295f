"""Token streams (``data.kind = "tokens"``): one long 1-D array of token ids, a raw ``.bin`` (as nanoGPT's
prepare scripts write), a ``.npy`` or a 1-D HDF5 dataset, read in windows of ``block_size + 1`` tokens: x the
first ``block_size``, y the same shifted by one. The file is memory-mapped (HDF5: sliced), never read whole:
a step reads its own windows and nothing else (docs/data.md).

>>> train = TokenWindows("data/train.bin", block_size=256)     # doctest: +SKIP
>>> x, y = train.read([5, 1, 3])                              # doctest: +SKIP
"""
import os

import numpy as np

from ..config.schema import TOKEN_FORMATS
from ..errors import HpctrainError


class TokenWindows:
    """Window ``i`` of a token file: its tokens ``i * stride`` to ``i * stride + block_size`` (inclusive);
    ``len()`` windows, ``read(indices) -> (x, y)`` as int64 tensors of shape ``(len(indices), block_size)``.
    ``key``: the configuration key that named the file, for the errors."""

    def __init__(self, path, block_size, stride=0, dtype="uint16", dataset="tokens", key="data.path"):
        self.path, self.key, self.block_size = str(path), key, int(block_size)
        self.stride = int(stride) or self.block_size
        self._file, self._dataset = None, dataset  # an open h5py file, and its dataset of tokens
        if self.block_size < 1 or self.stride < 1:
            raise ValueError(f"block_size {block_size} and stride {stride} must be positive")
        self.tokens = self._open(np.dtype(dtype), dataset)  # np.memmap or h5py Dataset: never a copy
        if len(self.tokens) < self.block_size + 1:
            raise HpctrainError(f"token file {self.path} ({key}) has {len(self.tokens)} tokens, fewer than one "
                                f"window of data.block_size + 1 = {self.block_size + 1}",
                                hint="lower data.block_size, or give a longer token file")
        self._windows = (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def _open(self, dtype, dataset):
        if not os.path.exists(self.path):
            raise HpctrainError(f"token file {self.path} ({self.key}) does not exist",
                                hint=f"write it first (nanoGPT's prepare.py writes train.bin and val.bin), or fix "
                                     f"{self.key}")
        if os.path.isdir(self.path):
            raise HpctrainError(f"token file {self.path} ({self.key}) is a directory",
                                hint=f"{self.key} takes one token file ({', '.join(TOKEN_FORMATS)})")
        suffix = os.path.splitext(self.path)[1].lower()
        if suffix == ".bin":
            return self._open_bin(dtype)
        if suffix == ".npy":
            try:
                tokens = np.load(self.path, mmap_mode="r")
            except (ValueError, OSError) as exc:
                raise HpctrainError(f"token file {self.path} ({self.key}) is not a NumPy .npy array ({exc})",
                                    hint="write it with np.save(path, tokens)") from None
            return self._one_dimensional(tokens, "the array")
        return self._open_hdf5(dataset)

    def _open_bin(self, dtype):
        size = os.path.getsize(self.path)
        if size % dtype.itemsize:
            raise HpctrainError(f"token file {self.path} ({self.key}) has {size} bytes, not a multiple of the "
                                f"{dtype.itemsize} bytes of one data.dtype = {dtype.name!r} token",
                                hint="set data.dtype to the type the file was written with (\"uint16\" for "
                                     "vocabularies up to 65536, else \"uint32\")")
        if size == 0:  # np.memmap cannot map an empty file; the length check says what is wrong
            return np.empty(0, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r")

    def _open_hdf5(self, dataset):
        import h5py

        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise HpctrainError(f"token file {self.path} ({self.key}) cannot be read as HDF5 ({exc})",
                                hint="check the path and its permissions") from None
        if not isinstance(self._file.get(dataset), h5py.Dataset):
            names = []
            self._file.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
            self.close()
            raise HpctrainError(f"token file {self.path} ({self.key}) has no dataset {dataset!r}",
                                hint=f"set data.token_dataset to one of: {', '.join(names) or '(none there)'}")
        return self._one_dimensional(self._file[dataset], f"dataset {dataset!r}")

    def _one_dimensional(self, tokens, what):
        problem = (f"{what} has shape {tokens.shape}, not one dimension" if len(tokens.shape) != 1 else
                   f"{what} holds {tokens.dtype}, not integers" if not np.issubdtype(tokens.dtype, np.integer)
                   else None)
        if problem:
            self.close()
            raise HpctrainError(f"token file {self.path} ({self.key}): {problem}",
                                hint="a token stream is one 1-D array of integer token ids (documents joined, "
                                     "e.g. with an end-of-text token between them): flatten it")
        return tokens

    def __len__(self):
        return self._windows

    def after_fork(self):
        """In a forked worker process (``data.workers``): an HDF5 token file opened anew (a memory map is kept)."""
        if self._file is not None:
            self._file = None
            self.tokens = self._open_hdf5(self._dataset)

    def read(self, indices):
        """(x, y) windows in the order of ``indices``: int64 tensors of shape ``(len(indices), block_size)``."""
        import torch

        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._windows):
            raise IndexError(f"window indices must be in [0, {self._windows}), got {idx.min()}..{idx.max()}")
        width = self.block_size + 1
        rows = np.empty((len(idx), width), dtype=np.int64)
        for j in np.argsort(idx, kind="stable"):  # in file order: neighbouring windows share pages
            start = int(idx[j]) * self.stride
            rows[j] = self.tokens[start:start + width]  # one slice: only its pages are read
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def open_token_splits(data_cfg):
    """(train, val or None) :class:`TokenWindows` of a ``[data]`` section with ``kind = "tokens"``."""
    def windows(path, key):
        return TokenWindows(path, data_cfg.block_size, data_cfg.stride, data_cfg.dtype, data_cfg.token_dataset, key)

    train = windows(data_cfg.path, "data.path")
    return train, (windows(data_cfg.val_path, "data.val_path") if data_cfg.val_path else None)
