"""``hpctrain launch``'s supervision: launch the job, read what failed, relaunch it or stop.

Every launch trains in one run directory (``run.run_dir=...``), so that a relaunch resumes
from the newest checkpoint (``checkpoint.resume=auto``). When a launch fails, the ranks' own
records (``RUN_DIR/failures.jsonl``) and, for a rank killed by a signal, which writes nothing,
what mpirun or srun printed say what failed (:mod:`.diagnosis`). Then:

* exit status 0: done; 3 (a requested stop, e.g. Slurm's warning signal or SIGTERM to the supervisor,
  which the ranks get as SIGUSR1: save, then stop): passed on, not restarted, so that a job
  script can requeue; 2 (bad input) and 5 (diverged): not restarted,
  the same run would fail the same way; it says so and exits with that status;
* anything else (an exception on one rank, a rank killed, a hang the watchdog ended, exit 4) is relaunched, at
  most ``--max-restarts`` times: without the failed node when the job spans several (``srun --exclude``, or an
  mpirun host list without it; not for a hang, which names no culprit: every rank's watchdog fires); on one
  node at the same size, or one rank fewer with ``--shrink``; never on fewer than ``--min-ranks``.

A node Slurm loses inside the allocation (``srun: error: Node failure on n3``, or one Slurm flags as not
responding after the launch failed: see :func:`lost_node`) is the cause, whatever the ranks reported: the
relaunch leaves it out, once Slurm has marked it down or taken it out of the allocation.

With ``train.global_batch_size`` set, a relaunch on fewer ranks keeps the global batch, and so the sample
order and the training (``config.resolve_global_batch``: the per-rank batch or the accumulation changes, and
it is said); where it cannot, the supervisor relaunches on the largest rank count that can, or stops saying
what to set. Every restart is a ``restart`` record in ``metrics.jsonl`` (cause, rank, host, ranks before and
after, steps lost), shown by ``hpctrain report``; a run it gives up on ends with a ``launch_stop`` record."""
import collections
import contextlib
import os
import shlex
import signal
import socket
import time

from .. import settings
from ..checkpoint.directory import newest_step
from ..config import resolve_global_batch
from ..errors import EXIT_OTHER, EXIT_STOPPED, HpctrainError
from ..runtime import slurm
from . import diagnosis, rundir, spares, warmpool
from .launchers import Mpirun, Srun, changed, run_launch, say
from .plan import is_script

# After a hang on several nodes, how long to wait for Slurm to flag a node that stopped answering (lost_node).
NODE_CHECK_SECONDS = 30
# ... and, once it is flagged, for Slurm to mark it down (after its SlurmdTimeout, 300 s by default).
NODE_DOWN_SECONDS = 600


