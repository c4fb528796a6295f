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
HPCTRAIN_LOST_NODES        nodes of this Slurm job found lost (commas): a    unset        ``job.runlock`` (the
                           run lock held there is stale                                   standby sets it)
HPCTRAIN_SPARE_CALL        in a warm spare rank: the file whose appearance   unset        ``job.spares``
                           calls it to go on (``hpctrain launch`` sets it)
HPCTRAIN_SPARE_OWNER       ``host:pid`` of the supervisor that started a     unset        ``job.spares``
                           spare set: its ranks end when it is gone
HPCTRAIN_SPARE_NICENESS    the niceness a spare rank started at the lowest   unset        ``job.spares``
                           priority returns to when called
HPCTRAIN_WARM_POOL         ``host:name`` of the warm pool a rank of that      unset        ``job.warmpool``
                           host is forked from (``hpctrain launch`` sets it)
HPCTRAIN_SURVIVOR          ``srun``: a task of this srun step listens for     unset        ``job.survivor``
                           ``hpctrain launch``'s question after a failure
                           (it sets it)
=========================  ================================================  ===========  ==============================

The scripts around the package read their own: ``HPCTRAIN_CACHE`` and ``HPCTRAIN_BUILD_JOBS``
(``scripts/setup.sh``), ``HPCTRAIN_VENV``, ``HPCTRAIN_HOME`` (the site installation's prefix, set by
``module load hpctrain``: :mod:`hpctrain.install.modulefiles`), ``HPCTRAIN_RUN_ROOT``, ``HPCTRAIN_MAX_REQUEUES``,
``HPCTRAIN_MAX_STALLED_STARTS``, ``HPCTRAIN_MAX_RESTARTS`` and ``HPCTRAIN_LAUNCH_ARGS``
(``slurm/*.sbatch``); each is described where it is read.

Other programs' variables that hpctrain only reads, read here too (:func:`mca`, :func:`horovod`,
:func:`loaded_modules`, :func:`mpirun_root_allowed`): ``{OMPI,PRTE}_ALLOW_RUN_AS_ROOT{,_CONFIRM}``
(``job.relaunch``: mpirun starts no rank as root without both), ``OMPI_MCA_odls_base_sigkill_timeout``
(``job.launchers``: the user's own grace before Open MPI kills the ranks of a failed launch is kept), ``HOROVOD_DYNAMIC_PROCESS_SETS``
(``backends.horovod_backend``: process sets added to a running Horovod) and ``LOADEDMODULES``
(``commands.doctor``: the modules loaded now, against the site installation's). Those that take effect when
a program or library is loaded (:func:`import_time_environment`: search paths, the thread counts of OpenMP and
the BLAS libraries, glibc's allocator settings, Python's hash seed and buffering) are compared by
``job.warmpool``, whose ranks inherit its imports.

Launcher variables describe the job, not hpctrain, and are read where they are interpreted, as are the
defaults hpctrain sets for MPI and Horovod where the user has not:

* :mod:`hpctrain.runtime.world`: ``OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_RANK}``, ``PMI_{SIZE,RANK,FD}``,
  ``PMIX_RANK``, ``MPI_LOCALRANKID`` (launcher, rank, size), ``OMP_NUM_THREADS`` (torch threads per rank) and
  ``OMPI_MCA_mpi_yield_when_idle`` (set to 1);
* :mod:`hpctrain.runtime.slurm`: every ``SLURM_*`` variable and ``SLURMD_NODENAME`` (the job and step ids, a
  task's rank, the node list, the requeue id inside a job array, the restart count);
* :mod:`hpctrain.backends.horovod_backend`: ``HOROVOD_CYCLE_TIME`` (set to 0.2 ms)."""
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
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def mca(param, environ=None):
    """Open MPI's MCA parameter ``param`` as the environment sets it (``OMPI_MCA_<param>``), or None."""
    return (os.environ if environ is None else environ).get("OMPI_MCA_" + param)


def mpirun_root_allowed(environ=None):
    """Whether Open MPI's variables let mpirun start ranks as root: ``OMPI_ALLOW_RUN_AS_ROOT`` and
    ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM`` both 1 (or, for Open MPI 5's launcher, ``PRTE_`` instead of ``OMPI_``)."""
    env = os.environ if environ is None else environ
    return any(all(env.get(f"{p}_ALLOW_RUN_AS_ROOT{s}") == "1" for s in ("", "_CONFIRM")) for p in ("OMPI", "PRTE"))


def horovod(key, environ=None):
    """Value of ``HOROVOD_<key>``, or None."""
    return (os.environ if environ is None else environ).get("HOROVOD_" + key)


def loaded_modules(environ=None):
    """``LOADEDMODULES`` (``a/1:b/2``, set by Lmod and Environment Modules), or None."""
    return (os.environ if environ is None else environ).get("LOADEDMODULES")


# Variables read when Python starts or a library loads, not later: a process forked after its imports keeps them.
IMPORT_TIME = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "LD_LIBRARY_PATH",
               "LD_PRELOAD", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GLIBC_TUNABLES",
               "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def import_time_environment(environ=None):
    """The values of :data:`IMPORT_TIME` in ``environ`` (this process's by default), those set."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in IMPORT_TIME if k in env}
