"""What every launch of one ``hpctrain launch`` job runs (:class:`LaunchPlan`), made from its command line and
checked before anything starts (:func:`make_plan`): the launcher (``mpirun``, or ``srun`` inside an allocation),
the ranks, the run directory, the bounds on relaunches, the warm spares and the warm pool."""
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from .. import settings
from ..config import load_config, resolve_global_batch
from ..errors import ConfigError
from ..runtime import slurm
from . import rundir
from .launchers import Mpirun, Srun, say


def is_script(config):
    """A ``.py`` file is a training script run as it is; anything else a TOML configuration."""
    return str(config).endswith(".py")


@dataclass
class LaunchPlan:
    """What every launch of one job runs, and what the relaunches may change."""

    config: str
    overrides: List[str]
    run_dir: str
    checkpoint_dir: str
    launcher: object
    ranks: int
    hosts: Optional[dict] = None  # {host: slots} when known to span several hosts
    max_restarts: int = 3
    min_ranks: int = 1
    shrink: bool = False
    python: str = sys.executable
    global_batch: int = 0
    accumulation: int = 1
    lr_scaling: str = "none"
    excluded: list = field(default_factory=list)
    local_level: bool = False  # checkpoint.local: a relaunch may resume from a snapshot newer than any file
    spares: int = 0  # sets of warm spare ranks kept for the next relaunch (:mod:`.spares`)
    start_timeout: float = 0.0  # seconds a launch may take to get through start-up (0: no limit)
    spares_memory: float = 0.0  # MiB of resident memory a spare set may hold (0: any)
    warm_pool: bool = False  # this host's ranks forked from a process with their imports done (:mod:`.warmpool`)

    def rank_command(self, relaunch):
        # a Python script runs as it is, with the same overrides (it takes section.key=value)
        program = [self.config] if is_script(self.config) else ["-m", "hpctrain", "train", self.config]
        cmd = [self.python, *program, *self.overrides, f"run.run_dir={self.run_dir}"]
        if relaunch:
            cmd.append("checkpoint.resume=auto")  # the last override wins: resume what the failed launch saved
        return cmd

    @property
    def failure_file(self):
        return os.path.join(self.run_dir, rundir.FAILURE_FILE)

    @property
    def metrics_file(self):
        return os.path.join(self.run_dir, rundir.METRICS_FILE)


