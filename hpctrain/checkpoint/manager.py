"""A run's checkpoints: when to save, the saves (in the foreground or the background), and where to resume.
Every public call is collective: all ranks call it with the same arguments. Rank 0 makes the decisions (name,
time, retention) through :func:`~hpctrain.runtime.coordination.on_root`, so every rank sees the same result or
the same exception. Each save goes through the one pipeline of :mod:`.commit`; which rank writes which part of
the file is the planner's (:class:`~.replicated.DataParallelPlanner` by default, a split model's own otherwise).
"""
import logging
import os
import time

from .. import settings
from ..errors import CheckpointError
from ..runtime.coordination import everywhere, on_root
from ..runtime.system import usable_cpus
from . import commit, directory
from .background import BackgroundWriter, threads_ok
from .content import format as fmt
from .content.plan import check_finite
from .interval import AutoInterval
from .io import iosettings
from .local.level import LocalLevel
from .planners.replicated import DataParallelPlanner
from .policy import save_reason

log = logging.getLogger("hpctrain.checkpoint")


class CheckpointManager:
    """Checkpoints of one run in ``directory``. All methods are collective.

    >>> mgr = CheckpointManager(run_dir / "checkpoints", world, cfg.checkpoint, run_config)  # doctest: +SKIP
    >>> mgr.resume(state)                                        # doctest: +SKIP
    >>> for step in ...:
    ...     mgr.maybe_save(state, epoch_end=..., metrics={"val_loss": 0.3})  # doctest: +SKIP
    >>> mgr.maybe_save(state, final=True); mgr.close()           # doctest: +SKIP
    """

    def __init__(self, directory, world, cfg, run_config=None, planner=None):
        self.directory = os.path.abspath(os.fspath(directory))
        self.world, self.comm, self.cfg, self.run_config = world, world.comm, cfg, run_config
        self.planner = planner or DataParallelPlanner(self.comm, cfg.consistency)
        self.parallel, forced = (True, False) if self.planner.collective_only else commit.io_mode(self.comm)
        if world.is_root:
            _warn_about_io(self.parallel, forced, world.size, cfg.async_save)
        # the files' layout and MPI-IO hints, from the directory's file system (rank 0's view)
        self.io = on_root(lambda: iosettings.io_settings_for(
            self.directory, getattr(cfg, "alignment", 0), getattr(cfg, "io_hints", None),
            getattr(cfg, "direct_io", False)), self.comm)
        self.retention = commit.Retention(self.directory, cfg)
        self.background = BackgroundWriter(self.comm)
        self._last_step = self.last_path = None
        self._last_time = time.monotonic()  # rank 0's clock is the one that counts
        # checkpoint.auto_interval: rank 0's estimator (fed and asked inside on_root only); with the
        # node-local level (checkpoint.local, its own estimator) each level has half the overhead budget
        local = getattr(cfg, "local", False)
        share = 0.5 if local else 1.0
        self.interval = (AutoInterval(cfg.max_overhead * share, cfg.mtbf_hours, cfg.every_steps, cfg.every_minutes)
                         if getattr(cfg, "auto_interval", False) else None)
        self.local = LocalLevel(cfg, self.directory, world, share) if local else None

    # -- resume

    def resume(self, state):
        """Load the checkpoint ``cfg.resume`` names into ``state``; True if one was loaded. ``"auto"``: the
        newest checkpoint of the directory (abandoned branches are not in it); one that fails verification is
        skipped with a warning naming the problem, and moved to ``abandoned/`` with any other newer one.
        ``"none"``: start fresh. A path: that file, no fallback."""
        on_root(lambda: directory.remove_stale_temps(self.directory), self.comm)
        mode = self.cfg.resume
        if mode == "none":
            if self.local is not None:
                self.local.clear()  # another run's snapshots, in this directory before
            return False
        if mode == "auto" and self.local is not None:
            newest = on_root(lambda: directory.newest_step(self.directory), self.comm)
            self.local.recover(newest, self.retention, self.cfg.verify)
        if mode != "auto":
            path = os.path.abspath(mode)
            self._loaded(state, path, self.planner.load(path, state))
            return True
        return self._load_newest(state) is not None

    def load_latest(self, state):
        """Load the newest valid checkpoint of this run into ``state``, as ``resume="auto"`` would pick it
        (damaged ones skipped with a warning), whatever ``cfg.resume`` says. Returns its path, or None when
        there is none. Used to roll back, e.g. after a numeric blow-up.

        >>> path = mgr.load_latest(state)   # doctest: +SKIP
        """
        self.wait()
        return self._load_newest(state)

    def _load_newest(self, state):
        found = load_newest(self.directory, self.planner, state, self.comm, self.world.is_root)
        if found is not None:
            self._loaded(state, *found)
        return None if found is None else found[0]

    def _loaded(self, state, path, header):
        self._last_step = state.progress.step
        self._last_time = time.monotonic()
        continue_from(self.directory, path, header, state, self.comm, self.world.is_root)
        if self.local is not None:  # the run goes on from here: newer snapshots are another branch
            self.local.discard_after(state.progress.step)

    # -- saving

    def maybe_save(self, state, epoch_end=False, final=False, requested=False, metrics=None):
        """Save if rank 0 says it is time; returns the path saved, or None. With ``checkpoint.auto_interval``
        the time between calls (minus what saves took) is the step time and what a save blocks is its cost;
        rank 0 chooses the interval from them (:mod:`.interval`), ``every_steps`` its upper bound."""
        c = self.cfg
        started = time.monotonic()
        step = state.progress.step
        auto, local = self.interval, self.local

        def decide():
            due = auto is not None and _auto_due(auto, self.background, step, started, self._last_step)
            reason = save_reason(step, self._last_step, started - self._last_time,
                                 0 if auto is not None else c.every_steps, c.every_minutes, c.on_epoch_end,
                                 c.on_finish, epoch_end, final, requested, auto_due=due)
            return reason, reason is None and local is not None and local.due(step, started, self._last_step)

        reason, local_due = on_root(decide, self.comm)
        path, snapped = None, False
        if reason is not None:
            path = self.save(state, reason=reason, metrics=metrics)
        elif local_due:
            snapped = self.local.save(state, self.planner, step, self.run_config)
        ended = time.monotonic()
        if auto is not None:
            auto.call_ended(ended, step, ended - started if path is not None else None)
        if local is not None:
            local.call_ended(ended, step, ended - started if snapped else None)
        return path

    def save(self, state, reason="manual", metrics=None):
        """Write a checkpoint of ``state`` now; returns its path. With ``cfg.async_save`` the file is written
        in the background and is durable once the next save or :meth:`close` returns."""
        self.wait()
        self.planner.check_replicas(state)
        step = state.progress.step
        final = os.path.join(self.directory, fmt.checkpoint_name(step))
        info = commit.begin(final, self.comm, self.parallel, run_config=self.run_config, metrics=metrics,
                            reason=reason, step=step, io=self.io)
        metric = (metrics or {}).get(self.cfg.best_metric)
        background = self.cfg.async_save and threads_ok(self.world.is_root)
        plan = self.planner.plan(state, info, self.parallel, self.background.buffers if background else None)
        if background:
            # Refuse a diverged state here, not at the next wait(): each rank checks the
            # rows it will write, in its fresh (cache-warm) private copy.
            check_finite(plan, self.comm, info["tmp"])
            self._last_step = step
            self.background.start(plan, info, self.parallel, self.cfg.verify, self.retention, metric)
        else:
            commit.write_and_publish(plan, info, self.comm, self.parallel, self.cfg.verify, self.retention, metric)
            self._last_step = step
        self._last_time = time.monotonic()
        self.last_path = final
        return final

    @property
    def saving(self):
        """True while this rank's background save is still running (not collective)."""
        return self.background.saving

    def wait(self):
        """Wait for a background save; raise its error (the same on every rank)."""
        self.background.wait()

    def close(self):
        """Finish a background save and release the writer's communicator. The node-local snapshots are
        removed once an HDF5 checkpoint is as new as they are (else kept: the newest state is theirs)."""
        self.background.close()
        if self.local is not None:
            self.local.finish(self._last_step)


