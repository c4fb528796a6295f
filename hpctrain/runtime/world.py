"""Who am I in the job: rank, size, local rank, node, launcher, detected in one place. The launcher's
environment (``mpirun``/``srun``) says what the job *should* be; MPI says what it *is*. :func:`init_world`
compares both and stops with a fix when they disagree, for example ``srun`` without ``--mpi=pmix``, where
every task believes it is rank 0 of 1. Example::

    world = init_world()          # MPI_COMM_WORLD by default
    print(world.rank, world.size, world.node, world.device)
"""
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import LaunchError
from . import slurm
from .system import usable_cpus


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher's environment variables say, before MPI is asked."""

    launcher: str  # "mpirun", "srun" or "none"
    rank: Optional[int] = None
    size: Optional[int] = None
    local_rank: Optional[int] = None
    slurm_job_id: Optional[str] = None
    slurm_ntasks: Optional[int] = None
    slurm_nodelist: Optional[str] = None


def launch_info(environ=None):
    """Read the launcher from the environment (pure: no MPI, no imports)."""
    env = os.environ if environ is None else environ
    job = slurm.environment(env)
    # mpirun (Open MPI) sets OMPI_COMM_WORLD_*; MPICH's hydra sets PMI_*. Inside a Slurm
    # allocation mpirun's ranks also inherit SLURM_* of the batch step: mpirun wins.
    if "OMPI_COMM_WORLD_SIZE" in env:
        return LaunchInfo("mpirun", slurm.first_int(env, "OMPI_COMM_WORLD_RANK"), slurm.first_int(env, "OMPI_COMM_WORLD_SIZE"),
                          slurm.first_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), **job)
    if slurm.task(env) is not None:
        return LaunchInfo("srun", *slurm.task(env), **job)
    if "PMI_SIZE" in env or "PMIX_RANK" in env:
        return LaunchInfo("mpirun", slurm.first_int(env, "PMI_RANK", "PMIX_RANK"), slurm.first_int(env, "PMI_SIZE"),
                          slurm.first_int(env, "MPI_LOCALRANKID"), **job)
    return LaunchInfo("none", **job)


def launch_of(environ):
    """``(launch, rank)``: which launch a rank's environment belongs to (mpirun's PMIx namespace, "" where none
    is set) and its rank in it (None where unknown)."""
    return environ.get("PMIX_NAMESPACE", ""), launch_info(environ).rank


def launch_problems(info, mpi_rank, mpi_size):
    """Why the MPI world disagrees with the launcher, as messages with a HINT (pure)."""
    problems = []
    if info.launcher == "srun" and info.size and info.size > 1 and mpi_size == 1:
        problems.append(
            f"srun started {info.size} tasks but MPI sees a world of size 1 in each: every task "
            f"believes it is rank 0 of 1 and would train alone.\n"
            f"HINT: launch with `srun --mpi=pmix ...` (see `srun --mpi=list`), or use mpirun inside the allocation")
    elif info.size is not None and info.size != mpi_size:
        problems.append(
            f"{info.launcher} says the job has {info.size} ranks but MPI_COMM_WORLD has {mpi_size}.\n"
            f"HINT: the MPI library that mpi4py was built against must be the one that launched the job "
            f"(check `which mpirun` and `hpctrain doctor`)")
    elif info.rank is not None and info.size == mpi_size and info.rank != mpi_rank:
        problems.append(
            f"{info.launcher} says this is rank {info.rank} but MPI says rank {mpi_rank}.\n"
            f"HINT: use the mpirun of the MPI that mpi4py was built against")
    if info.launcher == "none" and info.slurm_ntasks and info.slurm_ntasks > 1 and mpi_size == 1:
        problems.append(
            f"running inside Slurm job {info.slurm_job_id} that asked for {info.slurm_ntasks} tasks, "
            f"but as a single process without srun or mpirun.\n"
            f"HINT: start the script with `srun --mpi=pmix python ...` or `mpirun -n {info.slurm_ntasks} ...`")
    return problems


# Set in each task by `srun --mpi=pmix` (PMIX_*) or `--mpi=pmi2` (PMI_*); absent with --mpi=none.
PMI_VARIABLES = ("PMIX_RANK", "PMI_RANK", "PMI_FD")


