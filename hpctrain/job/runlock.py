"""One job per run directory (and per checkpoint directory): a lock file that a second job pointed at the
same directory runs into, with who holds it and how to proceed, before anything is overwritten.

The lock file ``.hpctrain.lock`` holds its owner: Slurm job, step and restart count, host, pid (with the
process start time, so a reused pid is not mistaken for the owner) and a random token naming this one
holding. A lock is taken over, not refused, when its owner is evidently gone (but a second live step of the
same allocation, ``srun`` twice on one run directory, is refused):

* a process of this host that no longer exists (a crash, ``kill -9``; also exited but not yet reaped, or
  its pid now used by another process),
* an earlier run of the same Slurm job (requeued: a higher ``SLURM_RESTART_COUNT``, or the same step id,
  which a live job never gives twice),
* another step of the same Slurm job that ``squeue --steps`` no longer lists (the batch step, which lives
  as long as the job, only when it was on this host and has exited), or one on a node that Slurm has taken
  out of the job (a ``--no-kill`` job that lost the node: its step may still be listed, or even still run
  there cut off, but it can no longer reach this allocation),
* a Slurm job that ``squeue`` no longer lists as pending or running.

How the lock is taken, and what that relies on (plain POSIX names, so NFS and Lustre too):

* **Creating** a free lock: the owner record is written and fsynced under a private name, then
  ``link``\\ ed to ``.hpctrain.lock``. ``link`` fails with ``EEXIST`` when the name is taken, atomically,
  on local file systems, NFSv3+ and Lustre; the lock never exists half-written. (A retransmitted NFS
  ``link`` can report ``EEXIST`` for a link it made: the private file's link count then says so.)
* **Taking over** a stale lock with token ``T``: first create ``.hpctrain.lock.claim-T`` with
  ``O_CREAT | O_EXCL`` (atomic on NFSv3+ and Lustre). Exactly one process can create it, and only it replaces
  the lock file (``rename`` of its own record over it); the others look again and find the new, live owner.
* **Releasing** uses the same claim: the owner creates ``claim-T`` of its own token before removing the lock
  file. So while the lock file holds ``T``, only the one process holding ``claim-T`` may change or remove it,
  and a process that judged ``T`` stale a moment ago cannot replace a lock created after ``T`` was released.
* Claims are kept for :data:`CLAIM_KEEP` seconds (judged by the file server's clock) and a judgement older
  than a quarter of that is made again, so no claim is removed while a process could still act on the
  judgement that it guards.
* Nothing relies on ``flock``/``fcntl`` locks (missing or local-only on some parallel file systems) or on
  clocks agreeing between hosts.

Rank 0 takes the lock inside :func:`hpctrain.job.rundir.create`, and releases it (``release(run_dir)``,
which also frees the checkpoint directory's lock) at the end."""
import contextlib
import json
import logging
import os
import secrets
import socket
import time

from .. import settings
from ..errors import HpctrainError
from ..runtime import fsutil, slurm
from ..runtime.system import proc_state

log = logging.getLogger("hpctrain")

LOCK_NAME = ".hpctrain.lock"
CLAIM_MARK = ".claim-"
NEW_MARK = ".new-"


class RunDirBusy(HpctrainError):
    """Another job is using this run directory (or checkpoint directory)."""


# How long a lock held by a process of this host outside Slurm that is just ending (a rank
# that mpirun is still tearing down after a crash) may take to go away before it counts as busy.
SETTLE_SECONDS = 10.0
# Seconds a takeover claim is kept; see the module docstring.
CLAIM_KEEP = 600.0


