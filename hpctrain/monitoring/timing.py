"""Where each training step's time goes, phase by phase.

Phases: ``data`` (reading and moving the batch), ``forward_backward``, ``allreduce_wait``
(time blocked on gradient averaging beyond what overlapped with the backward pass),
``optimizer`` and ``checkpoint``. The trainer hands :meth:`PhaseTimer.times` of every step
to its callbacks, so monitoring code can aggregate them across steps and ranks.

>>> timer = PhaseTimer()
>>> timer.start_step()
>>> with timer.phase("data"):
...     pass
>>> sorted(timer.times())
['allreduce_wait', 'checkpoint', 'data', 'forward_backward', 'optimizer', 'step']
"""
import contextlib
import time

PHASES = ("data", "forward_backward", "allreduce_wait", "optimizer", "checkpoint")


class PhaseTimer:
    """Seconds per phase of the current step; a phase entered twice adds up.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called at each phase boundary so that
    asynchronous GPU work is charged to the phase that queued it.
    """

    def __init__(self, sync=None, clock=time.perf_counter):
        self._sync = sync
        self._clock = clock
        self._times = dict.fromkeys(PHASES, 0.0)
        self._step_start = None

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
        out = dict(self._times)
        out["step"] = self._clock() - self._step_start if self._step_start is not None else sum(self._times.values())
        return out
