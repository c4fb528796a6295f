"""When to save, what to call it, how it becomes durable, what to keep, where to resume.

Every public call is collective: all ranks call it with the same arguments. Rank 0 makes
the decisions (name, time, retention) through :func:`~hpctrain.coordination.on_root`, so
every rank sees the same result or the same exception.

A save goes: consistency check of the replicas -> rank 0 names ``ckpt-<step>.h5`` and a
temp name -> every rank writes its share of the temp file -> re-read and compare checksums
-> rank 0 fsyncs the file, renames it into place, fsyncs the directory, then replaces
``latest`` the same way -> rank 0 deletes what retention no longer keeps. A failure at any
point, on any rank, raises :class:`CheckpointError` on all ranks, removes the temp file and
leaves the previous checkpoint and ``latest`` as they were.

Checkpoints of split models (``hpctrain.parallel.checkpoint``) take the same steps through
:func:`save_file`; only their plan of who writes which part differs.
"""
import atexit
import logging
import os
import threading
import time

from .. import allocator, fsutil, settings
from ..coordination import all_or_none, everywhere, on_root
from ..errors import CheckpointError, ConfigError
from ..replicas import divergent_ranks, first_difference, model_fingerprints
from ..system import usable_cpus
from . import format as fmt
from . import reader, sharded, snapshot, writer
from .interval import AutoInterval

log = logging.getLogger("hpctrain.checkpoint")

BRANCH_RECORD = "branch.json"  # in each abandoned/<branch>/ folder: when, and from where the run went on


# ---------------------------------------------------------------- files (rank 0 only)

def write_latest(directory, name):
    """Point ``latest`` at ``name``, atomically and durably."""
    fsutil.write_text(os.path.join(directory, fmt.LATEST), name + "\n")


def read_latest(directory):
    try:
        with open(os.path.join(directory, fmt.LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return name if fmt.parse_step(name) is not None else None


def scan(directory):
    """``[(step, file name)]`` of the checkpoints in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(fmt.parse_step(n), n) for n in names]
    return sorted(((s, n) for s, n in found if s is not None), reverse=True)


def _check_writable(directory):
    try:
        os.makedirs(directory, exist_ok=True)
        probe = fsutil.temp_name(os.path.join(directory, ".probe"))
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} is not writable ({exc})",
                              hint="set checkpoint.directory to a writable place (on a cluster: "
                                   "scratch, not $HOME), or fix its permissions") from exc


# ---------------------------------------------------------------- replicas

def check_consistency(model, comm, mode="check"):
    """Collective: compare fingerprints of every rank's model tensors (the ranks of ``comm``
    hold replicas of one model, or of one part of it).

    ``"check"``: raise CheckpointError naming the ranks that diverged; ``"repair"``: copy
    the tensors of the largest group of equal ranks to the others (with a warning);
    ``"off"``: do nothing.
    """
    if mode == "off" or comm.Get_size() == 1:
        return
    import torch
    from mpi4py import MPI

    job_ranks, prints = zip(*comm.allgather((MPI.COMM_WORLD.Get_rank(), model_fingerprints(model))))
    reference, diverged = divergent_ranks(prints)
    if not diverged:
        return
    first = first_difference(list(model.state_dict()), prints[reference[0]], prints[diverged[0]])
    ranks = ", ".join(str(job_ranks[r]) for r in diverged)
    source = job_ranks[reference[0]]
    if mode == "repair":
        if comm.Get_rank() == 0:
            log.warning("ranks %s hold model tensors that differ from rank %d's (first: %s); copying "
                        "rank %d's to every rank (checkpoint.consistency=repair)", ranks, source, first, source)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                array, dtype = snapshot.tensor_to_array(tensor, copy=True)
                reader.bcast_bytes(array, reference[0], comm)
                tensor.copy_(snapshot.array_to_tensor(array, dtype).to(tensor.device))
        return
    raise everywhere(CheckpointError(
        f"ranks {ranks} hold model tensors that differ from rank {source}'s (first differing: {first}); "
        f"the replicas have diverged, so no checkpoint was written",
        hint="look for rank-dependent code in the model or a missed broadcast of the initial "
             "parameters; checkpoint.consistency=repair copies one replica's parameters to the others"))


# ---------------------------------------------------------------- one save, one load
# The steps of every save, data-parallel or split model: rank 0 checks the directory and
# names a temp file (_prepare); every rank writes its pieces, the file is re-read and
# checked (write_verified); rank 0 makes it durable under its name (commit).

def _io_mode(comm):
    forced = settings.get_bool("CKPT_SERIAL")
    return not forced and writer.h5py_parallel(), forced


def _prepare(final, comm, parallel, run_config=None, metrics=None, reason="manual", step=0, extra=None):
    """Rank 0: check the directory, choose the temp name, gather metadata and RNG states.
    ``extra``: more attributes of ``/``."""
    _check_writable(os.path.dirname(final))
    nwriters = comm.Get_size() if parallel else 1
    meta = snapshot.root_metadata(comm.Get_size(), run_config, metrics, reason, step,
                                  "mpio" if parallel else "serial", nwriters)
    meta.update(extra or {})
    return {"final": final, "tmp": fsutil.temp_name(final), "meta": meta, "rng": snapshot.rng_states()}


# An async save's writer (and the fsync and writeback threads it starts, which inherit it)
# runs this much nicer than the training, so that the training threads come first where they
# share a core with it. Measured on one rank pinned to one core (1.07 GiB): the steps during
# a save waited 2.4-2.5 s on the run queue with the writer at the training's priority,
# 0.26-0.27 s at +10, while the save itself took longer. Given a core of its own the writer
# barely touches the training either way (docs/performance.md).
WRITER_NICE = 10


def lower_priority(nice=WRITER_NICE):
    """Lower the calling thread's scheduling priority by ``nice`` (it alone: Linux's
    ``setpriority`` on a thread id); does nothing where that is not possible."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))
    except (AttributeError, OSError):
        pass


