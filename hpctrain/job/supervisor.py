"""``hpctrain launch``: start the ranks of a training job, and relaunch it when it fails.

    hpctrain launch -n 4 examples/digits.toml train.global_batch_size=48     # mpirun -n 4 ...
    sbatch -N 4 --ntasks-per-node=8 --wrap "hpctrain launch --max-restarts 5 job.toml"  # srun --mpi=pmix

It trains as ``hpctrain train`` does, in one run directory that every launch is given
(``run.run_dir=...``), so that a relaunch resumes from the newest checkpoint
(``checkpoint.resume=auto``). Inside a Slurm allocation the ranks are started with
``srun --mpi=pmix`` (the allocation decides how many), elsewhere with ``mpirun -n RANKS``.

When a launch fails, the supervisor reads what failed: the ranks' own records in
``RUN_DIR/failures.jsonl`` (``HPCTRAIN_FAILURE_FILE``, see :mod:`hpctrain.job.failure`) and,
for a rank killed by a signal, which writes nothing, what mpirun or srun printed. Then:

* exit status 0: done; 3 (a requested stop, e.g. Slurm's warning signal): passed on, not
  restarted, so that a job script can requeue; 2 (bad input) and 5 (diverged): not restarted,
  the same run would fail the same way; it says so and exits with that status;
* anything else (an exception on one rank, a rank killed, a hang the watchdog ended, exit 4)
  is relaunched, at most ``--max-restarts`` times: without the failed node when the job spans
  several (``srun --exclude``, or an mpirun host list without it; not for a hang, which names
  no culprit: every rank's watchdog fires); on one node at the same size, or one rank fewer
  with ``--shrink``; never on fewer than ``--min-ranks``.

A node Slurm loses inside the allocation (``srun: error: Node failure on n3``, or a node Slurm
flags as not responding after the launch failed: one cut off from the network leaves the other
ranks hung, and the watchdog names no culprit) is the cause, whatever the ranks reported: the
relaunch leaves it out, once Slurm has marked it down or taken it out of the allocation.

With ``train.global_batch_size`` set, a relaunch on fewer ranks keeps the global batch, and so
the sample order and the training (``config.resolve_global_batch``: the per-rank batch or the
accumulation changes, and it is said); where it cannot, the supervisor relaunches on the
largest rank count that can, or stops saying what to set. Every restart is a ``restart``
record in ``metrics.jsonl`` (cause, rank, host, ranks before and after, steps lost), shown
by ``hpctrain report``; a run it gives up on ends with a ``launch_stop`` record.

A hang is ended only by the watchdog: set ``train.step_timeout`` (or ``HPCTRAIN_WATCHDOG_TIMEOUT``).
"""
import argparse
import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import HpctrainError
from . import failure as fail

PREFIX = "hpctrain launch"
FAILURE_FILE = "failures.jsonl"
METRICS_FILE = "metrics.jsonl"  # as monitoring.runlog writes it (not imported: that pulls numpy)
TAIL_BYTES = 64 * 1024  # of the launcher's output, kept to read which rank it says failed
# After a hang on several nodes, how long to wait for Slurm to flag a node that stopped answering
# (cut off from the network: its ranks hang like the others and srun names no node).
NODE_CHECK_SECONDS = 30
# ... and, once it is flagged, for Slurm to mark it down (after its SlurmdTimeout, 300 s by default).
NODE_DOWN_SECONDS = 600


