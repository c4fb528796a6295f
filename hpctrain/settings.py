"""Every ``HPCTRAIN_*`` environment variable the hpctrain package reads, read through this module.

=========================  ================================================  ===========  ==============================
variable                   meaning                                           default      read by
=========================  ================================================  ===========  ==============================
HPCTRAIN_BACKEND           communication backend: ``horovod`` or ``mpi``;    ``horovod``  ``config.load_config``;
                           overrides the TOML file's ``comm.backend`` (a                  ``doctor`` (is Horovod needed)
                           ``comm.backend=...`` override wins)
HPCTRAIN_RUN_ROOT          where run directories are created, when the       ``./runs``   ``job.rundir``
                           config sets neither ``run.run_dir`` nor
                           ``run.root``
HPCTRAIN_CKPT_SERIAL       1: rank 0 writes/reads checkpoints alone          0            ``checkpoint.manager``
                           (no MPI-IO)
HPCTRAIN_WATCHDOG_TIMEOUT  seconds a step or another collective phase      0 (off)      ``job.watchdog``
                           may run before the job is aborted, when
                           ``train.step_timeout`` is 0
HPCTRAIN_FAILURE_FILE      a file each failing rank appends one JSON line    unset        ``coordination``,
                           to before the job ends (rank, host, kind,                      ``job.watchdog``
                           exit status, error, step); ``hpctrain launch``                 (written by
                           sets it to ``RUN_DIR/failures.jsonl``                          ``job.failure``)
=========================  ================================================  ===========  ==============================

The scripts around the package read their own: ``HPCTRAIN_CACHE`` and ``HPCTRAIN_BUILD_JOBS``
(``scripts/setup.sh``), ``HPCTRAIN_VENV``, ``HPCTRAIN_RUN_ROOT``, ``HPCTRAIN_MAX_REQUEUES``,
``HPCTRAIN_MAX_STALLED_STARTS``, ``HPCTRAIN_MAX_RESTARTS`` and ``HPCTRAIN_LAUNCH_ARGS``
(``slurm/*.sbatch``); each is described where it is read.

Launcher variables describe the job, not hpctrain, and are read where they are interpreted:

* :mod:`hpctrain.world`: ``OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_RANK}``, ``PMI_{SIZE,RANK,FD}``,
  ``PMIX_RANK``, ``MPI_LOCALRANKID``, ``SLURM_{JOB_ID,STEP_ID,PROCID,LOCALID,NTASKS,
  STEP_NUM_TASKS,STEP_NODELIST,JOB_NODELIST}`` and ``SLURMD_NODENAME`` (launcher, rank, size,
  node), and ``OMP_NUM_THREADS`` (torch threads per rank);
* :mod:`hpctrain.job.preemption`: ``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID`` and
  ``SLURM_ARRAY_TASK_ID`` (the id ``scontrol requeue`` takes; also the run lock's owner);
* :mod:`hpctrain.job.runlock`: ``SLURM_STEP_ID`` and ``SLURM_RESTART_COUNT`` (a second live
  step of a job is refused, a requeued job takes its lock over).
"""
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