def write_verified(plan, info, comm, parallel, verify, background=False):
    """Collective: write the temp file and check it; remove it on any failure.
    ``background``: small, independent write calls, so that training runs between them."""
    tmp = info["tmp"]
    call_bytes = writer.CALL_BYTES if background else writer.FOREGROUND_CALL_BYTES
    try:
        # The disk starts writing the file back while it is written, not only at the fsync.
        stop_writeback = fsutil.early_writeback(tmp) if parallel or comm.Get_rank() == 0 else lambda: None
        try:
            checksums = writer.write_file(tmp, plan, comm, parallel, call_bytes, collective=not background)
        finally:
            stop_writeback()
        # Every rank fsyncs the file while the ranks re-read and checksum it: the disk
        # writes back while the CPUs verify, instead of one after the other.
        synced = writer.sync_started(tmp, parallel, comm.Get_rank())
        try:
            if verify:
                expected = {d.path: c for d, c in zip(plan.datasets, checksums)}
                reader.verify_written(tmp, expected, comm, parallel)
        finally:
            problems = synced()
        writer.agree(problems, comm, tmp, "syncing")
    except BaseException:
        if comm.Get_rank() == 0:
            fsutil.remove_quietly(tmp)
        raise


def commit(info):
    """Rank 0: the written and verified temp file becomes the checkpoint, durably."""
    tmp, final = info["tmp"], info["final"]
    try:
        fsutil.durable_rename(tmp, final)
    except OSError as exc:
        fsutil.remove_quietly(tmp)
        raise CheckpointError(f"could not move {tmp} to {final}: {exc}",
                              hint="the previous checkpoint and `latest` are untouched") from exc
    return final


def save_file(path, comm, parallel, make_plan, verify=True, **meta):
    """Collective: one checkpoint file through the whole pipeline, without ``latest`` or
    retention. ``make_plan(info)``: the :class:`~.writer.Plan` of this rank, from rank 0's
    ``info`` (``meta``: root attributes, ``rng``: its generators). ``meta``: the
    arguments of :func:`_prepare`. Returns the file's path."""
    path = os.path.abspath(os.fspath(path))
    info = on_root(lambda: _prepare(path, comm, parallel, **meta), comm)
    write_verified(make_plan(info), info, comm, parallel, verify)
    return on_root(lambda: commit(info), comm)