class Supervisor:
    """Runs :class:`LaunchPlan` launches until one succeeds, or a failure is not worth repeating."""

    def __init__(self, plan, environ=None):
        self.plan = plan
        self.environ = dict(os.environ if environ is None else environ)
        self.stop_signal = None  # a signal we were sent: passed on, and no relaunch after it
        self.stop_passed_on = False  # it reached a launch's ranks (else it came between launches)
        self.child = None
        owner = {settings.name("SPARE_OWNER"): f"{socket.gethostname()}:{os.getpid()}"}
        self.pool = warmpool.Pool(plan.python, self.environ, say) if plan.warm_pool else None
        self.spares = spares.Spares(plan.spares, plan.run_dir, dict(self.environ, **self._launch_env(), **owner),
                                    lambda ranks: self.command(ranks, True, spare=True), say,
                                    int(plan.spares_memory * 2**20))

    # -- signals: Slurm's warning, its end-of-job SIGTERM and SIGINT end the supervision. The first reaches the
    # ranks as SIGUSR1, which mpirun (and srun) pass on untouched and the ranks take as "save, then stop"
    # (exit 3): SIGTERM itself makes mpirun kill them at once (odls_base_sigkill_timeout 0, set so that a
    # relaunch is quick), with nothing saved. A second signal goes on as it is: whoever sends it insists.
    def _forward(self, signum, frame):
        first = self.stop_signal is None
        self.stop_signal = signum
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(OSError):
                child.send_signal(signal.SIGUSR1 if first else signum)
                self.stop_passed_on = True

    def command(self, ranks, relaunch, spare=False):
        """The launcher's command line for ``ranks`` ranks, without the excluded nodes (``spare``: for a
        warm spare set, which mpirun tells where its call comes from; srun passes the environment on)."""
        p = self.plan
        rank_cmd = p.rank_command(relaunch)
        if isinstance(p.launcher, Srun):
            hosts = [h for h in (p.hosts or {}) if h not in p.excluded]
            # a relaunch's step, as the spare set's (the same command, to be called), runs beside other steps
            return p.launcher.command(ranks, hosts, rank_cmd, p.excluded, overlap=relaunch)
        hosts = {h: k for h, k in (p.hosts or {}).items() if h not in p.excluded} if p.excluded else None
        exports = (("SPARE_CALL", "SPARE_OWNER") if spare else ()) + (self.pool.exports if self.pool else ())
        return p.launcher.command(ranks, hosts, rank_cmd, exports)

    def _launch_env(self):
        asked = {settings.name("SURVIVOR"): "srun"} if isinstance(self.plan.launcher, Srun) else {}  # StepEnder asks
        return {settings.name("FAILURE_FILE"): self.plan.failure_file, **asked, **(self.pool.env() if self.pool else {})}

    def launch(self, ranks, relaunch):
        p = self.plan
        os.makedirs(p.run_dir, exist_ok=True)
        spare = self.spares.take(ranks) if relaunch else None
        cmd = spare.cmd if spare else self.command(ranks, relaunch)
        how = "calling the warm spares" if spare else "relaunching" if relaunch else "starting"
        say(f"{how} {ranks} rank(s): {shlex.join(cmd)}")
        self.spares.keep_ready(ranks, spares.training_started(p.metrics_file))
        # rank 0 writes the run's config.toml once imports and MPI are up (a script's ranks may never):
        # until then no watchdog guards the ranks, and a start-up that hangs (MPI's, the launcher's) is ended here
        up = changed(os.path.join(p.run_dir, rundir.CONFIG_FILE)) if not is_script(p.config) else None
        return run_launch(cmd, dict(self.environ, **self._launch_env()), p.failure_file, p.metrics_file,
                          lambda child: setattr(self, "child", child), launch=spare, up=up,
                          start_timeout=p.start_timeout)

    def run(self):
        try:
            return self._supervise()
        finally:
            self.spares.close()
            if self.pool:
                self.pool.close()

    def _supervise(self):
        p = self.plan
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._forward)
        ranks, restarts = p.ranks, 0
        bound = f"at most {p.spares_memory:g} MiB (--spares-memory)" if p.spares_memory else \
            "not bounded (--spares-memory MiB bounds it)"
        kept = (f"; {p.spares} set of warm spare ranks for the next relaunch, started once training runs "
                f"(memory: about what the ranks hold at start-up, said once up, {bound}; --spares 0: none)") \
            if p.spares else ""
        say(f"run directory {p.run_dir}; up to {p.max_restarts} restart(s), at least {p.min_ranks} rank(s){kept}")
        if self.pool:  # before the first launch: its ranks are forked from it too
            self.pool.start()
            self.pool.wait_up()
            if self.stop_signal is not None:  # sent while it came up: nothing started, nothing to save
                say(f"stopped by signal {self.stop_signal} before the first launch; exit status {EXIT_STOPPED}")
                return EXIT_STOPPED
        while True:
            attempt = self.launch(ranks, relaunch=restarts > 0)
            if attempt.returncode == 0:
                say(f"done after {restarts} restart(s); run directory {p.run_dir}")
                return 0
            said, kept = self.pool.settle() if self.pool else attempt.survivors  # a survivor's state, before a resume
            for line in said:
                say(line)
            hosts = _job_hosts(attempt.metrics)
            failed = diagnosis.stalled(attempt.stalled) if attempt.stalled else \
                diagnosis.diagnose(attempt.returncode, attempt.records, diagnosis.launcher_events(attempt.tail), hosts)
            if failed.restartable and failed.cause != "node_failure" and self.stop_signal is None:
                failed = lost_node(p, failed, hosts, slurm.environment(self.environ)["slurm_job_id"])
            if self.stop_passed_on:  # the ranks were asked to save: their status says if they did
                status = attempt.returncode if 0 < attempt.returncode < 128 else failed.status
                say(f"stopped by signal {self.stop_signal} (passed on to the ranks as a request to save and "
                    f"stop): not restarted; exit status {status}")
                return status
            if not failed.restartable:
                return self._no_restart(failed)
            if restarts >= p.max_restarts:
                return self._give_up(failed, f"{restarts} restart(s) done, --max-restarts {p.max_restarts}: "
                                             f"not restarting again", restarts, ranks)
            after, why = next_ranks(p, failed, ranks, hosts)
            if after is None:
                return self._give_up(failed, why, restarts, ranks)
            if self.stop_signal is not None:  # sent while deciding: stop instead, for the job script to requeue
                say(f"{failed.describe()}; stopped by signal {self.stop_signal} before relaunching: not restarted; "
                    f"exit status {EXIT_STOPPED} (a new job resumes from the newest checkpoint)")
                return EXIT_STOPPED
            restarts += 1
            text, record = restart_record(p, restarts, failed, ranks, after, attempt, why, kept)
            say(text)
            self._write_metrics(record)
            ranks = after

    def _no_restart(self, failed):
        why = {"bad_input": "a configuration or data error: the same error would repeat. Fix it (see the HINT above) "
                            "and launch again",
               "diverged": "training diverged (non-finite values the policy could not recover from): the same run "
                           "would diverge again. Lower train.lr or add train.warmup_steps, then launch again "
                           "(it resumes from the newest checkpoint)",
               "stopped": "stopped on request after saving (exit status 3): passed on so that the job script "
                          "can requeue"}.get(failed.cause, "not worth repeating")
        say(f"{failed.describe()}: not restarted: {why}")
        self._write_metrics({"kind": "launch_stop", "restarted": False, "reason": failed.cause, "why": why,
                             **_failure_fields(failed)})
        return failed.status

    def _give_up(self, failed, why, restarts, ranks):
        say(f"{failed.describe()}; giving up: {why}")
        self._write_metrics({"kind": "launch_stop", "restarted": False, "reason": "exhausted", "why": why,
                             "restarts": restarts, "ranks": ranks, **_failure_fields(failed)})
        return failed.status if failed.status not in (0, EXIT_STOPPED) else EXIT_OTHER

    def _write_metrics(self, record):
        rundir.append_metrics(self.plan.run_dir, record, say)


