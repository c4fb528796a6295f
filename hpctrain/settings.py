"""Every ``HPCTRAIN_*`` environment variable the hpctrain package reads, read through this module.

=========================  ================================================  ===========  ==============================
variable                   meaning                                           default      read by
=========================  ================================================  ===========  ==============================
HPCTRAIN_BACKEND           ``horovod`` or ``mpi``; beats the TOML file's     ``horovod``  ``config.loading``;
                           ``comm.backend``, loses to ``comm.backend=...``                ``commands.doctor``
HPCTRAIN_RUN_ROOT          where run directories go, when the config sets    ``./runs``   ``job.rundir``
                           neither ``run.run_dir`` nor ``run.root``
HPCTRAIN_CKPT_SERIAL       1: only rank 0 does checkpoint I/O (no MPI-IO)    0            ``checkpoint.commit``
HPCTRAIN_WATCHDOG_TIMEOUT  seconds a step or another collective phase      0 (off)      ``job.watchdog``;
                           may run before the job is aborted, when                        ``job.relaunch`` (warns
                           ``train.step_timeout`` is 0                                    when there is none)
HPCTRAIN_FAILURE_FILE      a file each failing rank appends one JSON line    unset        ``runtime.coordination``
                           to before the job ends (rank, host, kind,                      (``hpctrain launch`` sets
                           exit status, error, step)                                      it: ``RUN_DIR/failures.jsonl``)
HPCTRAIN_MALLOC            ``reuse``: glibc keeps large blocks for reuse     unset        ``runtime.allocator``
                           (faster steps, more memory kept)
=========================  ================================================  ===========  ==============================

The scripts around the package read their own: ``HPCTRAIN_CACHE`` and ``HPCTRAIN_BUILD_JOBS``
(``scripts/setup.sh``), ``HPCTRAIN_VENV``, ``HPCTRAIN_HOME`` (the site installation's prefix, set by
``module load hpctrain``: :mod:`hpctrain.install.modulefiles`), ``HPCTRAIN_RUN_ROOT``, ``HPCTRAIN_MAX_REQUEUES``,
``HPCTRAIN_MAX_STALLED_STARTS``, ``HPCTRAIN_MAX_RESTARTS`` and ``HPCTRAIN_LAUNCH_ARGS``
(``slurm/*.sbatch``); each is described where it is read.

Launcher variables describe the job, not hpctrain, and are read where they are interpreted:

* :mod:`hpctrain.runtime.world`: ``OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_RANK}``, ``PMI_{SIZE,RANK,FD}``,
  ``PMIX_RANK``, ``MPI_LOCALRANKID`` (launcher, rank, size) and ``OMP_NUM_THREADS`` (torch threads per rank);
* :mod:`hpctrain.runtime.slurm`: every ``SLURM_*`` variable and ``SLURMD_NODENAME`` (the job and step ids, a
  task's rank, the node list, the requeue id inside a job array, the restart count)."""
import os

PREFIX = "HPCTRAIN_"


def name(key):
    """The variable's whole name: ``HPCTRAIN_<key>``."""
    return PREFIX + key


def get(name, default=None, environ=None):
    """Value of ``HPCTRAIN_<name>``, or ``default``."""
    env = os.environ if environ is None else environ
    return env.get(PREFIX + name, default)


def get_bool(name, default=False, environ=None):
    value = get(name, None, environ)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