def _auto_due(interval, background, step, now, last_saved_step):
    """Rank 0: is the interval the estimator chose over? Its changes of interval are said."""
    written, background.written = background.written, None
    due = interval.due_at(step, now, last_saved_step, written, writing=background.saving)
    for line in interval.changes:
        print(f"hpctrain: {line}", flush=True)
    interval.changes.clear()
    return due


def _warn_about_io(parallel, forced, ranks, async_save):
    """Rank 0: what makes this run's saves slower than they could be."""
    if not parallel and ranks > 1:
        why = (f"{settings.name('CKPT_SERIAL')}=1" if forced else
               "h5py was built without MPI support (h5py.get_config().mpi is False)")
        log.warning("%s: rank 0 writes and reads checkpoints alone (serial HDF5); "
                    "build h5py with HDF5_MPI=ON (scripts/setup.sh) for parallel I/O", why)
    if async_save and usable_cpus() == 1:
        log.warning("checkpoint.async_save: this rank may run on one core only (its CPU affinity), so the "
                    "background writer's CPU time comes out of training's (measured: barely less stall than "
                    "a blocking save); give each rank a core more: mpirun --map-by slot:PE=2 (or --bind-to "
                    "none), srun --cpus-per-task=2")


# ---------------------------------------------------------------- where a run resumes
def load_newest(path, planner, state, comm, is_root):
    """Collective: load the newest valid checkpoint of directory ``path`` into ``state`` with ``planner``:
    ``(file, header)``, or None if there is none; if all are damaged, the same :class:`CheckpointError` on
    every rank."""
    candidates = on_root(lambda: directory.candidates(path), comm)
    problems = []
    for file in candidates:
        try:
            h = planner.load(file, state)
        except fmt.CheckpointCorrupt as exc:
            reason = str(exc).split("\nHINT:")[0]
            problems.append(reason)
            if is_root:
                log.warning("skipping checkpoint %s: %s; trying the previous one", file, reason)
            continue
        if problems and is_root:
            log.warning("resumed from %s, an older checkpoint, because newer ones are damaged", file)
        return file, h
    if problems:
        raise everywhere(CheckpointError(
            f"no valid checkpoint in {path}:\n  " + "\n  ".join(problems),
            hint="start fresh with checkpoint.resume=none, or name a file with checkpoint.resume=PATH"))
    return None


def continue_from(path, file, header, state, comm, is_root):
    """Collective, after ``file`` was loaded into ``state``: its newer siblings become an
    abandoned branch, and rank 0 says where the run resumed."""
    on_root(lambda: directory.start_branch(path, file, state.progress.step), comm)
    if is_root:
        a = header.root_attrs
        print(f"hpctrain: resumed from {file} at step {state.progress.step} (epoch {state.progress.epoch}), "
              f"written by {a.get('nranks', '?')} rank(s) ({a.get('io_mode', '?')})", flush=True)
