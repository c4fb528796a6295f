"""One job per run directory: a lock file that a second job pointed at the same directory
runs into, with who holds it and how to proceed, before anything is overwritten.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local and network file
systems alike, unlike ``flock`` on some parallel file systems) holding the owner's Slurm job
id, host and pid. A lock is taken over, not refused, when its owner is evidently gone:

* the same Slurm job (a requeued or restarted job resumes in its own run directory),
* the same host and the owning process no longer exists (a crash, ``kill -9``),
* a Slurm job that ``squeue`` no longer lists as pending or running.

Rank 0 takes the lock; every rank sees the outcome::

    from hpctrain import runlock

    with runlock.hold(run_dir, comm):
        train(...)

or, where rank 0 creates the run directory inside a coordinated step, ``acquire(run_dir)``
there before anything is written into it, and ``release(run_dir)`` on rank 0 at the end.
"""
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time

from .. import fsutil
from ..errors import HpctrainError
from .preemption import slurm_job_id

LOCK_NAME = ".hpctrain.lock"


class RunDirBusy(HpctrainError):
    """Another job is using this run directory."""


# How long a lock held by a process of this host outside Slurm that is just ending (a rank
# that mpirun is still tearing down after a crash) may take to go away before it counts as busy.
SETTLE_SECONDS = 10.0


def _proc_state(pid):
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or (None, None)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None, None


def _owner(environ=None):
    env = os.environ if environ is None else environ
    return {"slurm_job": slurm_job_id(env), "host": socket.gethostname(), "pid": os.getpid(),
            "proc_start": _proc_state(os.getpid())[1], "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _pid_alive(pid, proc_start=None):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True  # exists but not ours, or unreadable: assume alive
    state, start = _proc_state(pid)
    if state in ("Z", "X"):  # exited, not yet reaped
        return False
    if proc_start is not None and start is not None and start != proc_start:
        return False  # the pid now belongs to another process
    return True


def _slurm_job_active(job):
    """False when squeue positively says the job is not pending/running; True if unsure."""
    squeue = shutil.which("squeue")
    if not squeue or not job:
        return True
    try:
        proc = subprocess.run([squeue, "-h", "-j", str(job), "-o", "%T"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if proc.returncode != 0:
        return "Invalid job id" not in proc.stderr
    states = proc.stdout.split()
    return any(s in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")
               for s in states)


def stale_reason(holder, me):
    """Why the lock of ``holder`` may be taken over by ``me``, or ``None`` if it may not."""
    if holder.get("slurm_job") and holder.get("slurm_job") == me.get("slurm_job"):
        return f"same Slurm job {me['slurm_job']} (requeued or restarted)"
    if holder.get("host") == me.get("host") and not _pid_alive(holder.get("pid"), holder.get("proc_start")):
        return f"process {holder.get('pid')} on {holder.get('host')} no longer exists"
    if holder.get("slurm_job") and not _slurm_job_active(holder["slurm_job"]):
        return f"Slurm job {holder['slurm_job']} is no longer running"
    return None


def _describe(holder):
    job = f"Slurm job {holder['slurm_job']}, " if holder.get("slurm_job") else ""
    return f"{job}pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"


def acquire(run_dir, environ=None):
    """Take the lock of ``run_dir`` (created if missing). Returns the lock file's path.

    Raises :class:`RunDirBusy` when another live job holds it.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_NAME)
    me = _owner(environ)
    settle_until = time.monotonic() + SETTLE_SECONDS
    for _ in range(3 + int(SETTLE_SECONDS / 0.25)):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    holder = json.load(f)
            except (OSError, ValueError):
                holder = {}  # being written right now, or garbage: look again
                time.sleep(0.2)
                try:
                    with open(path) as f:
                        holder = json.load(f)
                except FileNotFoundError:
                    continue
                except (OSError, ValueError):
                    raise RunDirBusy(f"run directory {run_dir} has an unreadable lock file {path}",
                                     hint=f"if no job uses {run_dir}, delete {path}")
            except FileNotFoundError:
                continue  # released meanwhile: try again
            reason = stale_reason(holder, me)
            if (reason is None and not holder.get("slurm_job") and holder.get("host") == me["host"]
                    and time.monotonic() < settle_until):
                # perhaps the rank 0 of a crashed mpirun job on this host, still being torn
                # down (a Slurm job's end is known from squeue instead)
                time.sleep(0.25)
                continue
            if reason is None:
                raise RunDirBusy(
                    f"run directory {run_dir} is in use by {_describe(holder)}",
                    hint=f"give this run its own directory; if that job is really gone, delete {path}")
            # Stale: replace it atomically, so two jobs taking over at once cannot both win.
            fsutil.write_text(path, json.dumps(me))
            with open(path) as f:
                if json.load(f) == me:
                    return path
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return path
    raise RunDirBusy(f"could not take the lock of run directory {run_dir}: it keeps changing hands",
                     hint="give this run its own directory")


def release(path, environ=None):
    """Remove the lock file (``path``, or the run directory holding it) if it is still ours."""
    if os.path.isdir(path):
        path = os.path.join(path, LOCK_NAME)
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return
    me = _owner(environ)
    if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
