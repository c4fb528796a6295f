"""This process's start-up, part by part: when it started, and when it finished each part before its first step
(the Python interpreter and imports, MPI, the backend, the run directory, the data, the model, the resume, the
backend's start where it waits for the resume). A
relaunch after a failure pays all of it; rank 0 writes the parts into the run's ``start`` record, and
``hpctrain report`` lays each restart's cost out from them.

    startup.mark("data")        # once the data are open
    startup.take()              # {"imports": 2.31, "mpi": 0.41, ..., "data": 0.02}: seconds, in order
"""
import os
import time

from .system import proc_state

_clock = time.time
_marks = {}  # part -> the time it ended
_since = None  # where the next take() begins: the process start, then the previous take()
_called = None  # when this process, a warm spare, was called: its start-up counts from then
_started = None  # when the process this one stands for started (a rank forked from the warm pool)


def process_started():
    """When this process started (seconds since the epoch; Linux /proc), or None where unknown; for a warm
    spare (:mod:`hpctrain.job.spares`), when it was called; for a rank forked from the warm pool, when the process
    mpirun started for it did."""
    if _called is not None:
        return _called
    if _started is not None:
        return _started
    ticks = proc_state(os.getpid())[1]
    try:  # the start in clock ticks since boot, against the uptime now (/proc/stat's btime is whole seconds)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def started_at(seconds):
    """This process stands for one started at ``seconds`` (since the epoch): a rank forked from the warm pool
    (:mod:`hpctrain.job.warmpool`) for the process mpirun started then."""
    global _started
    _started = seconds


def forked():
    """Whether this process is a rank forked from the warm pool (:func:`started_at`)."""
    return _started is not None


def mark(part):
    """``part`` of the start-up ends now."""
    _marks[part] = _clock()


def was_called():
    """Whether this process was a warm spare, called (:func:`called`)."""
    return _called is not None


def called():
    """This process was started ahead of need and is called now: what it did before is not start-up a
    restart waited for."""
    global _called, _since
    _called = _since = _clock()
    _marks.clear()


def take():
    """``{part: seconds}`` of the parts marked since the process started (or since the last take), in the
    order they ended, each from the end of the one before; the marks are then cleared."""
    global _since
    start = _since if _since is not None else process_started()
    parts = {}
    for part, at in sorted(_marks.items(), key=lambda item: item[1]):
        if start is not None:
            parts[part] = round(max(0.0, at - start), 3)
        start = at
    _marks.clear()
    _since = _clock()
    return parts