def save_checkpoint(path, state, comm=None, run_config=None, metrics=None, reason="manual",
                    verify=True, consistency="check"):
    """Collective: write ``state`` to the checkpoint file ``path`` (atomically: temp file,
    checksums verified, fsync, rename). No ``latest`` pointer, no retention: see
    :class:`CheckpointManager` for those.

    >>> save_checkpoint("run/ckpt-00000100.h5", state, comm)   # doctest: +SKIP
    """
    comm = _comm(comm)
    parallel, _ = _io_mode(comm)
    check_consistency(state.model, comm, consistency)
    return save_file(path, comm, parallel, lambda info: _plan(state, info, comm, parallel), verify,
                     run_config=run_config, metrics=metrics, reason=reason, step=state.progress.step)


def _plan(state, info, comm, parallel, copy=False, buffers=None):
    """This rank's plan; ``copy`` (a background save): its pieces copied into ``buffers``."""
    if sharded.is_sharded(state):  # comm.shard: each rank writes its optimizer slice's rows
        sharded.check_parallel(parallel)
        return sharded.plan(state, info, comm, copy=copy)
    snap = snapshot.take_snapshot(state, info)
    plan = writer.plan_snapshot(snap, comm.Get_size() if parallel else 1, comm.Get_rank())
    if copy:
        writer.copy_own_pieces(plan, {} if buffers is None else buffers, workers=min(4, usable_cpus()))
    return plan


def _comm(comm):
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return getattr(comm, "comm", comm)  # a World is accepted too


def load_checkpoint(path, state, comm=None, restore_rng=True):
    """Collective: read checkpoint ``path`` into ``state`` (model, optimizer, progress) in
    place, on any number of ranks. Every rank reads a share, checksums are verified, the
    shares are exchanged. Raises :class:`CheckpointError` on every rank: for a file that does
    not fit ``state`` (model shapes, optimizer groups) or cannot be opened, before anything
    in ``state`` changes. The data is read straight into the state's own CPU tensors (no
    second copy of the state in memory), so a ``CheckpointCorrupt`` for data that fails its
    checksums leaves them holding part of the file: load another checkpoint before
    training on (``CheckpointManager.resume`` falls back to the previous one by itself).

    >>> load_checkpoint("run/checkpoints/ckpt-00000100.h5", state)   # doctest: +SKIP
    """
    comm = _comm(comm)
    parallel, _ = _io_mode(comm)
    if sharded.is_sharded(state):  # comm.shard: each rank reads its optimizer slice's rows
        with allocator.reusing_large_blocks():
            return sharded.load(path, state, comm, parallel, restore_rng)

    def header():
        h = reader.read_header(path)
        snapshot.check_model_against(state.model, h.datasets, path)
        return h

    h = on_root(header, comm)
    all_or_none(lambda: snapshot.check_optimizer_groups(state, h.group_attrs, path), comm)
    own = snapshot.in_place_targets(state, h.datasets)
    # What is not read in place allocates and frees large buffers once: reused, not faulted
    # in afresh each time, and given back afterwards (hpctrain.allocator).
    with allocator.reusing_large_blocks():
        arrays = reader.read_arrays(h, comm, parallel, into={p: a for p, (a, _) in own.items()})
        typed = {p: (a, h.datasets[p][2][fmt.DTYPE_ATTR]) for p, a in arrays.items()}

        def apply():
            snapshot.restore(state, typed, h.group_attrs, path, own={p: t for p, (_, t) in own.items()})
            if restore_rng and comm.Get_rank() == 0:  # rank 0's generators, as saved
                snapshot.restore_rng(arrays, h.group_attrs)

        all_or_none(apply, comm)
        del arrays, typed
    return h


