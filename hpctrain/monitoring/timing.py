"""Where each training step's time goes, phase by phase. Phases: ``data`` (reading and moving the batch),
``forward_backward``, ``allreduce_wait`` (time blocked on gradient averaging beyond what overlapped with the
backward pass), ``optimizer`` and ``checkpoint``. The trainer hands :meth:`PhaseTimer.times` of every step to
its callbacks (:class:`PhaseTotals` sums them). :data:`PHASES` is the one list of phases: the slow-rank rule,
the monitor and its records use it as defined here.

>>> timer = PhaseTimer()
>>> timer.start_step()
>>> with timer.phase("data"):
...     pass
>>> sorted(timer.times())
['allreduce_wait', 'checkpoint', 'data', 'forward_backward', 'optimizer', 'step']
"""
import contextlib
import time

import numpy as np

#: The phases of one training step, in the order they are timed, gathered and written.
PHASES = ("data", "forward_backward", "allreduce_wait", "optimizer", "checkpoint")
#: What :class:`PhaseTotals` holds per rank, in this order (one gathered row).
FIELDS = ("steps", "wall_sum", "wall_max") + tuple(f"{p}_sum" for p in PHASES) + ("other_sum", "gather_s",
                                                                                  "peak_rss_bytes")


def peak_rss_bytes():
    """This process's peak resident memory so far (``ru_maxrss``: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseTimer:
    """Seconds per phase of the current step; a phase entered twice adds up. ``sync``, called at each phase
    boundary (e.g. ``torch.cuda.synchronize``), charges asynchronous GPU work to the phase that queued it."""

    def __init__(self, sync=None, clock=time.perf_counter):
        self._sync, self._clock = sync, clock
        self._times, self._step_start = dict.fromkeys(PHASES, 0.0), None

    def start_step(self):
        self._times = dict.fromkeys(PHASES, 0.0)
        self._step_start = self._clock()

    @contextlib.contextmanager
    def phase(self, name):
        if self._sync:
            self._sync()
        start = self._clock()
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self._times[name] = self._times.get(name, 0.0) + self._clock() - start

    def times(self):
        """This step's seconds per phase, plus ``step``: the wall time since :meth:`start_step`."""
        step = self._clock() - self._step_start if self._step_start is not None else sum(self._times.values())
        return {**self._times, "step": step}


class PhaseTotals:
    """One rank's sums of :meth:`PhaseTimer.times` since the last gather, as one float64 row
    laid out as :data:`FIELDS`, so that it is gathered as it is. Purely local."""

    STEPS, WALL, WALL_MAX, PHASE0 = 0, 1, 2, 3
    OTHER = PHASE0 + len(PHASES)
    GATHER = OTHER + 1
    PEAK_RSS = GATHER + 1  # filled in just before a gather

    def __init__(self):
        self.values = np.zeros(len(FIELDS))
        self.last_end = None  # when the previous step's callbacks were done

    def add(self, phase_times, now):
        """One step's times; ``now``: when its callbacks began."""
        known = [float(phase_times.get(p) or 0.0) for p in PHASES]
        # "step" (the timer's own wall time) is a total, not a phase
        other = sum(float(v or 0.0) for k, v in phase_times.items() if k not in PHASES and k != "step")
        # Between two calls lies the whole step as this rank lived it; the first has only the phases.
        wall = now - self.last_end if self.last_end is not None else sum(known) + other
        v = self.values
        v[self.STEPS] += 1
        v[self.WALL] += wall
        v[self.WALL_MAX] = max(v[self.WALL_MAX], wall)
        v[self.PHASE0:self.OTHER] += known
        v[self.OTHER] += other

    def reset(self, gather_seconds):
        """After a gather: start again, keeping the gather's time for the next one."""
        self.values[:] = 0.0
        self.values[self.GATHER] = gather_seconds
