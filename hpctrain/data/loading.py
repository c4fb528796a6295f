"""Batches read ahead in worker processes while the step computes (``data.workers = N``).

:class:`PrefetchingReader` has the dataset's ``read(indices)``. At each epoch's start the trainer tells it the
micro-batches it will ask for, in order (:meth:`~PrefetchingReader.plan`: the sampler's, a function of
``(seed, epoch)`` and the position in the epoch); N processes of torch's ``DataLoader`` read and collate them
ahead, ``data.prefetch`` batches each. A read that is not the next one planned (an evaluation, the step after
a rollback) is read directly, so the order and the result never depend on the workers: a resume on any
number of ranks reads what it read.

Workers are forked from the rank (torch's default on Linux): the dataset needs no pickling, and a worker
never calls MPI. An HDF5 file the rank holds open is opened again in each worker (HDF5 handles do not
survive a fork). The samples and their order never depend on the workers; random transforms in a worker draw
from generators that torch seeds once per run from ``(seed, epoch, rank, position)`` of where the run
started, so they are not the draws a run with ``data.workers = 0`` makes, nor bit for bit those of a resume.
"""
import collections
import os
import warnings

import numpy as np

from ..config.usercode import where_raised
from ..errors import HpctrainError
from ..runtime.system import usable_cpus


class PrefetchingReader:
    """``dataset.read(indices)``, the planned batches read ahead by ``workers`` processes."""

    def __init__(self, dataset, workers, prefetch=2, pin_memory=False, seed=0, rank=0):
        self.dataset, self.workers, self.prefetch = dataset, int(workers), int(prefetch)
        self.pin_memory, self.seed, self.rank = pin_memory, int(seed), int(rank)
        self._plan = _Plan()
        self._loader = self._batches = None
        self._expected = collections.deque()
        self.direct_reads = 0  # reads that were not the next planned batch (evaluations, rollbacks)

    def __len__(self):
        return len(self.dataset)

    def describe(self):
        """The run's first lines on the workers; where they share the rank's cores with the step (mpirun binds
        one rank to one core, and forked workers inherit the binding), what to do about it."""
        cores, want = usable_cpus(), self.workers + 1
        line = (f"data: {self.workers} worker process{'es' * (self.workers > 1)} per rank, {self.prefetch} batches "
                f"ahead each")
        if cores < want:
            line += (f"; they share this rank's {cores} core{'s' * (cores > 1)} with the step, so their reads still "
                     f"slow it: give each rank {want} cores (mpirun --map-by slot:PE={want}, srun --cpus-per-task="
                     f"{want}) or set data.workers = {max(0, cores - 1)}")
        return line

    def plan(self, micro_batches, epoch=0, position=0):
        """The micro-batches (index arrays) the next reads will ask for, in order; reading ahead starts."""
        import torch

        self._plan.items = [np.asarray(i) for i in micro_batches]
        self._expected = collections.deque(self._plan.items)
        warnings.filterwarnings("ignore", message="This DataLoader will create")  # torch counts the cores
        # this process may use (one, under mpirun's binding) against the workers of every rank
        if self._loader is None:
            self._loader = torch.utils.data.DataLoader(
                _Reads(self.dataset), batch_size=None, sampler=self._plan, num_workers=self.workers,
                prefetch_factor=self.prefetch, persistent_workers=True, pin_memory=self.pin_memory,
                collate_fn=_as_read, multiprocessing_context="fork",
                generator=torch.Generator())
        self._loader.generator.manual_seed(int(np.random.SeedSequence(
            [self.seed, int(epoch), self.rank, int(position)]).generate_state(1)[0]))
        self._batches = iter(self._loader) if self._plan.items else None

    def read(self, indices):
        if self._batches is not None and self._expected and np.array_equal(self._expected[0], indices):
            self._expected.popleft()
            batch = next(self._batches)
            if isinstance(batch, _Failed):
                raise HpctrainError(f"{batch.message} (in a data worker process)", hint=batch.hint)
            return batch
        self.direct_reads += 1
        return self.dataset.read(indices)

    def close(self):
        """End the worker processes (and close the dataset where it can be)."""
        self._batches = self._loader = None
        self._expected.clear()
        if hasattr(self.dataset, "close"):
            self.dataset.close()


class _Plan:
    """The sampler of the DataLoader: what :meth:`PrefetchingReader.plan` set, read anew at each ``iter()``."""

    items = ()

    def __iter__(self):
        return iter(list(self.items))

    def __len__(self):
        return len(self.items)


class _Reads:
    """``dataset.read(indices)`` as a DataLoader dataset indexed by a whole micro-batch."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.pid = os.getpid()

    def __getitem__(self, indices):
        if os.getpid() != self.pid:  # the first read in a forked worker
            self.pid = os.getpid()
            if hasattr(self.dataset, "after_fork"):
                self.dataset.after_fork()
        try:
            return self.dataset.read(indices)
        except HpctrainError as exc:
            return _Failed(str(exc).split("\nHINT: ")[0], exc.hint)
        except Exception as exc:  # the user's dataset: said as one line, as it would be without workers
            return _Failed(f"reading samples {list(indices)[:4]}... raised {type(exc).__name__}: {exc}{where_raised(exc)}",
                           "fix the dataset's __getitem__ (try dataset[i] in a Python shell), or set "
                           "data.workers = 0 to see it fail in the training process")


class _Failed:
    """What a worker sends back instead of a batch it could not read: the error, said by the rank."""

    def __init__(self, message, hint):
        self.message, self.hint = message, hint


def _as_read(batch):
    return batch