def problems_before_mpi(info, environ=None):
    """Launch mistakes that make MPI_Init itself fail, so they must be caught before it (pure). Verified with
    Open MPI 4.1 under Slurm 22.05: a task of a plain `srun` step (no PMI plug-in) dies inside MPI_Init
    ("direct launched using srun, but OMPI was not built with SLURM's PMI support"), whatever the task count;
    the size check below never runs."""
    env = os.environ if environ is None else environ
    if info.launcher == "srun" and not any(name in env for name in PMI_VARIABLES):
        return [
            f"started by srun (Slurm job {info.slurm_job_id}, {info.size or 1} task(s)) without an MPI "
            f"plug-in: MPI cannot form the job from this step.\n"
            f"HINT: launch with `srun --mpi=pmix ...` (see `srun --mpi=list`), or use mpirun inside the allocation"]
    return []


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``comm`` is the mpi4py communicator."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node: str
    launcher: str
    comm: Any = field(default=None, repr=False, compare=False)
    device: str = "cpu"

    @property
    def is_root(self):
        return self.rank == 0

    def where(self):
        """``rank 3 on node07``: used in every message that names a rank."""
        return f"rank {self.rank} on {self.node}"


def node_name(environ=None):
    return slurm.slurmd_node(environ) or socket.gethostname()


def cpu_threads_per_rank(local_size, environ=None):
    """Torch threads per rank so that the ranks on one node do not oversubscribe it."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS"):
        return max(1, int(env["OMP_NUM_THREADS"]))
    usable = usable_cpus()
    cores = os.cpu_count() or 1
    if usable < cores:  # the launcher bound this rank to a subset: use exactly that
        return max(1, usable)
    return max(1, cores // max(1, local_size))


# Open MPI's ranks spin on their core while they wait in MPI. Horovod's background thread waits that way in
# every cycle, on the core the training thread needs when a rank has one. Measured here (2 ranks, one core
# each): an idle Horovod made a matrix-multiply loop 1.3-1.9x slower, and the 25M-parameter training step took
# 312-334 ms against 215-216 ms; with the waits yielding the core, the loop did not slow, and MPI's own
# latencies (8 B - 64 MiB) did not change (docs/performance.md). Open MPI reads this when MPI starts.
YIELD_VARIABLE = "OMPI_MCA_mpi_yield_when_idle"
_mpi_note = None  # what mpi_defaults() did, for the run's first lines


def mpi_defaults(environ=None, mpi_started=None):
    """Set hpctrain's MPI settings in ``environ`` (the process's) where the user has not,
    before MPI starts; returns a phrase for the run's first lines."""
    env = os.environ if environ is None else environ
    if YIELD_VARIABLE in env:
        return f"MPI waits: {YIELD_VARIABLE}={env[YIELD_VARIABLE]} (as set)"
    if mpi_started is None:
        mpi = sys.modules.get("mpi4py.MPI")
        mpi_started = mpi is not None and mpi.Is_initialized()
    if mpi_started:
        return (f"MPI waits spin: MPI started before hpctrain could set {YIELD_VARIABLE}=1 "
                f"(export it in the job script, or import hpctrain before mpi4py's MPI)")
    env[YIELD_VARIABLE] = "1"
    return f"MPI waits yield the core (hpctrain's default; {YIELD_VARIABLE} sets it)"


def mpi_settings():
    """What :func:`init_world` did with MPI's settings, a phrase the trainer logs; None before it ran."""
    return _mpi_note


def init_world(comm=None, pin=True, check=True):
    """Initialise MPI (through mpi4py), check the launch, pin this rank to its device; raises
    :class:`~hpctrain.errors.LaunchError` when the launcher and MPI disagree."""
    global _mpi_note
    from . import allocator, startup

    startup.mark("imports")  # the interpreter, hpctrain and what it imported: the start-up before MPI
    allocator.tune()  # before the model and its buffers are allocated
    info = launch_info()
    if check and problems_before_mpi(info):
        raise LaunchError("\n".join(problems_before_mpi(info)))
    if _mpi_note is None:
        _mpi_note = mpi_defaults()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    problems = launch_problems(info, rank, size) if check and comm == MPI.COMM_WORLD else []
    if problems:
        raise LaunchError("\n".join(problems))
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    prepare_object_reductions(comm)
    device = pin_device(local_rank, local_size) if pin else "cpu"
    startup.mark("mpi")
    return World(rank, size, local_rank, local_size, node_name(), info.launcher, comm, device)


def prepare_object_reductions(*comms):
    """Collective: set up each communicator for mpi4py's object reductions (``comm.allreduce``) now.

    mpi4py duplicates a communicator the first time an object reduction runs on it, collectively and holding
    the GIL. In the middle of training that deadlocks: a rank whose replicas have finished their Horovod
    all-reduce blocks there with the GIL, so its Horovod thread cannot free a tensor and stops answering the
    whole job's negotiation, which the ranks of another process set still wait on (seen with split models).
    hpctrain calls this where it makes a communicator, before Horovod starts."""
    for comm in comms:
        comm.allreduce(0)


def pin_device(local_rank, local_size):
    """``cuda:<local_rank>`` when there are GPUs; else set torch threads for this rank."""
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    torch.set_num_threads(cpu_threads_per_rank(local_size))
    return "cpu"
