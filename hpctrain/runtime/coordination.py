"""Rank-0 coordination and failure handling, expressed once. A step that fails on one rank fails on every rank
(:func:`on_root`, :func:`all_or_none`, :func:`raise_if_any`) or aborts the whole job, rank and host named
(:func:`abort_on_exception`), so no rank is ever left waiting in a collective that another skipped. Failure
records (:func:`record`): what a failing rank appends, machine-readably, to the file ``HPCTRAIN_FAILURE_FILE``
names, before the job ends (nothing when it is unset)::

    {"kind": "exception", "rank": 1, "host": "node07", "status": 1, "error": "RuntimeError",
     "message": "...", "collective": false, "pid": 4242, "timestamp": 1767139200.0}

``kind``: ``exception`` (one rank alone, the job is aborted), ``error`` (every rank raised the same error;
written by rank 0 only), ``hang`` (the watchdog; with ``phase`` and ``step`` when the phase is a step),
``exit`` (``sys.exit`` on one rank alone). ``status``: the exit status the failure ends the job with
(:mod:`hpctrain.errors`). ``hpctrain launch`` reads them (:mod:`hpctrain.job.diagnosis`)."""
import contextlib
import json
import logging
import os
import pickle
import sys
import time
import traceback

from .. import settings
from ..errors import HpctrainError, RemoteError
from .world import node_name

log = logging.getLogger("hpctrain")


def _say(text):
    """One write per message: ranks share the launcher's stderr, and print() writes the
    newline apart, so two ranks' messages could run together on one line."""
    sys.stderr.flush()
    os.write(2, (text + "\n").encode(errors="replace"))


def _describe(rank, exc):
    return f"rank {rank} on {node_name()}: {type(exc).__name__}: {exc}"


def everywhere(exc):
    """Mark an exception as raised on every rank alike (after a collective that told every rank the
    same), so :func:`abort_on_exception` ends the ranks normally instead of aborting the job.

    >>> raise everywhere(CheckpointError("no valid checkpoint"))   # doctest: +SKIP
    """
    exc.collective = True
    return exc


def _pack(exc, rank):
    """(exception, text) that survives pickling to the other ranks."""
    text = _describe(rank, exc)
    try:
        pickle.loads(pickle.dumps(exc))
        return (exc, text)
    except Exception:  # unpicklable exception: send its text
        return (RemoteError(text), text)


def _raise_everywhere(failed_rank, exc, text, comm):
    if comm.Get_rank() == failed_rank or isinstance(exc, HpctrainError):
        raise everywhere(exc)
    raise everywhere(RemoteError(f"failed on {text}"))


def on_root(step, comm, root=0):
    """Run ``step()`` on ``root`` only; every rank returns its result or raises its error.

    >>> name = on_root(lambda: choose_checkpoint_name(), comm)   # doctest: +SKIP
    """
    outcome = None
    if comm.Get_rank() == root:
        try:
            outcome = (True, step())
        except Exception as exc:  # handed to every rank below
            outcome = (False, _pack(exc, root))
            original = exc
    ok, payload = comm.bcast(outcome, root=root)
    if ok:
        return payload
    if comm.Get_rank() == root:
        raise everywhere(original)
    _raise_everywhere(root, payload[0], payload[1], comm)


def all_or_none(step, comm):
    """Run ``step()`` on every rank and return this rank's result; if it fails anywhere, raise on every
    rank. Used for validation before any collective, so bad input fails the same way everywhere."""
    try:
        result, mine = step(), None
    except Exception as exc:
        result, mine = None, exc
    outcome = comm.allgather(None if mine is None else _pack(mine, comm.Get_rank()))
    if mine is not None:
        raise everywhere(mine)
    for rank, packed in enumerate(outcome):
        if packed is not None:
            _raise_everywhere(rank, packed[0], packed[1], comm)
    return result


def raise_if_any(errors, comm, make_error):
    """Collective, for steps that keep going after a failure (collective I/O must): every rank passes the
    messages of what failed on it (often none); if any did, every rank raises ``make_error(problems)``, marked
    :func:`everywhere`: ``problems`` holds every rank's messages in rank order, prefixed with rank and host.

    >>> raise_if_any(errors, comm, lambda problems: CheckpointError("\\n".join(problems)))  # doctest: +SKIP
    """
    mine = [f"rank {comm.Get_rank()} on {node_name()}: {e}" for e in errors]
    problems = [p for rank_list in comm.allgather(mine) for p in rank_list]
    if problems:
        raise everywhere(make_error(problems))