# ---------------------------------------------------------------- the decisions
def lost_node(p, failed, hosts, job_id):
    """``failed``, or a node failure when Slurm says one of the launch's nodes stopped answering.
    A node cut off from the network leaves every rank hung alike (the watchdog names no culprit)
    or failing in a collective with it, and srun may not name it: Slurm's node states do, after
    a while, so a hang waits up to NODE_CHECK_SECONDS for them."""
    if not isinstance(p.launcher, Srun):
        return failed
    spread = sorted(set(hosts)) if hosts else [h for h in (p.hosts or {}) if h not in p.excluded]
    if len(spread) < 2:
        return failed
    deadline = time.monotonic() + (NODE_CHECK_SECONDS if failed.cause == "hang" else 0)
    while True:
        lost = slurm.unresponsive_nodes(slurm.sinfo(spread), spread)
        if lost:
            break
        if time.monotonic() >= deadline:
            return failed
        time.sleep(2)
    node = lost[0]
    say(f"{failed.describe()}; Slurm reports node {node} not responding")
    # Until the node is down or out of the job, a new step waits ("Requested nodes are busy"), then fails.
    started, said = time.monotonic(), None
    while not (state := slurm.node_state(node)).startswith(slurm.DOWN_STATES) and not slurm.left_allocation(node,
                                                                                                          job_id):
        if state and not state.endswith("*"):  # it answers Slurm again: slow for a while (a loaded node), not lost
            say(f"node {node} answers Slurm again (its state: {state}): relaunching with it")
            return failed
        waited = time.monotonic() - started
        if waited >= NODE_DOWN_SECONDS:
            break
        if said is None or waited - said >= 30:
            said = waited
            say(f"waiting up to {NODE_DOWN_SECONDS - waited:.0f} s more for Slurm to mark node {node} down "
                f"or remove it from the job before relaunching (its state: {state or '?'})")
        time.sleep(2)
    return diagnosis.Failure("node_failure", EXIT_OTHER, True, host=node, step=failed.step, source="slurm")


