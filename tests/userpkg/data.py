"""Dataset factories: (train, val) pairs, one as hpctrain's ArrayDataset, one as a map-style
torch dataset with sequence targets."""
import numpy as np
import torch

from hpctrain.data import ArrayDataset

CALLS = []  # (rank order is not known here): how often this process called a factory


def blobs(samples=512, features=16, classes=4, seed=0):
    """Gaussian blobs, one per class: linearly separable, learnt in a few steps."""
    CALLS.append("blobs")
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, features)).astype(np.float32) * 3
    y = rng.integers(0, classes, samples + samples // 4)
    x = centres[y] + rng.standard_normal((len(y), features)).astype(np.float32)
    return ArrayDataset(x[:samples], y[:samples]), ArrayDataset(x[samples:], y[samples:])


class Noisy(torch.utils.data.Dataset):
    """Map-style: noisy sequence in, the clean sequence (its 3-point mean) as the target."""

    def __init__(self, n, length, seed):
        g = torch.Generator().manual_seed(seed)
        self.clean = torch.cumsum(torch.randn(n, length, generator=g), dim=1) / 4
        self.noisy = self.clean + 0.3 * torch.randn(n, length, generator=g)

    def __len__(self):
        return len(self.clean)

    def __getitem__(self, i):
        return self.noisy[i], self.clean[i]


def sequences(samples=256, length=12, seed=0):
    return Noisy(samples, length, seed), Noisy(samples // 4, length, seed + 1)
