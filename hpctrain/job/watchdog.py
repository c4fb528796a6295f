"""Hang detection: a thread that ends the whole job when a step takes far too long.

A rank stuck in a collective (another rank died without MPI noticing, a deadlock, a dead file system)
otherwise holds the allocation until the time limit. The trainer arms the watchdog around each step; if
the step still runs after ``timeout`` seconds, the watchdog prints which rank and host, dumps the stack of
every thread of this process, and calls ``MPI_Abort``, so that every rank ends with a non-zero status::

    from hpctrain.job.watchdog import Watchdog

    watchdog = Watchdog(timeout=600, comm=world.comm, where=world.where())
    for step, batch in enumerate(loader):
        with watchdog.step(step):
            train_step(batch)
    watchdog.close()

Every other collective phase (a checkpoint save, an evaluation, a resume, the stop agreement, the wait
for a background save) is guarded the same way, without handing the watchdog around: the run's watchdog
is the process's active one while its ``with`` block runs, and :func:`watching` arms it for a phase::

    with watching("checkpoint save"):
        manager.save(state)
"""
import contextlib
import faulthandler
import os
import sys
import threading
import time

from .. import settings
from ..errors import EXIT_HUNG

_active = None  # the watchdog of the run in this process, while its ``with`` block runs


def watching(label, timeout=None):
    """Guard one phase with the active watchdog (a no-op when there is none or it is off)."""
    watchdog = _active
    if watchdog is None or not watchdog.enabled:
        return contextlib.nullcontext()
    return watchdog.step(label, timeout)


class Watchdog:
    """Aborts the job when an armed section outlives its timeout. ``timeout``: seconds (``None``:
    ``HPCTRAIN_WATCHDOG_TIMEOUT``; 0: off). ``comm``: the communicator to abort (default ``MPI.COMM_WORLD``
    when mpi4py is already imported; a size-1 job just exits). ``where``: how this rank is named in the
    message (default ``rank R on HOST``). ``grace``: seconds between the dump and the abort, so that other
    ranks whose watchdogs fire at nearly the same moment can print theirs too."""

    def __init__(self, timeout=None, comm=None, where=None, grace=1.0, stream=None):
        if timeout is None:
            timeout = float(settings.get("WATCHDOG_TIMEOUT", "0") or 0)
        if timeout < 0:
            raise ValueError(f"watchdog timeout must be >= 0 seconds (0: off), got {timeout}")
        self.timeout = float(timeout)
        self.comm, self.where, self.grace, self.stream = comm, where, grace, stream
        self._cond = threading.Condition()
        self._deadline = None  # monotonic time at which an armed section expires
        self._label = self._armed_for = self._thread = None
        self._outer = []  # (label, timeout) of the sections an armed one is nested in
        self._closed = False

    @property
    def enabled(self):
        return self.timeout > 0

    # ------------------------------------------------------------------ arming
    def arm(self, label=None, timeout=None):
        """Start (or restart) the clock for the section named ``label``."""
        seconds = self.timeout if timeout is None else float(timeout)
        if seconds <= 0:
            return
        self._ensure_thread()
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._armed_for, self._label = seconds, label
            self._cond.notify()

    def disarm(self):
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def beat(self, label=None):
        """Progress was made: restart the clock (arms the watchdog if it was not)."""
        self.arm(label)

    @contextlib.contextmanager
    def step(self, label=None, timeout=None):
        """Watch one step (or any section): ``with watchdog.step(step_number): ...``. Nested in another
        section (or phase), it re-arms that one with a fresh timeout when it ends."""
        with self._cond:
            outer = (self._label, self._armed_for) if self._deadline is not None else None
        self._outer.append(outer)
        self.arm(label, timeout)
        try:
            yield self
        finally:
            outer = self._outer.pop()
            if outer is None:
                self.disarm()
            else:
                self.arm(*outer)

    def close(self):
        global _active
        if _active is self:
            _active = None
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self):
        global _active
        _active = self
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the thread
    def _ensure_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
            self._thread.start()

    def _run(self):
        with self._cond:
            while not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is None or left > 0:
                    self._cond.wait(left)  # None: until armed or closed
                    continue
                label, seconds = self._label, self._armed_for
                break
            else:
                return
        self._expire(label, seconds)

    def _describe(self):
        if self.where:
            return self.where
        comm = self._comm()
        rank = comm.Get_rank() if comm is not None else 0
        from ..runtime.world import node_name

        return f"rank {rank} on {node_name()}"

    def _comm(self):
        if self.comm is not None:
            return self.comm
        mpi = sys.modules.get("mpi4py.MPI")
        return mpi.COMM_WORLD if mpi is not None else None

    def _expire(self, label, seconds):
        stream = self.stream or sys.stderr
        section = "step" if label is None else (f"step {label}" if isinstance(label, int) else str(label))
        with contextlib.suppress(Exception):  # a broken stream must not keep the job alive
            stream.write(
                f"hpctrain: watchdog: {self._describe()}: {section} still running after {seconds:g} s "
                f"(pid {os.getpid()}); stacks of all threads follow, then the job is aborted\n")
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        _record_hang(self._comm, label, seconds)
        time.sleep(self.grace)
        comm = self._comm()
        if comm is not None and comm.Get_size() > 1:
            comm.Abort(EXIT_HUNG)
        os._exit(EXIT_HUNG)


def _record_hang(get_comm, label, seconds):
    """The hang, machine-readably, for a supervisor (``HPCTRAIN_FAILURE_FILE``)."""
    from ..runtime.world import node_name
    from ..runtime.coordination import record

    step = label if isinstance(label, int) else None
    with contextlib.suppress(Exception):  # the abort comes first
        comm = get_comm()
        record("hang", rank=comm.Get_rank() if comm is not None else 0, host=node_name(), status=EXIT_HUNG,
               error="Hang", message=f"{'step' if step is not None else label} still running after {seconds:g} s",
               step=step, phase="step" if step is not None or label is None else str(label))
