"""The small learnable data sets the multi-rank scripts train on, deterministic for a seed."""
import numpy as np

from hpctrain import ArrayDataset


def synthetic(n, seed, classes=4):
    """``n`` samples of 8 features; 4 classes from the signs of two feature sums, or 2 from the first."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    first = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    if classes == 2:
        return ArrayDataset(x, first)
    return ArrayDataset(x, (first + 2 * (x[:, 2] - x[:, 3] > 0)).astype(np.int64))