def _say(text):
    sys.stderr.write(f"{PREFIX}: {text}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- launchers
class Mpirun:
    """``mpirun -n RANKS [--host h:k,...] -x HPCTRAIN_FAILURE_FILE [ARGS] CMD``. Open MPI's
    settings for root and oversubscription come from the environment (``OMPI_*``) or ``ARGS``."""

    name = "mpirun"

    def __init__(self, extra=()):
        self.extra = list(extra)

    def command(self, ranks, hosts, rank_cmd):
        """``hosts``: ``{host: slots}`` to use (``None``: mpirun's own default)."""
        cmd = ["mpirun", "-n", str(ranks)]
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{k}" for h, k in hosts.items())]
        return cmd + ["-x", "HPCTRAIN_FAILURE_FILE"] + self.extra + list(rank_cmd)


class Srun:
    """``srun --mpi=pmix --kill-on-bad-exit=1 -n RANKS [-N NODES --exclude=...] [ARGS] CMD``:
    one task that fails ends the step, as mpirun does."""

    name = "srun"

    def __init__(self, extra=()):
        self.extra = list(extra)

    def command(self, ranks, hosts, rank_cmd, excluded=()):
        cmd = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", str(ranks)]
        if excluded:
            cmd += [f"--exclude={','.join(excluded)}"]
            if hosts:
                cmd += ["-N", str(len(hosts))]
            # Slurm keeps a step that ran on a node it lost cut off (not killed) "running" until
            # that node answers again, holding the CPUs of the other nodes too: without --overlap
            # the relaunch waits for them ("Requested nodes are busy"). The old ranks are gone.
            cmd.append("--overlap")
        return cmd + self.extra + list(rank_cmd)


def in_slurm_allocation(environ=None):
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


# ---------------------------------------------------------------- the run directory
def _new_run_dir(cfg):
    """The directory ``job.rundir`` would create, fixed here so that every launch uses it."""
    from .. import settings

    root = cfg.run.root or settings.get("RUN_ROOT") or "runs"
    base = os.path.join(root, f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return os.path.abspath(path)


def _records(path, offset=0):
    return fail.read_records(path, offset)


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def newest_checkpoint_step(directory):
    """The step ``checkpoint.resume=auto`` starts from: the newest ``ckpt-<step>.h5`` (0: none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    steps = [int(m.group(1)) for n in names if (m := re.fullmatch(r"ckpt-(\d+)\.h5", n))]
    return max(steps, default=0)


# ---------------------------------------------------------------- one launch
@dataclass
class Attempt:
    returncode: int
    tail: str  # the end of the launcher's output (stdout and stderr)
    records: list  # the ranks' failure records of this launch
    metrics: list  # the metrics.jsonl records this launch wrote
    seconds: float


class _Tee(threading.Thread):
    """Copies one pipe of the launcher to ours, keeping its last bytes to read."""

    def __init__(self, pipe, out):
        super().__init__(daemon=True)
        self.pipe, self.out, self.tail = pipe, out, collections.deque()
        self.size = 0

    def run(self):
        for chunk in iter(lambda: self.pipe.read1(65536), b""):
            try:
                self.out.write(chunk)
                self.out.flush()
            except (OSError, ValueError):
                pass
            self.tail.append(chunk)
            self.size += len(chunk)
            while self.size > TAIL_BYTES and len(self.tail) > 1:
                self.size -= len(self.tail.popleft())

    def text(self):
        return b"".join(self.tail).decode(errors="replace")


# ---------------------------------------------------------------- the plan
@dataclass
class Plan:
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

    def rank_command(self, relaunch):
        # a Python script runs as it is, with the same overrides (it takes section.key=value)
        program = [self.config] if is_script(self.config) else ["-m", "hpctrain", "train", self.config]
        cmd = [self.python, *program, *self.overrides, f"run.run_dir={self.run_dir}"]
        if relaunch:
            cmd.append("checkpoint.resume=auto")  # the last override wins: resume what the failed launch saved
        return cmd

    @property
    def failure_file(self):
        return os.path.join(self.run_dir, FAILURE_FILE)

    @property
    def metrics_file(self):
        return os.path.join(self.run_dir, METRICS_FILE)


def is_script(config):
    """A ``.py`` file is a training script run as it is; anything else a TOML configuration."""
    return str(config).endswith(".py")


def _slurm_hosts(environ):
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


DOWN_STATES = ("down", "drain", "drng", "fail")


def node_states(sinfo_text):
    """``{node: state}`` from ``sinfo -h -N -o "%N %t"`` (pure); a ``*`` after the state: the
    node does not answer Slurm."""
    states = {}
    for line in sinfo_text.splitlines():
        name, _, state = line.strip().partition(" ")
        if name:
            states[name] = state.strip()
    return states


def unresponsive_nodes(sinfo_text, nodes):
    """The nodes of ``nodes`` that ``sinfo -h -N -o "%N %t"`` shows down, failing, drained or not
    responding, in ``nodes``' order (pure)."""
    states = node_states(sinfo_text)
    return [n for n in nodes if n in states and (states[n].endswith("*") or states[n].startswith(DOWN_STATES))]


def _sinfo(nodes):
    try:
        return subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _slurm_unresponsive(nodes):
    return unresponsive_nodes(_sinfo(nodes), nodes)


def _slurm_state(node):
    return node_states(_sinfo([node])).get(node, "")


def _left_allocation(node, job_id):
    """True once Slurm has removed ``node`` from job ``job_id`` (a --no-kill job losing a node)."""
    if not job_id:
        return False
    try:
        nodelist = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    nodes = _slurm_hosts({"SLURM_JOB_NODELIST": nodelist}) if nodelist else None
    return nodes is not None and node not in nodes


def make_plan(args, environ=None):
    """Everything a launch needs, checked before anything starts (ConfigError on bad input)."""
    from ..config import load_config, resolve_global_batch
    from ..errors import ConfigError

    env = os.environ if environ is None else environ
    # a script's own defaults are not known here: its overrides alone say what it will be told
    cfg = load_config(None if is_script(args.config) else args.config, args.overrides)
    if is_script(args.config) and not os.path.isfile(args.config):
        raise ConfigError(f"training script {args.config} does not exist",
                          hint="give the path of a Python script (relative to the working directory), "
                               "or a TOML configuration")
    extra = shlex.split(args.launcher_args or "")
    use_srun = args.launcher == "srun" or (args.launcher == "auto" and in_slurm_allocation(env))
    hosts = None
    if use_srun:
        allocated = int((env.get("SLURM_NTASKS") or "0").split("(")[0] or 0)
        ranks = args.n or allocated
        if not ranks:
            raise ConfigError("inside a Slurm allocation without SLURM_NTASKS, and no -n given",
                              hint="request tasks (sbatch --ntasks or --ntasks-per-node), or give -n RANKS")
        if allocated and ranks > allocated:
            raise ConfigError(f"-n {ranks} is more than the {allocated} tasks of this Slurm allocation",
                              hint=f"leave -n out (the allocation decides: {allocated}), or request more tasks")
        nodes = _slurm_hosts(env)
        if nodes and len(nodes) > 1:
            hosts = {h: None for h in nodes}
        launcher = Srun(extra)
    else:
        if not args.n:
            raise ConfigError("no Slurm allocation, and -n RANKS was not given: how many ranks to start?",
                              hint="e.g. hpctrain launch -n 4 CONFIG (inside an allocation srun's tasks decide)")
        ranks = args.n
        launcher = Mpirun(extra)
    if shutil.which(launcher.name, path=env.get("PATH")) is None:
        raise ConfigError(f"{launcher.name} is not on PATH: cannot start the ranks",
                          hint="load the MPI (or Slurm) module that hpctrain was built against, e.g. "
                               "`module load openmpi`, then launch again")
    if args.min_ranks < 1 or args.min_ranks > ranks:
        raise ConfigError(f"--min-ranks {args.min_ranks} must be between 1 and the {ranks} ranks started",
                          hint=f"e.g. --min-ranks {max(1, ranks // 2)}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0", hint="e.g. --max-restarts 3")
    if cfg.train.global_batch_size:
        resolve_global_batch(cfg.train.global_batch_size, ranks, cfg.train.accumulation)
    run_dir = os.path.abspath(cfg.run.run_dir) if cfg.run.run_dir else _new_run_dir(cfg)
    overrides = [o for o in args.overrides if not o.strip().startswith("run.run_dir=")]
    if not cfg.train.step_timeout and not float(env.get("HPCTRAIN_WATCHDOG_TIMEOUT") or 0):
        _say("note: no watchdog (train.step_timeout = 0): a hung job is not ended, so not relaunched either.\n"
             "HINT: set train.step_timeout (seconds a step or a checkpoint save may take), e.g. train.step_timeout=600")
    return Plan(args.config, overrides, run_dir, cfg.checkpoint.directory or os.path.join(run_dir, "checkpoints"),
                launcher, ranks, hosts, args.max_restarts, args.min_ranks, args.shrink,
                args.python or sys.executable, cfg.train.global_batch_size, cfg.train.accumulation,
                cfg.train.lr_scaling)


# ---------------------------------------------------------------- the supervisor
class Supervisor:
    """Runs :class:`Plan` launches until one succeeds, or a failure is not worth repeating."""

    def __init__(self, plan, environ=None):
        self.plan = plan
        self.environ = dict(os.environ if environ is None else environ)
        self.stop_signal = None  # a signal we were sent: passed on, and no relaunch after it
        self.child = None

    # -- signals: Slurm's warnings and Ctrl-C go to the ranks, and end the supervision
    def _forward(self, signum, frame):
        self.stop_signal = signum
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
            except OSError:
                pass

    def _install_signals(self):
        for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, self._forward)

    def command(self, ranks, relaunch):
        """The launcher's command line for ``ranks`` ranks, without the excluded nodes."""
        p = self.plan
        rank_cmd = p.rank_command(relaunch)
        if isinstance(p.launcher, Srun):
            hosts = [h for h in (p.hosts or {}) if h not in p.excluded]
            return p.launcher.command(ranks, hosts, rank_cmd, p.excluded)
        hosts = {h: k for h, k in (p.hosts or {}).items() if h not in p.excluded} if p.excluded else None
        return p.launcher.command(ranks, hosts, rank_cmd)

    def launch(self, ranks, relaunch):
        p = self.plan
        os.makedirs(p.run_dir, exist_ok=True)
        env = dict(self.environ, HPCTRAIN_FAILURE_FILE=p.failure_file)
        cmd = self.command(ranks, relaunch)
        offsets = _size(p.failure_file), _size(p.metrics_file)
        _say(f"{'relaunching' if relaunch else 'starting'} {ranks} rank(s): {shlex.join(cmd)}")
        started = time.monotonic()
        self.child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tees = [_Tee(self.child.stdout, sys.stdout.buffer), _Tee(self.child.stderr, sys.stderr.buffer)]
        for t in tees:
            t.start()
        returncode = self.child.wait()
        for t in tees:
            t.join(timeout=10)
        self.child = None
        return Attempt(returncode, tees[0].text() + "\n" + tees[1].text(), _records(p.failure_file, offsets[0]),
                       _records(p.metrics_file, offsets[1]), time.monotonic() - started)

    def run(self):
        p = self.plan
        self._install_signals()
        ranks, restarts = p.ranks, 0
        _say(f"run directory {p.run_dir}; up to {p.max_restarts} restart(s), at least {p.min_ranks} rank(s)")
        while True:
            attempt = self.launch(ranks, relaunch=restarts > 0)
            if attempt.returncode == 0:
                _say(f"done after {restarts} restart(s); run directory {p.run_dir}")
                return 0
            hosts = _job_hosts(attempt.metrics)
            failed = fail.diagnose(attempt.returncode, attempt.records, fail.launcher_events(attempt.tail), hosts)
            if failed.restartable and failed.cause != "node_failure" and self.stop_signal is None:
                failed = self._lost_node(failed, hosts)
            if self.stop_signal is not None:
                status = attempt.returncode if 0 < attempt.returncode < 128 else failed.status
                _say(f"stopped by signal {self.stop_signal} (passed on to the ranks): not restarted; "
                     f"exit status {status}")
                return status
            if not failed.restartable:
                return self._no_restart(failed)
            if restarts >= p.max_restarts:
                return self._give_up(failed, f"{restarts} restart(s) done, --max-restarts {p.max_restarts}: "
                                             f"not restarting again", restarts, ranks)
            after, why = self._next_ranks(failed, ranks, hosts)
            if after is None:
                return self._give_up(failed, why, restarts, ranks)
            if self.stop_signal is not None:  # sent while deciding: stop instead, for the job script to requeue
                _say(f"{failed.describe()}; stopped by signal {self.stop_signal} before relaunching: not restarted; "
                     f"exit status {fail.EXIT_STOPPED} (a new job resumes from the newest checkpoint)")
                return fail.EXIT_STOPPED
            restarts += 1
            self._record_restart(restarts, failed, ranks, after, attempt, why)
            ranks = after

    # -- decisions
    def _lost_node(self, failed, hosts):
        """``failed``, or a node failure when Slurm says one of the launch's nodes stopped answering.
        A node cut off from the network leaves every rank hung alike (the watchdog names no culprit)
        or failing in a collective with it, and srun may not name it: Slurm's node states do, after
        a while, so a hang waits up to NODE_CHECK_SECONDS for them."""
        p = self.plan
        if not isinstance(p.launcher, Srun):
            return failed
        spread = sorted(set(hosts)) if hosts else [h for h in (p.hosts or {}) if h not in p.excluded]
        if len(spread) < 2:
            return failed
        deadline = time.monotonic() + (NODE_CHECK_SECONDS if failed.cause == "hang" else 0)
        while True:
            lost = _slurm_unresponsive(spread)
            if lost:
                break
            if time.monotonic() >= deadline:
                return failed
            time.sleep(2)
        node = lost[0]
        _say(f"{failed.describe()}; Slurm reports node {node} not responding")
        # Until Slurm marks the node down and takes it out of the allocation (SlurmdTimeout), a new
        # step cannot start ("Requested nodes are busy", then fails as the node is removed).
        started = time.monotonic()
        said = None
        job_id = self.environ.get("SLURM_JOB_ID")
        while not (state := _slurm_state(node)).startswith(DOWN_STATES) and not _left_allocation(node, job_id):
            waited = time.monotonic() - started
            if waited >= NODE_DOWN_SECONDS:
                break
            if said is None or waited - said >= 30:
                said = waited
                _say(f"waiting up to {NODE_DOWN_SECONDS - waited:.0f} s more for Slurm to mark node {node} down "
                     f"or remove it from the job before relaunching (its state: {state or '?'})")
            time.sleep(2)
        return fail.Failure("node_failure", fail.EXIT_OTHER, True, host=node, step=failed.step, source="slurm")

    def _no_restart(self, failed):
        why = {"bad_input": "a configuration or data error: the same error would repeat. Fix it (see the HINT above) "
                            "and launch again",
               "diverged": "training diverged (non-finite values the policy could not recover from): the same run "
                           "would diverge again. Lower train.lr or add train.warmup_steps, then launch again "
                           "(it resumes from the newest checkpoint)",
               "stopped": "stopped on request after saving (exit status 3): passed on so that the job script "
                          "can requeue"}.get(failed.cause, "not worth repeating")
        _say(f"{failed.describe()}: not restarted: {why}")
        self._write_metrics({"kind": "launch_stop", "restarted": False, "reason": failed.cause, "why": why,
                             **_failure_fields(failed)})
        return failed.status

    def _give_up(self, failed, why, restarts, ranks):
        text = f"{failed.describe()}; giving up: {why}"
        _say(text)
        self._write_metrics({"kind": "launch_stop", "restarted": False, "reason": "exhausted", "why": why,
                             "restarts": restarts, "ranks": ranks, **_failure_fields(failed)})
        return failed.status if failed.status not in (0, fail.EXIT_STOPPED) else fail.EXIT_OTHER

    def _next_ranks(self, failed, ranks, hosts):
        """(ranks to relaunch on, what was decided) or (None, why not)."""
        p = self.plan
        spread = sorted(set(hosts)) if hosts else sorted(h for h in (p.hosts or {}) if h not in p.excluded)
        after, why = ranks, "same size"
        # A hang names no culprit (every rank's watchdog fires, each in a collective): same nodes.
        if len(spread) > 1 and failed.host in spread and failed.cause != "hang":
            lost = hosts.count(failed.host) if hosts else max(1, ranks // len(spread))
            p.excluded.append(failed.host)
            if p.hosts is None or isinstance(p.launcher, Mpirun):
                counts = collections.Counter(hosts or [])
                p.hosts = {h: counts[h] or (p.hosts or {}).get(h) for h in spread if h not in p.excluded}
            after, why = ranks - lost, f"without node {failed.host} ({lost} rank(s))"
        elif p.shrink and failed.rank is not None:
            after, why = ranks - 1, f"without rank {failed.rank}'s slot (--shrink)"
        if after < p.min_ranks:
            return None, (f"{after} rank(s) would remain, fewer than --min-ranks {p.min_ranks}")
        if p.global_batch and after != ranks:
            fits = self._fitting_ranks(after)
            if fits is None:
                from ..config import resolve_global_batch

                try:
                    resolve_global_batch(p.global_batch, after, p.accumulation)
                except HpctrainError as exc:
                    return None, f"cannot keep the global batch on {after} rank(s): {exc}"
            if fits != after:
                why += f"; train.global_batch_size = {p.global_batch} does not divide over {after}: {fits} rank(s)"
                after = fits
        return after, why

    def _fitting_ranks(self, most):
        """The largest rank count in [min_ranks, most] the global batch divides over, or None."""
        from ..config import resolve_global_batch

        p = self.plan
        for r in range(most, p.min_ranks - 1, -1):
            try:
                resolve_global_batch(p.global_batch, r, p.accumulation)
                return r
            except HpctrainError:
                continue
        return None

    def _record_restart(self, n, failed, before, after, attempt, why):
        p = self.plan
        steps = [r["step"] for r in attempt.metrics if isinstance(r.get("step"), int)]
        failed_step = max(steps, default=None)
        if failed.step is not None:  # a hang names the step in progress
            failed_step = max(failed_step or 0, failed.step - 1)
        resume = newest_checkpoint_step(p.checkpoint_dir)
        lost = None if failed_step is None else max(0, failed_step - resume)
        changes = []
        if after != before:
            if p.global_batch:
                from ..config import resolve_global_batch

                batch, accumulation, note = resolve_global_batch(p.global_batch, after, p.accumulation)
                changes.append(f"global batch {p.global_batch} kept: {batch} per rank x {after} ranks x "
                               f"{accumulation}" + (f" ({note})" if note else ""))
            else:
                changes.append("train.global_batch_size is not set: the global batch changes with the rank count, "
                               "so the training is not the one of the first launch (set train.global_batch_size "
                               "to keep it)")
            if p.lr_scaling == "linear":
                changes.append(f"train.lr_scaling = \"linear\": the learning rate is train.lr x {after} now, not "
                               f"x {before} (set train.lr_scaling = \"none\" and the learning rate you want to "
                               f"keep the training the same on any number of ranks)")
        _say(f"{failed.describe()}; restart {n} of at most {p.max_restarts}: {before} -> {after} rank(s) ({why}); "
             f"resuming from step {resume}, {'?' if lost is None else lost} step(s) lost"
             + "".join(f"; {c}" for c in changes))
        self._write_metrics({"kind": "restart", "restart": n, "cause": failed.cause, **_failure_fields(failed),
                             "ranks_before": before, "ranks_after": after, "decision": why,
                             "excluded": list(p.excluded), "failed_step": failed_step, "resume_step": resume,
                             "steps_lost": lost, "launch_seconds": round(attempt.seconds, 3),
                             "changes": changes})

    def _write_metrics(self, record):
        record = {**record, "timestamp": time.time()}
        try:
            os.makedirs(self.plan.run_dir, exist_ok=True)
            with open(self.plan.metrics_file, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        except OSError as exc:
            _say(f"warning: could not append to {self.plan.metrics_file}: {exc}")


def _failure_fields(failed):
    return {k: getattr(failed, k) for k in ("rank", "host", "status", "signal", "error", "step", "source")} | \
        {"description": failed.describe()}


def _job_hosts(metrics):
    """The host of every rank, from the last ``start`` record of the launch (None before it)."""
    starts = [r for r in metrics if r.get("kind") == "start" and r.get("hosts")]
    return list(starts[-1]["hosts"]) if starts else None


# ---------------------------------------------------------------- the command
def build_parser():
    parser = argparse.ArgumentParser(
        prog=PREFIX, description="Start the ranks of `hpctrain train` (srun --mpi=pmix inside a Slurm "
                                 "allocation, else mpirun) and relaunch the job from its newest checkpoint "
                                 "when it fails.",
        epilog="example: hpctrain launch -n 4 --max-restarts 3 --shrink examples/digits.toml "
               "train.global_batch_size=48 train.step_timeout=300. Set train.global_batch_size to keep the "
               "training the same on fewer ranks, and train.step_timeout to have a hang ended and relaunched.")
    parser.add_argument("-n", type=int, default=None, metavar="RANKS",
                        help="ranks to start (outside Slurm; inside an allocation its tasks decide)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="N", help="relaunches at most (default 3)")
    parser.add_argument("--min-ranks", type=int, default=1, metavar="M",
                        help="stop rather than relaunch on fewer ranks (default 1)")
    parser.add_argument("--shrink", action="store_true",
                        help="on one node, relaunch without a failed rank's slot (one rank fewer)")
    parser.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                        help="auto: srun inside a Slurm allocation, else mpirun")
    parser.add_argument("--launcher-args", "--mpirun-args", "--srun-args", dest="launcher_args", default="",
                        metavar="ARGS", help="more arguments for mpirun or srun, one string "
                                             "(e.g. --mpirun-args='--oversubscribe --bind-to none')")
    parser.add_argument("--python", default=None, help="the Python the ranks run (default: this one)")
    parser.add_argument("config", help="TOML configuration file, or a Python training script (.py) that takes "
                                       "section.key=value overrides")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override a configuration value, e.g. train.lr=0.05")
    return parser


def main(argv=None):
    """0 done; 2 bad input (never restarted); 3 stopped on request (passed on); 5 diverged (not
    restarted); otherwise the status of the last failure when restarts ran out."""
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except HpctrainError as exc:
        _say(f"error: {exc}\nnot started (and nothing would be restarted: the same error would repeat)")
        return exc.exit_code
    return Supervisor(plan).run()


if __name__ == "__main__":
    sys.exit(main())