def next_ranks(p, failed, ranks, hosts):
    """(ranks to relaunch on, what was decided) or (None, why not); leaves a failed node out of
    ``p`` (its ``excluded`` and ``hosts``)."""
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
        fits = fitting_ranks(p, after)
        if fits is None:
            try:
                resolve_global_batch(p.global_batch, after, p.accumulation)
            except HpctrainError as exc:
                return None, f"cannot keep the global batch on {after} rank(s): {exc}"
        if fits != after:
            why += f"; train.global_batch_size = {p.global_batch} does not divide over {after}: {fits} rank(s)"
            after = fits
    return after, why


def fitting_ranks(p, most):
    """The largest rank count in [min_ranks, most] the global batch divides over, or None."""
    for r in range(most, p.min_ranks - 1, -1):
        try:
            resolve_global_batch(p.global_batch, r, p.accumulation)
            return r
        except HpctrainError:
            continue
    return None


def restart_record(p, n, failed, before, after, attempt, why, kept=None):
    """``(line to say, metrics.jsonl record)`` of the ``n``-th restart; ``kept``: the step a survivor wrote."""
    failed_step = max((r["step"] for r in attempt.metrics if isinstance(r.get("step"), int)), default=None)
    if failed.step is not None:  # a hang names the step in progress
        failed_step = max(failed_step or 0, failed.step - 1)
    resume = max(newest_step(p.checkpoint_dir), kept or 0)
    lost = None if failed_step is None else max(0, failed_step - resume)
    changes = []
    if after != before:
        if p.global_batch:
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
    text = (f"{failed.describe()}; restart {n} of at most {p.max_restarts}: {before} -> {after} rank(s) ({why}); "
            + (f"resuming from step {resume} (a survivor's state), {'?' if lost is None else lost} step(s) lost"
               if kept is not None and resume == kept else
               f"resuming from step {resume} (the newest checkpoint file) or a newer node-local snapshot, "
               f"{'?' if lost is None else lost} step(s) lost at most" if p.local_level else
               f"resuming from step {resume}, {'?' if lost is None else lost} step(s) lost")
            + "".join(f"; {c}" for c in changes))
    return text, {"kind": "restart", "restart": n, "cause": failed.cause, **_failure_fields(failed),
                  "ranks_before": before, "ranks_after": after, "decision": why, "excluded": list(p.excluded),
                  "failed_step": failed_step, "resume_step": resume, "steps_lost": lost, "kept_step": kept,
                  "launch_seconds": round(attempt.seconds, 3), "launch_ended": attempt.ended or None,
                  "changes": changes}


def _failure_fields(failed):
    return {k: getattr(failed, k) for k in ("rank", "host", "status", "signal", "error", "step", "source")} | \
        {"description": failed.describe()}


def _job_hosts(metrics):
    """The host of every rank, from the last ``start`` record of the launch (None before it)."""
    starts = [r for r in metrics if r.get("kind") == "start" and r.get("hosts")]
    return list(starts[-1]["hosts"]) if starts else None
