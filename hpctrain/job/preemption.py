"""Preemption: a signal from Slurm becomes a flag; the trainer turns the flag into a checkpoint and exit
status :data:`EXIT_PREEMPTED` (3); the job script (``slurm/preemptible.sbatch``) then requeues the job with
``python -m hpctrain.job.preemption requeue`` (``scontrol requeue`` of this job, or of its
``<array job>_<task>`` id in a job array).

Slurm warns a job before its time limit or a preemption with a signal chosen in the job script
(``#SBATCH --signal=B:USR1@120``, or ``scancel --signal=USR1``), and sends SIGTERM when it ends the job. Both
only set a flag here: the handler does no I/O and no MPI, since it may run while this rank is inside a
collective. Only some ranks may get the signal, so the trainer agrees at the next step boundary::

    from hpctrain.job import preemption
    from hpctrain.runtime.coordination import any_rank

    preemption.install()                       # once, on every rank
    for batch in loader:
        ...
        if any_rank(preemption.stop_requested(), comm):
            save_checkpoint(requested=True)
            sys.exit(preemption.EXIT_PREEMPTED)
"""
import os
import shutil
import signal
import subprocess
import sys

from ..errors import EXIT_STOPPED, HpctrainError
from ..runtime import slurm

EXIT_PREEMPTED = EXIT_STOPPED  # the name job scripts and training scripts use
DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_requested_by = None  # number of the first signal received, or None
_previous = {}


def _handler(signum, frame):
    # Only an assignment: safe at any point of the interrupted code.
    global _requested_by
    if _requested_by is None:
        _requested_by = signum


def install(signals=DEFAULT_SIGNALS):
    """Turn ``signals`` into the stop flag on this rank; call from the main thread. Returns the signals
    installed. Calling it again keeps a signal already received, so the first step boundary stops.
    ``hpctrain train`` installs it first thing (``hpctrain.cli.main``), before torch, mpi4py and MPI start, so
    that a warning arriving while a rank is still starting sets the flag instead of killing the rank
    (SIGUSR1's default action, status 138 from srun); the trainer installs it again later."""
    for sig in signals:
        current = signal.getsignal(sig)
        if current is not _handler:
            _previous[sig] = current
            signal.signal(sig, _handler)
    return tuple(signals)


def uninstall():
    """Restore the handlers that :func:`install` replaced."""
    while _previous:
        sig, old = _previous.popitem()
        signal.signal(sig, old if old is not None else signal.SIG_DFL)


def stop_requested():
    """True once this rank received one of the installed signals."""
    return _requested_by is not None


def reason():
    """``"SIGUSR1"`` etc. for the first signal received, or ``None``."""
    return None if _requested_by is None else signal.Signals(_requested_by).name


def reset():
    """Forget a received signal (for tests, and after a checkpoint that handled it)."""
    global _requested_by
    _requested_by = None


class RequeueError(HpctrainError):
    """The job asked to be requeued but could not be."""


def requeue_if_possible(environ=None, scontrol=None, timeout=60):
    """Requeue this Slurm job with ``scontrol requeue``. Returns the job id requeued, or ``None`` (after
    saying why on stderr) when not running under Slurm. Raises :class:`RequeueError` when under Slurm but
    ``scontrol`` is missing or refuses (e.g. a job submitted with ``--no-requeue``): the checkpoint is
    saved, but the job would otherwise silently not come back."""
    env = os.environ if environ is None else environ
    job = slurm.job_id(env)
    if job is None:
        print("hpctrain: not running under Slurm (no SLURM_JOB_ID): nothing to requeue; "
              "resume by starting the same command again", file=sys.stderr, flush=True)
        return None
    scontrol = scontrol or shutil.which("scontrol", path=env.get("PATH"))
    if not scontrol:
        raise RequeueError(
            f"cannot requeue Slurm job {job}: `scontrol` is not on PATH ({env.get('PATH', '')})",
            hint="load the Slurm module in the job script, or resubmit it yourself; "
                 "the run resumes from its latest checkpoint")
    # Said before asking: Slurm ends this job as soon as the request is taken, often before
    # scontrol's answer is read, and a line printed after it would be lost with the job.
    print(f"hpctrain: requeueing Slurm job {job} (scontrol requeue)", file=sys.stderr, flush=True)
    try:
        proc = slurm.requeue(job, scontrol, timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RequeueError(f"`scontrol requeue {job}` failed: {exc}",
                           hint="resubmit the job script; the run resumes from its latest checkpoint")
    if proc.returncode != 0:
        raise RequeueError(
            f"`scontrol requeue {job}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}",
            hint="submit with `--requeue` (and check the cluster allows requeueing), or resubmit "
                 "the job script; the run resumes from its latest checkpoint")
    print(f"hpctrain: requeued Slurm job {job}", file=sys.stderr, flush=True)
    return job


def main(argv=None):
    """``python -m hpctrain.job.preemption requeue``: used by slurm/preemptible.sbatch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["requeue"]:
        print("usage: python -m hpctrain.job.preemption requeue\n"
              "requeue this Slurm job (scontrol requeue), as slurm/preemptible.sbatch does after exit status 3",
              file=sys.stderr)
        return 2
    try:
        requeued = requeue_if_possible()
    except RequeueError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0 if requeued else 1


if __name__ == "__main__":
    sys.exit(main())
