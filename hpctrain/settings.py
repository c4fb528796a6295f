"""Every environment variable hpctrain reads, in one place, all with the HPCTRAIN_ prefix.

=========================  ==================================================  =========
variable                   meaning                                             default
=========================  ==================================================  =========
HPCTRAIN_BACKEND           communication backend: ``horovod`` or ``mpi``        (config)
HPCTRAIN_RUN_ROOT          where run directories are created                    ./runs
HPCTRAIN_LOG_LEVEL         logging level (DEBUG, INFO, WARNING)                 INFO
HPCTRAIN_NO_ABORT          1: do not MPI_Abort on an unhandled exception        0
HPCTRAIN_CKPT_SERIAL       1: rank 0 writes/reads checkpoints alone (no MPI-IO) 0
HPCTRAIN_WATCHDOG_TIMEOUT  seconds a step may run before the job is aborted     0 (off)
=========================  ==================================================  =========

Launcher variables (``OMPI_COMM_WORLD_*``, ``PMI_*``, ``SLURM_*``) are read by
:mod:`hpctrain.world` alone, since they describe the launcher, not hpctrain.
"""
import os

PREFIX = "HPCTRAIN_"


def get(name, default=None, environ=None):
    """Value of ``HPCTRAIN_<name>``, or ``default``."""
    env = os.environ if environ is None else environ
    return env.get(PREFIX + name, default)


def get_bool(name, default=False, environ=None):
    value = get(name, None, environ)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
