"""Which samples each rank reads at each step: deterministic and resumable (pure: no I/O).

Each epoch has one global order, a permutation drawn from ``(seed, epoch)``. Each step takes the next
``global_batch = batch_size x ranks x accumulation`` samples; rank ``r`` takes the ``r``-th slice of
``batch_size x accumulation``, split into ``accumulation`` micro-batches. The position in the epoch is one
global number (``Progress.samples_in_epoch``), so a run resumes mid-epoch on any number of ranks, in the same
order. A last partial global batch is dropped, so every step averages the same number of samples.

>>> sampler = ShardSampler(len(train), seed=0, batch_size=32, ranks=world.size)     # doctest: +SKIP
>>> for micro_batches in sampler.steps(epoch, samples_in_epoch, world.rank):        # doctest: +SKIP
...     x, y = train.read(micro_batches[0])
"""
import numpy as np


class ShardSampler:
    """Which samples each rank reads at each step (pure: no I/O, no communication)."""

    def __init__(self, num_samples, seed, batch_size, ranks=1, accumulation=1):
        self.num_samples, self.seed, self.batch_size = int(num_samples), int(seed), int(batch_size)
        self.ranks, self.accumulation = int(ranks), int(accumulation)
        self.global_batch = self.batch_size * self.ranks * self.accumulation

    @property
    def steps_per_epoch(self):
        return self.num_samples // self.global_batch

    def permutation(self, epoch):
        """The epoch's global order (the same on every rank and for any rank count)."""
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def steps(self, epoch, samples_in_epoch=0, rank=0):
        """Yield this rank's micro-batches for each step from ``samples_in_epoch`` to the epoch's end."""
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