def make_plan(args, environ=None):
    """Everything a launch needs, checked before anything starts (ConfigError on bad input)."""
    env = os.environ if environ is None else environ
    # a script's own defaults are not known here: its overrides alone say what it will be told
    cfg = load_config(None if is_script(args.config) else args.config, args.overrides)
    if is_script(args.config) and not os.path.isfile(args.config):
        raise ConfigError(f"training script {args.config} does not exist",
                          hint="give the path of a Python script (relative to the working directory), "
                               "or a TOML configuration")
    if args.n is not None and args.n < 1:
        raise ConfigError(f"-n {args.n}: the ranks to start must be at least 1",
                          hint="e.g. hpctrain launch -n 2 CONFIG")
    extra = shlex.split(args.launcher_args or "")
    use_srun = args.launcher == "srun" or (args.launcher == "auto" and slurm.in_allocation(env))
    hosts = None
    if use_srun:
        allocated = slurm.allocated_tasks(env)
        ranks = args.n or allocated
        if not ranks:
            raise ConfigError("inside a Slurm allocation without SLURM_NTASKS, and no -n given",
                              hint="request tasks (sbatch --ntasks or --ntasks-per-node), or give -n RANKS")
        if allocated and ranks > allocated:
            raise ConfigError(f"-n {ranks} is more than the {allocated} tasks of this Slurm allocation",
                              hint=f"leave -n out (the allocation decides: {allocated}), or request more tasks")
        nodes = slurm.job_hosts(env)
        if nodes and len(nodes) > 1:
            hosts = {h: None for h in nodes}
        launcher = Srun(extra)
    else:
        if not args.n:
            raise ConfigError("no Slurm allocation, and -n RANKS was not given: how many ranks to start?",
                              hint="e.g. hpctrain launch -n 4 CONFIG (inside an allocation srun's tasks decide)")
        ranks = args.n
        launcher = Mpirun(extra)
    excluded = [h for h in getattr(args, "exclude", "").split(",") if h]
    if excluded and not (use_srun and hosts and set(hosts) - set(excluded)):
        raise ConfigError(f"--exclude {','.join(excluded)}: leaving nodes out needs srun in an allocation of "
                          f"several nodes, with some left (nodes here: {', '.join(hosts or []) or 'one'})",
                          hint="drop --exclude, or name nodes of this allocation")
    if (isinstance(launcher, Mpirun) and os.geteuid() == 0 and "--allow-run-as-root" not in extra
            and not settings.mpirun_root_allowed(env)):
        # mpirun refuses at once, every time (without its option or both of its variables): a relaunch would too
        raise ConfigError("running as root, and Open MPI's mpirun refuses to start ranks as root unless told to",
                          hint="run as an ordinary user, or export OMPI_ALLOW_RUN_AS_ROOT=1 "
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (or --mpirun-args=--allow-run-as-root)")
    if shutil.which(launcher.name, path=env.get("PATH")) is None:
        raise ConfigError(f"{launcher.name} is not on PATH: cannot start the ranks",
                          hint="load the MPI (or Slurm) module that hpctrain was built against, e.g. "
                               "`module load openmpi`, then launch again")
    if args.min_ranks < 1 or args.min_ranks > ranks:
        raise ConfigError(f"--min-ranks {args.min_ranks} must be between 1 and the {ranks} ranks started",
                          hint=f"e.g. --min-ranks {max(1, ranks // 2)}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0", hint="e.g. --max-restarts 3")
    if getattr(args, "start_timeout", 0) < 0:
        raise ConfigError(f"--start-timeout {args.start_timeout}: seconds must be >= 0 (0: no limit)",
                          hint="e.g. --start-timeout 600")
    if getattr(args, "spares_memory", 0) < 0:
        raise ConfigError(f"--spares-memory {args.spares_memory}: MiB must be >= 0 (0: not bounded)",
                          hint="e.g. --spares-memory 4096, or --spares 0 for no spares")
    if getattr(args, "spares", 0) not in (0, 1):
        raise ConfigError(f"--spares {args.spares}: the sets of warm spare ranks kept must be 0 or 1",
                          hint="--spares 1 (the default) keeps the next launch's ranks started; --spares 0 none")
    # warm spares only where a relaunch may come (under srun: a step of the allocation beside the running one)
    spares_kept = getattr(args, "spares", 0) if args.max_restarts else 0
    if cfg.train.global_batch_size:
        resolve_global_batch(cfg.train.global_batch_size, ranks, cfg.train.accumulation)
    run_dir = os.path.abspath(cfg.run.run_dir) if cfg.run.run_dir else rundir.new_path(cfg)
    overrides = [o for o in args.overrides if not o.strip().startswith("run.run_dir=")]
    if not cfg.train.step_timeout and not float(settings.get("WATCHDOG_TIMEOUT", environ=env) or 0):
        say("note: no watchdog (train.step_timeout = 0): a hung job is not ended, so not relaunched either.\n"
            "HINT: set train.step_timeout (seconds a step or a checkpoint save may take), e.g. train.step_timeout=600")
    return LaunchPlan(args.config, overrides, run_dir, rundir.checkpoint_dir(cfg, run_dir), launcher, ranks, hosts,
                      args.max_restarts, args.min_ranks, args.shrink, args.python or sys.executable,
                      cfg.train.global_batch_size, cfg.train.accumulation, cfg.train.lr_scaling, excluded,
                      cfg.checkpoint.local, spares_kept, float(getattr(args, "start_timeout", 0) or 0),
                      float(getattr(args, "spares_memory", 0) or 0),
                      # mpirun's ranks of `python -m hpctrain train` (the pool is that Python's, with its imports)
                      getattr(args, "warm_pool", False) and isinstance(launcher, Mpirun) and not is_script(args.config)
                      and args.python in (None, sys.executable))
