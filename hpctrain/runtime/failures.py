"""Failure records: what a failing rank appends, machine-readably, to the file that
``HPCTRAIN_FAILURE_FILE`` names, before the job ends (nothing when it is unset)::

    {"kind": "exception", "rank": 1, "host": "node07", "status": 1, "error": "RuntimeError",
     "message": "...", "collective": false, "pid": 4242, "timestamp": 1767139200.0}

``kind``: ``exception`` (one rank alone, the job is aborted), ``error`` (every rank raised the
same error; written by rank 0 only), ``hang`` (the watchdog; with ``phase`` and ``step`` when
the phase is a step), ``exit`` (``sys.exit`` on one rank alone). ``status``: the exit status
the failure ends the job with (:mod:`hpctrain.errors`: 2 bad input, 4 hung, 5 diverged, 1 other).
``hpctrain launch`` reads them (:mod:`hpctrain.job.diagnosis`).
"""
import json
import os
import time

from .. import settings
from .world import node_name


def record(kind, *, rank, host=None, status, error=None, message=None, step=None, phase=None,
           collective=False, environ=None):
    """Append one failure record to ``HPCTRAIN_FAILURE_FILE`` (if set). Never raises: it runs
    on the way to an abort, which must happen whatever the file system does."""
    path = settings.get("FAILURE_FILE", environ=environ)
    if not path:
        return
    entry = {"kind": kind, "rank": rank, "host": host or node_name(), "status": status,
             "error": error, "message": None if message is None else str(message)[:2000], "step": step,
             "phase": phase, "collective": bool(collective), "pid": os.getpid(), "timestamp": time.time()}
    try:
        line = (json.dumps(entry, default=str) + "\n").encode(errors="replace")
        # One write with O_APPEND: lines of ranks that fail together do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
    except Exception:  # noqa: BLE001 - the abort comes first
        pass


def read_records(path, offset=0):
    """The records appended to ``path`` after byte ``offset`` (a half-written line is skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    records = []
    for line in data.decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            records.append(entry)
    return records