def _owner(environ=None):
    step, restart = slurm.step_of(environ)
    return {"slurm_job": slurm.job_id(environ), "slurm_step": step, "slurm_restart": restart,
            "slurm_node": slurm.slurmd_node(environ), "host": socket.gethostname(), "pid": os.getpid(),
            "proc_start": proc_state(os.getpid())[1], "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "token": secrets.token_hex(8)}


def _lost_nodes(environ=None):
    """The nodes this job's standby found lost (``HPCTRAIN_LOST_NODES``, comma-separated)."""
    return [n for n in (settings.get("LOST_NODES", "", environ) or "").split(",") if n]


def _pid_alive(pid, proc_start=None):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True  # exists but not ours, or unreadable: assume alive
    state, start = proc_state(pid)
    # gone: exited but not yet reaped (Z, X), or the pid now belongs to another process
    return state not in ("Z", "X") and (proc_start is None or start is None or start == proc_start)


def stale_reason(holder, me):
    """Why the lock of ``holder`` may be taken over by ``me``, or ``None`` if it may not."""
    pid, host, job = holder.get("pid"), holder.get("host"), holder.get("slurm_job")
    if host == me.get("host") and pid is not None:
        # On this host the process table is the truth, whatever Slurm job it belongs to.
        return None if _pid_alive(pid, holder.get("proc_start")) else f"process {pid} on {host} no longer exists"
    if job and job == me.get("slurm_job"):
        if "slurm_step" not in holder:  # written by an older hpctrain: assume requeued, as it did
            return f"same Slurm job {job} (requeued or restarted)"
        if int(holder.get("slurm_restart") or 0) < me.get("slurm_restart", 0):
            return f"Slurm job {job} was requeued; the run that took the lock is gone"
        if holder.get("slurm_step") == me.get("slurm_step"):
            return f"same Slurm job {job} and step (restarted)"
        node = holder.get("slurm_node")
        if node and node != me.get("slurm_node") and node in _lost_nodes():
            return f"this job's standby found {node} lost"  # before Slurm does (hpctrain.job.standby)
        if node and node != me.get("slurm_node") and slurm.left_allocation(node, job):
            # a --no-kill job that lost the node: nothing of this job runs there for Slurm any more
            return f"Slurm took {node} out of job {job}"
        if str(holder.get("slurm_step")).endswith(".batch"):
            return None  # the batch step lives as long as the job (and is on another host)
        if not slurm.step_active(holder.get("slurm_step")):
            return f"step {holder.get('slurm_step')} of Slurm job {job} has ended"
        return None  # another live step of this very allocation
    if job and not slurm.job_active(job):
        return f"Slurm job {job} is no longer running"
    return None


def _describe(holder):
    step = f" step {holder['slurm_step']}" if holder.get("slurm_step") else ""
    job = f"Slurm job {holder['slurm_job']}{step}, " if holder.get("slurm_job") else ""
    run = f" for run directory {holder['run_dir']}" if holder.get("run_dir") else ""
    return f"{job}pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}{run}"


def _busy_error(directory, holder, me, kind):
    path = os.path.join(directory, LOCK_NAME)
    same_job = holder.get("slurm_job") and holder.get("slurm_job") == me.get("slurm_job")
    other_step = same_job and holder.get("slurm_step") and holder.get("slurm_step") != me.get("slurm_step")
    what = "run directory" if kind == "run" else "checkpoint directory"
    text = f"{what} {directory} is in use by {_describe(holder)}"
    if other_step:
        text += " (another step of this job, still running)"
    elif same_job:
        text += " (another launch in the same step of this job, still running)"
    fix = ("give this run its own directory (run.run_dir)" if kind == "run" else
           "give this run its own checkpoint.directory, or leave it unset to use <run directory>/checkpoints")
    if other_step:
        fix += f", or let step {holder['slurm_step']} end first (scancel {holder['slurm_step']} stops it)"
    return RunDirBusy(text, hint=f"{fix}; if that job is really gone, delete {path}")


def _read(path):
    """(holder dict, token) of the lock file (``FileNotFoundError`` when there is none). A
    lock file from an older hpctrain without a token is named by its inode."""
    with open(path) as f:
        st = os.fstat(f.fileno())
        holder = json.load(f)
    return holder, holder.get("token") or f"i{st.st_ino}"


def _create_exclusive(path):
    """Create ``path`` empty with ``O_EXCL``; False if it exists."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def _link_new(record_path, path):
    """``link`` the private record to the lock name; True if this made the lock."""
    try:
        os.link(record_path, path)
        return True
    except FileExistsError:
        # NFS: a retransmitted link request answers EEXIST although the first one linked.
        return os.stat(record_path).st_nlink == 2


def _remove_old_claims(directory, reference_path):
    """Remove claims older than CLAIM_KEEP, timed by a file just written here (the file server's clock)."""
    try:
        now = os.stat(reference_path).st_mtime
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(LOCK_NAME + CLAIM_MARK):
            claim = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if now - os.stat(claim).st_mtime > CLAIM_KEEP:
                    os.unlink(claim)


def _lock_one(directory, me, kind):
    """Take the lock of one directory for ``me``; raises :class:`RunDirBusy`."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    record = path + NEW_MARK + me["token"]
    with open(record, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        return _take(directory, path, record, me, kind)
    finally:
        with contextlib.suppress(FileNotFoundError):  # linked, renamed into place, or refused
            os.unlink(record)


def _take(directory, path, record, me, kind):
    settle_until = time.monotonic() + SETTLE_SECONDS
    deadline = settle_until + 20.0
    unreadable_since = claimed_since = None
    while time.monotonic() < deadline:
        if _link_new(record, path):
            fsutil.fsync_path(directory, directory=True)
            _remove_old_claims(directory, path)
            return path
        try:
            holder, token = _read(path)
            judged_at = time.monotonic()
        except FileNotFoundError:
            continue  # released meanwhile: try again
        except (OSError, ValueError):
            # Only an older hpctrain wrote lock files in place; give it a moment to finish.
            unreadable_since = unreadable_since or time.monotonic()
            if time.monotonic() - unreadable_since > 2.0:
                raise RunDirBusy(f"{kind} directory {directory} has an unreadable lock file {path}",
                                 hint=f"if no job uses {directory}, delete {path}")
            time.sleep(0.1)
            continue
        if token == me["token"]:
            return path
        reason = stale_reason(holder, me)
        if (reason is None and not holder.get("slurm_job") and holder.get("host") == me["host"]
                and time.monotonic() < settle_until):
            # maybe a crashed mpirun job's rank 0, still being torn down (squeue tells of a Slurm job's end)
            time.sleep(0.25)
            continue
        if reason is None:
            raise _busy_error(directory, holder, me, kind)
        if time.monotonic() - judged_at > CLAIM_KEEP / 4:
            continue  # judged too long ago (a hung squeue): its claim may be gone, look again
        # Stale. Only the one process that creates this holding's claim may replace it.
        if _create_exclusive(path + CLAIM_MARK + token):
            log.warning("taking over the lock of %s directory %s from %s: %s", kind, directory,
                        _describe(holder), reason)
            os.replace(record, path)
            fsutil.fsync_path(directory, directory=True)
            _remove_old_claims(directory, path)
            return path
        # Someone else is taking it over (or its owner is releasing it): look again.
        claimed_since = claimed_since or time.monotonic()
        if time.monotonic() - claimed_since > 5.0:
            raise RunDirBusy(
                f"{kind} directory {directory}: the lock of {_describe(holder)} is stale, but the "
                f"takeover {path + CLAIM_MARK + token} started by another process never finished",
                hint=f"if no job uses {directory}, delete {path} and {path + CLAIM_MARK + token}")
        time.sleep(0.05)
    raise RunDirBusy(f"could not take the lock of {kind} directory {directory}: it keeps changing hands",
                     hint="give this run its own directory")


def acquire(run_dir, environ=None, checkpoint_dir=None):
    """Take the lock of ``run_dir`` (created if missing) and, when given and elsewhere, of ``checkpoint_dir``
    for the same holder; returns the run directory lock file's path. Raises :class:`RunDirBusy` naming the
    holder when another live job holds either; then nothing is held.

    >>> runlock.acquire("runs/a", checkpoint_dir="/scratch/ckpt")   # doctest: +SKIP
    >>> runlock.release("runs/a")        # frees both  # doctest: +SKIP
    """
    me = _owner(environ)
    me["run_dir"] = os.path.abspath(run_dir)
    same = checkpoint_dir and os.path.realpath(checkpoint_dir) == os.path.realpath(run_dir)
    me["also"] = others = [os.path.abspath(checkpoint_dir)] if checkpoint_dir and not same else []
    path = _lock_one(run_dir, me, "run")
    try:
        for directory in others:
            _lock_one(directory, me, "checkpoint")
    except BaseException:
        release(path, environ)
        raise
    return path


def _release_one(path, token):
    """Remove lock ``path`` if it holds ``token``, through the claim (see the module docstring)."""
    try:
        holder, held = _read(path)
    except (OSError, ValueError):
        return
    if held != token or not _create_exclusive(path + CLAIM_MARK + token):
        return  # not ours (taken over), or being taken over right now
    fsutil.remove_quietly(path)


def release(path, environ=None):
    """Release the lock (``path``, or the run directory holding it) if it is still this process's, and the
    checkpoint directory's lock taken with it. (``environ`` is unused: ownership is this process.)"""
    if os.path.isdir(path):
        path = os.path.join(path, LOCK_NAME)
    try:
        holder, token = _read(path)
    except (OSError, ValueError):
        return
    if holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
        return
    for directory in holder.get("also") or []:
        _release_one(os.path.join(directory, LOCK_NAME), token)
    _release_one(path, token)