def verify_checkpoint(path):
    """Check every checksum of ``path`` in this process alone. Returns the problems found,
    each naming the dataset; an empty list means the file is valid.

    >>> assert not verify_checkpoint("ckpt-00000100.h5")   # doctest: +SKIP
    """
    return reader.verify_file(path)


# ---------------------------------------------------------------- the manager

class CheckpointManager:
    """Checkpoints of one run in ``directory``. All methods are collective.

    >>> mgr = CheckpointManager(run_dir / "checkpoints", world, cfg.checkpoint, run_config)  # doctest: +SKIP
    >>> mgr.resume(state)                                        # doctest: +SKIP
    >>> for step in ...:
    ...     mgr.maybe_save(state, epoch_end=..., metrics={"val_loss": 0.3})  # doctest: +SKIP
    >>> mgr.maybe_save(state, final=True); mgr.close()           # doctest: +SKIP
    """

    def __init__(self, directory, world, cfg, run_config=None):
        if cfg.best_mode not in ("min", "max"):
            raise ConfigError(f"checkpoint.best_mode is {cfg.best_mode!r}; expected 'min' or 'max'")
        if cfg.consistency not in ("check", "repair", "off"):
            raise ConfigError(f"checkpoint.consistency is {cfg.consistency!r}; expected check, repair or off")
        self.directory = os.path.abspath(os.fspath(directory))
        self.world = world
        self.comm = world.comm
        self.cfg = cfg
        self.run_config = run_config
        self.parallel, forced = _io_mode(self.comm)
        if not self.parallel and world.is_root and world.size > 1:
            why = ("HPCTRAIN_CKPT_SERIAL=1" if forced else
                   "h5py was built without MPI support (h5py.get_config().mpi is False)")
            log.warning("%s: rank 0 writes and reads checkpoints alone (serial HDF5); "
                        "build h5py with HDF5_MPI=ON (scripts/setup.sh) for parallel I/O", why)
        if cfg.async_save and world.is_root and usable_cpus() == 1:
            log.warning("checkpoint.async_save: this rank may run on one core only (its CPU affinity), so the "
                        "background writer's CPU time comes out of training's (measured: barely less stall than "
                        "a blocking save); give each rank a core more: mpirun --map-by slot:PE=2 (or --bind-to "
                        "none), srun --cpus-per-task=2")
        self._last_step = None
        self._last_time = time.monotonic()  # rank 0's clock is the one that counts
        self._metric_cache = {}
        self._thread = None
        self._bg_error = None
        self._bg_comm = None
        self._host_buffers = {}  # async snapshots' host memory, kept for the next save
        self.last_path = None
        # checkpoint.auto_interval: rank 0's estimator (fed and asked inside on_root only);
        # _mark: (clock, step) at the end of the previous maybe_save, _blocked: what the
        # last save cost the training, to be fed to it at the next call.
        self.interval = (AutoInterval(cfg.max_overhead, cfg.mtbf_hours, cfg.every_steps, cfg.every_minutes)
                         if getattr(cfg, "auto_interval", False) else None)
        self._mark = None
        self._blocked = None
        self._written = None  # seconds the last background write took (set by its thread)
        self._first_step = None  # the step this process started from, before its first save

    # -- resume

    def _remove_stale_temps(self):
        """Delete temp files that a killed save left behind. Safe at resume: nothing of this
        run is being written yet, and the run lock keeps other jobs out of the directory."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if fsutil.TMP_MARK in name and (name.startswith("ckpt-") or name.startswith(fmt.LATEST)):
                log.warning("removing %s, left by a save that did not finish", name)
                fsutil.remove_quietly(os.path.join(self.directory, name))

    def _candidates(self):
        """Checkpoints of the current branch, newest first. ``latest`` is not trusted over
        the directory: a save whose ``latest`` update failed left a newer complete file, and
        every file here belongs to the current branch (abandoned ones were moved aside)."""
        found = scan(self.directory)
        latest = read_latest(self.directory)
        if latest is not None and found and latest != found[0][1]:
            log.warning("%s names %s, but %s is newer (a save whose `latest` update failed, or `latest` was "
                        "edited); resuming from the newest valid checkpoint",
                        os.path.join(self.directory, fmt.LATEST), latest, found[0][1])
        return [os.path.join(self.directory, n) for _, n in found]

    def resume(self, state):
        """Load the checkpoint ``cfg.resume`` names into ``state``; True if one was loaded.

        ``"auto"``: the newest checkpoint of the directory (abandoned branches are not in it);
        one that fails verification is skipped with a warning naming the problem, and moved to
        ``abandoned/`` with any other newer one. ``"none"``: start fresh. A path: that
        file, no fallback.
        """
        on_root(self._remove_stale_temps, self.comm)
        mode = self.cfg.resume
        if mode == "none":
            return False
        if mode != "auto":
            path = os.path.abspath(mode)
            h = self._load_file(path, state)
            self._loaded(state, path, h)
            return True
        return self._load_newest(state) is not None

    def load_latest(self, state):
        """Collective: load the newest valid checkpoint of this run into ``state``, as
        ``resume="auto"`` would pick it (damaged ones skipped with a warning), whatever
        ``cfg.resume`` says. Returns its path, or None when there is none. Used to roll back,
        e.g. after a numeric blow-up.

        >>> path = mgr.load_latest(state)   # doctest: +SKIP
        """
        self.wait()
        return self._load_newest(state)

    def _load_newest(self, state):
        candidates = on_root(self._candidates, self.comm)
        problems = []
        for path in candidates:
            try:
                h = self._load_file(path, state)
            except fmt.CheckpointCorrupt as exc:
                reason = str(exc).split("\nHINT:")[0]
                problems.append(reason)
                if self.world.is_root:
                    log.warning("skipping checkpoint %s: %s; trying the previous one", path, reason)
                continue
            if problems and self.world.is_root:
                log.warning("resumed from %s, an older checkpoint, because newer ones are damaged", path)
            self._loaded(state, path, h)
            return path
        if problems:
            raise everywhere(CheckpointError(
                f"no valid checkpoint in {self.directory}:\n  " + "\n  ".join(problems),
                hint="start fresh with checkpoint.resume=none, or name a file with checkpoint.resume=PATH"))
        return None

    def _loaded(self, state, path, header):
        self._last_step = state.progress.step
        self._last_time = time.monotonic()
        on_root(lambda: self._start_branch_or_say(path, state.progress.step), self.comm)
        if self.world.is_root:
            a = header.root_attrs
            print(f"hpctrain: resumed from {path} at step {state.progress.step} (epoch {state.progress.epoch}), "
                  f"written by {a.get('nranks', '?')} rank(s) ({a.get('io_mode', '?')})", flush=True)

    def _start_branch_or_say(self, path, step):
        try:
            self._start_branch(path, step)
        except OSError as exc:
            raise CheckpointError(
                f"resumed from {path}, but the newer checkpoints of the branch left behind could not be moved "
                f"to {os.path.join(self.directory, fmt.ABANDONED)}: {exc}",
                hint="make the checkpoint directory writable; until they are moved, retention would count "
                     "them as the newest checkpoints") from exc

    def _start_branch(self, path, step):
        """Rank 0, after loading ``path`` (step ``step``): the run continues from there, so
        checkpoints of this directory at ``step`` or later (other than ``path``) belong to
        an abandoned branch. They are moved to ``abandoned/<time>-from-<step>/`` with a
        ``branch.json`` record: never resumed automatically, never deleted by retention.
        ``latest`` names ``path`` first, so a crash half-way is repeated by the next resume."""
        same_dir = os.path.dirname(path) == self.directory
        name = os.path.basename(path)
        newer = [(s, n) for s, n in scan(self.directory) if s >= step and not (same_dir and n == name)]
        current = read_latest(self.directory)
        if same_dir and current != name:
            write_latest(self.directory, name)
        if not newer:
            return
        if not same_dir and current is not None:
            fsutil.remove_quietly(os.path.join(self.directory, fmt.LATEST))
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest = os.path.join(self.directory, fmt.ABANDONED, f"{stamp}-from-{step:08d}")
        os.makedirs(dest, exist_ok=True)
        for _, n in newer:
            os.replace(os.path.join(self.directory, n), os.path.join(dest, n))
        fsutil.fsync_path(dest, directory=True)
        fsutil.fsync_path(os.path.dirname(dest), directory=True)
        fsutil.fsync_path(self.directory, directory=True)
        fsutil.write_text(os.path.join(dest, BRANCH_RECORD), fmt.to_json({
            "abandoned": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "resumed_from": path,
            "resumed_step": step, "files": [n for _, n in sorted(newer)]}) + "\n")
        log.warning("the run continues from step %d (%s): %d newer checkpoint(s) of the abandoned branch "
                    "(steps %s) moved to %s; resume=auto never takes them and retention never deletes them",
                    step, name, len(newer), ", ".join(str(s) for s, _ in sorted(newer)), dest)

    # -- saving

    def maybe_save(self, state, epoch_end=False, final=False, requested=False, metrics=None):
        """Save if rank 0 says it is time; returns the path saved, or None.

        With ``checkpoint.auto_interval`` the time between calls (minus what saves took) is
        the step time and what a save blocks is its cost; rank 0 chooses the interval from
        them (:mod:`.interval`), and ``every_steps`` becomes an upper bound on it."""
        c = self.cfg
        started = time.monotonic()
        step = state.progress.step
        auto = self.interval

        def decide():
            due = auto is not None and self._auto_due(step, started)
            return fmt.save_reason(step, self._last_step, started - self._last_time,
                                   0 if auto is not None else c.every_steps, c.every_minutes, c.on_epoch_end,
                                   c.on_finish, epoch_end, final, requested, auto_due=due)

        reason = on_root(decide, self.comm)
        path = None
        if reason is not None:
            path = self.save(state, reason=reason, metrics=metrics)
        ended = time.monotonic()
        if path is not None:
            self._blocked = ended - started
        self._mark = (ended, step)
        return path

    def _auto_due(self, step, now):
        """Rank 0: feed the estimator what was measured since the last call, log a change of
        interval, say whether the interval has passed."""
        auto = self.interval
        if self._blocked is not None:
            auto.observe_save(self._blocked)
            self._blocked = None
        written, self._written = self._written, None
        if written is not None:
            auto.observe_write(written)
        if self._mark is not None and step > self._mark[1]:  # not a second call at one step, nor a rollback
            auto.observe_step(now - self._mark[0], step - self._mark[1])
        if self._first_step is None:
            self._first_step = step
        since = step - (self._last_step if self._last_step is not None else self._first_step)
        due = auto.due(since)
        for line in auto.changes:
            print(f"hpctrain: {line}", flush=True)
        auto.changes.clear()
        return due

    def save(self, state, reason="manual", metrics=None):
        """Write a checkpoint of ``state`` now; returns its path. With ``cfg.async_save`` the
        file is written in the background and is durable once the next save or
        :meth:`close` returns."""
        self.wait()
        self._check_replicas(state)
        step = state.progress.step
        final = os.path.join(self.directory, fmt.checkpoint_name(step))
        info = on_root(lambda: _prepare(final, self.comm, self.parallel, self.run_config, metrics, reason, step),
                       self.comm)
        metric = (metrics or {}).get(self.cfg.best_metric)
        background = self.cfg.async_save and self._threads_ok()
        plan = self._make_plan(state, info, background)
        if background:
            # Refuse a diverged state here, not at the next wait(): each rank checks the
            # rows it will write, in its fresh (cache-warm) private copy.
            writer.check_finite(plan, self.comm, info["tmp"])
            self._last_step = step
            if self._bg_comm is None:
                self._bg_comm = self.comm.Dup()  # the writer's collectives never meet training's
                # A run that ends without close() must not reach MPI_Finalize mid-write.
                atexit.register(self._join)
            self._thread = threading.Thread(target=self._background, args=(plan, info, metric),
                                            name="hpctrain-checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._write_commit(plan, info, metric, self.comm)
            self._last_step = step
        self._last_time = time.monotonic()
        self.last_path = final
        return final

    def _threads_ok(self):
        from mpi4py import MPI

        if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
            return True
        if self.world.is_root:
            log.warning("checkpoint.async_save needs MPI_THREAD_MULTIPLE; this MPI gives level %d, "
                        "saving synchronously", MPI.Query_thread())
        return False

    def _background(self, plan, info, metric):
        started = time.monotonic()
        lower_priority()
        try:
            self._write_commit(plan, info, metric, self._bg_comm)
            self._written = time.monotonic() - started  # for checkpoint.auto_interval
        except BaseException as exc:  # handed to the training thread by wait()
            self._bg_error = exc

    def _write_commit(self, plan, info, metric, comm):
        write_verified(plan, info, comm, self.parallel, self.cfg.verify, background=comm is self._bg_comm)
        on_root(lambda: self._commit(info, metric), comm)

    def _commit(self, info, metric):
        final = commit(info)
        name = os.path.basename(final)
        self._metric_cache[name] = metric
        previous = read_latest(self.directory)
        try:
            write_latest(self.directory, name)
        except OSError as exc:
            raise CheckpointError(
                f"{final} was written and verified, but {os.path.join(self.directory, fmt.LATEST)} could not be "
                f"updated ({exc}): it still names {previous or 'no checkpoint'}; old checkpoints were not "
                f"removed. resume=auto takes the newest valid checkpoint in the directory, {name}; tools that "
                f"read `latest` see {previous or 'none'}",
                hint=f"fix the cause (space, permissions) in {self.directory}; the next successful save moves "
                     f"`latest`") from exc
        try:
            self._retain()
        except OSError as exc:  # the new checkpoint is safe; old ones stay a while longer
            log.warning("retention: %s", exc)
        return final

    def _metric_of(self, name):
        if name not in self._metric_cache:
            try:
                h = reader.read_header(os.path.join(self.directory, name))
                self._metric_cache[name] = h.metrics.get(self.cfg.best_metric)
            except CheckpointError:
                self._metric_cache[name] = None
        return self._metric_cache[name]

    def _retain(self):
        found = scan(self.directory)
        c = self.cfg
        need_metric = c.keep_best > 0
        keep = fmt.select_keep([(s, self._metric_of(n) if need_metric else None) for s, n in found],
                               c.keep_last, c.keep_best, c.best_mode, c.milestone_every)
        latest = read_latest(self.directory)
        for step, name in found:
            if step not in keep and name != latest:
                fsutil.remove_quietly(os.path.join(self.directory, name))
                self._metric_cache.pop(name, None)
                log.info("retention: removed %s", name)

    def _join(self):
        if self._thread is not None:
            self._thread.join()

    @property
    def saving(self):
        """True while this rank's background save is still running (not collective)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Wait for a background save; raise its error (the same on every rank)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._bg_error = self._bg_error, None
        if error is not None:
            raise error

    def close(self):
        """Finish a background save and release the writer's communicator."""
        try:
            self.wait()
        finally:
            self._host_buffers = {}
            if self._bg_comm is not None:
                self._bg_comm.Free()
                self._bg_comm = None

    # -- what a split model (hpctrain.parallel.strategy.SplitCheckpoints) does differently

    def _check_replicas(self, state):
        """Collective: the ranks holding copies of the same tensors must agree."""
        check_consistency(state.model, self.comm, self.cfg.consistency)

    def _make_plan(self, state, info, background):
        """This rank's part of the file: data parallel, every rank shares out the rows of one model."""
        return _plan(state, info, self.comm, self.parallel, copy=background,
                     buffers=self._host_buffers if background else None)

    def _load_file(self, path, state):
        """Collective: read ``path`` into ``state``; returns its header."""
        return load_checkpoint(path, state, self.comm)