def any_rank(flag, comm):
    """True on every rank when ``flag`` is true on at least one."""
    from mpi4py import MPI

    return bool(comm.allreduce(1 if flag else 0, op=MPI.MAX))


def abort_job(comm, code=1):
    """End every rank of the job now."""
    sys.stdout.flush()
    sys.stderr.flush()
    if comm is not None and comm.Get_size() > 1:
        comm.Abort(code)
    os._exit(code)


def _exit_status(exc):
    """Non-zero status to abort on ``SystemExit(code)``, ``sys.exit(0)`` too: the others were not done."""
    return exc.code if isinstance(exc.code, int) and not isinstance(exc.code, bool) and exc.code > 0 else 1


def _record_failure(exc, rank, host, collective):
    """The failure, for a supervisor (``HPCTRAIN_FAILURE_FILE``): by the rank that failed, once (rank 0)
    for a user error every rank raised alike; not by ranks that only learnt of another's (``RemoteError``)."""
    if isinstance(exc, RemoteError) or (isinstance(exc, SystemExit) and collective):
        return  # an error already recorded further in, or a normal exit status
    if collective and rank != 0 and isinstance(exc, HpctrainError):
        return
    if isinstance(exc, SystemExit):
        kind, status = "exit", _exit_status(exc)
    else:
        kind = "error" if collective else "exception"
        status = getattr(exc, "exit_code", 1) if collective else 1
    record(kind, rank=rank, host=host, status=status, error=type(exc).__name__, message=exc, collective=collective)


@contextlib.contextmanager
def abort_on_exception(comm, where=None):
    """Log an exception with rank and host, then abort the whole job (if it has >1 rank) with a non-zero
    status. Anything that leaves the block on one rank alone ends every rank, since the others may be waiting
    for it in a collective: any exception or ``BaseException`` (``KeyboardInterrupt``, ``sys.exit(code)``,
    ``sys.exit(0)`` included: leave the block normally instead). Known user errors (:class:`HpctrainError`)
    are printed without a traceback. When the error is raised on every rank alike (as
    :func:`on_root`/:func:`all_or_none` arrange, or ``raise everywhere(SystemExit(code))``), the ranks exit
    normally with its code instead.

    >>> with abort_on_exception(comm, where=world.node):    # doctest: +SKIP
    ...     train()
    """
    try:
        yield
    except BaseException as exc:  # noqa: B902 - we end the job on anything
        rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        host = where or node_name()
        collective = getattr(exc, "collective", False) or size == 1
        _record_failure(exc, rank, host, collective)
        if isinstance(exc, SystemExit):
            if collective:
                raise  # every rank leaves alike (or there is only one)
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            _say(f"hpctrain: rank {rank} ({host}) called sys.exit({exc.code!r}) alone; the other ranks "
                 f"would wait for it in a collective: aborting all {size} ranks\n{text}"
                 f"HINT: end every rank alike (return from the block, or raise "
                 f"coordination.everywhere(SystemExit(code)) on every rank)")
            abort_job(comm, _exit_status(exc))
        code = getattr(exc, "exit_code", 1)
        if isinstance(exc, HpctrainError):
            if not collective:
                _say(f"hpctrain: error on rank {rank} ({host}): {exc}")
            elif rank == 0:  # the same error on every rank: say it once
                _say(f"hpctrain: error: {exc}")
        elif not isinstance(exc, RemoteError):
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            ending = "" if collective else f"; aborting all {size} ranks"
            _say(f"hpctrain: unhandled exception on rank {rank} ({host}){ending}\n{text}")
        if not collective:
            abort_job(comm, 1)
        # every rank ends here alike: an enclosing abort_on_exception lets it through
        raise everywhere(SystemExit(code))


# ---------------------------------------------------------------- failure records
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
    with contextlib.suppress(Exception):  # the abort comes first
        line = (json.dumps(entry, default=str) + "\n").encode(errors="replace")
        # One write with O_APPEND: lines of ranks that fail together do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


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
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return [r for r in records if isinstance(r, dict)]
