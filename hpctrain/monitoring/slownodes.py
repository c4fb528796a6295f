"""Find the rank that holds the others back, from the timings gathered across ranks. In synchronous
data-parallel training every rank waits for the slowest one in the all-reduce, so the wall-clock step time is
the same everywhere and says nothing about who is slow. What differs is the time a rank spends *working*: its
own data loading, forward/backward and optimizer step. The all-reduce wait is excluded (the fast ranks are the
ones that wait), and so is the checkpoint phase (rank 0 or the writers do more there by design). A rank is
slow in one gather when its working time per step is more than ``factor`` times the median of all ranks *and*
more than ``min_seconds`` above it (so that jitter on microsecond-sized steps is not reported). It is reported
once it has been slow in ``window`` consecutive gathers, and reminded every ``REMIND_WINDOWS`` windows while
it stays slow. This module is pure (numpy only), so it is tested without MPI. Example::

    detector = SlowRankDetector(factor=1.3, window=3, min_seconds=0.005)
    for finding in detector.update(per_rank_phase_means, hosts):  # after each gather
        print(finding.message())
"""
from dataclasses import dataclass

import numpy as np

from .timing import PHASES

#: Phases that measure a rank's own work (see the module docstring for the others).
WORK_PHASES = ("data", "forward_backward", "optimizer")
#: While a rank stays slow, say it again after this many further windows.
REMIND_WINDOWS = 10


@dataclass(frozen=True)
class SlowRank:
    """One report: ``rank`` on ``host`` has been slow for ``gathers`` consecutive gathers."""

    rank: int
    host: str
    phase: str  # the phase with the largest excess over the median
    seconds: float  # this rank's working time per step
    median_seconds: float  # the median working time per step over all ranks
    phase_seconds: float  # this rank's time per step in ``phase``
    phase_median_seconds: float
    gathers: int
    step: int = 0

    @property
    def ratio(self):
        return self.seconds / self.median_seconds if self.median_seconds > 0 else float("inf")

    def message(self):
        return (
            f"slow rank: rank {self.rank} on {self.host} has been {self.ratio:.2f}x slower than the "
            f"median rank for {self.gathers} consecutive measurements (step {self.step}): "
            f"{self.seconds * 1e3:.1f} ms of work per step against a median of "
            f"{self.median_seconds * 1e3:.1f} ms; the slow phase is '{self.phase}' "
            f"({self.phase_seconds * 1e3:.1f} ms against {self.phase_median_seconds * 1e3:.1f} ms). "
            f"Every other rank waits for it in each all-reduce.\n"
            f"HINT: if this persists, leave the node out of the next job: #SBATCH --exclude={self.host}")

    def as_dict(self):
        return {"rank": self.rank, "host": self.host, "phase": self.phase, "seconds": self.seconds,
                "median_seconds": self.median_seconds, "phase_seconds": self.phase_seconds,
                "phase_median_seconds": self.phase_median_seconds, "ratio": self.ratio,
                "gathers": self.gathers, "step": self.step, "exclude": f"#SBATCH --exclude={self.host}"}


def work_seconds(phase_means):
    """Working time per step for each rank: the sum of :data:`WORK_PHASES` columns."""
    columns = [PHASES.index(p) for p in WORK_PHASES]
    return np.asarray(phase_means, dtype=np.float64)[:, columns].sum(axis=1)


def slow_ranks_now(phase_means, factor, min_seconds):
    """Ranks slow in this one gather, as ``{rank: (phase, work, median, phase_s, phase_median)}``;
    ``phase_means`` is a ``(ranks, PHASES)`` array of seconds per step."""
    means = np.asarray(phase_means, dtype=np.float64)
    if means.shape[0] < 2:
        return {}  # nothing to compare with
    # With two ranks the median is their mean, so only a rank about factor/(2-factor) times
    # slower than the other is reported (1.86x for 1.3): a conservative test, on purpose.
    work, medians = work_seconds(means), np.median(means, axis=0)
    median = float(np.median(work))
    slow = {}
    for rank in np.flatnonzero((work > factor * median) & (work - median > min_seconds)):
        # the phase with the largest excess over its median (the first of equal ones)
        column = max((PHASES.index(p) for p in WORK_PHASES), key=lambda i: means[rank, i] - medians[i])
        slow[int(rank)] = (PHASES[column], float(work[rank]), median, float(means[rank, column]),
                           float(medians[column]))
    return slow


class SlowRankDetector:
    """Keeps, for each rank, how many consecutive gathers it has been slow in."""

    def __init__(self, factor=1.3, window=3, min_seconds=0.005):
        self.factor, self.window, self.min_seconds = factor, max(1, int(window)), min_seconds
        self.streak = {}

    def update(self, phase_means, hosts, step=0):
        """Feed one gather; returns the :class:`SlowRank` reports due now (usually none)."""
        now = slow_ranks_now(phase_means, self.factor, self.min_seconds)
        self.streak = {rank: self.streak.get(rank, 0) + 1 for rank in now}
        due = []
        for rank, (phase, work, median, phase_s, phase_median) in sorted(now.items()):
            count = self.streak[rank]
            if count >= self.window and (count - self.window) % (self.window * REMIND_WINDOWS) == 0:
                due.append(SlowRank(rank, hosts[rank] if rank < len(hosts) else "?", phase, work,
                                    median, phase_s, phase_median, count, step))
        return due
