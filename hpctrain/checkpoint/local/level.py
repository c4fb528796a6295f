"""The node-local checkpoint level (``checkpoint.local``), as SCR and VeloC give MPI programs: frequent, cheap
snapshots into storage on each node (``/dev/shm`` by default), between the collective HDF5 checkpoints.

A snapshot is the HDF5 file's plan, kept as it would be written: each rank stores the rows it would write
(its part, :mod:`.files`) and sends a copy to a rank on the next node, so a part survives the loss of
its own node. Three snapshots at most are kept per node (the two newest complete ones, so that a damaged
newest one falls back to the one before, and the one being written); the first snapshot says what that costs
in memory. A snapshot holding NaN or infinity is refused like a save.

Recovery (:meth:`LocalLevel.recover`, from :meth:`~.manager.CheckpointManager.resume`) takes the newest
snapshot newer than the newest HDF5 checkpoint whose parts all survive somewhere intact (a damaged part: its
copy, else the snapshot before). Its parts are read (and their checksums verified) by the ranks on the nodes
that hold them, gathered on rank 0 and written as an ordinary checkpoint file of the directory: the snapshot
becomes durable, and the run resumes from it through the one load path, on any number of ranks. Where no
snapshot is whole, the run resumes from the HDF5 file and says how many steps that costs.
"""
import logging
import os
import shutil
import time

import numpy as np

from ...errors import CheckpointError
from ...runtime import fsutil, slurm
from ...runtime.coordination import everywhere, on_root
from .. import commit, directory
from ..content import format as fmt
from ..content import metadata, snapshot
from ..content.plan import DatasetPlan, WritePlan, mark_finite, plan_snapshot, refuse_nonfinite
from ..interval import AutoInterval
from ..io.iosettings import io_settings_for
from . import files
from .transfer import copy_to_partner, gather_parts

log = logging.getLogger("hpctrain.checkpoint")

KEPT = 3  # snapshots a node may hold at once: the two newest complete ones and the one being written
# With neither local_every_steps nor auto_interval: snapshots as often as 1% of the wall time allows.
DEFAULT_OVERHEAD = 0.01


def _mib(nbytes):
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


class LocalLevel:
    """One run's node-local snapshots (``cfg``: the ``[checkpoint]`` section). All methods are collective over
    ``world``'s ranks, except :meth:`due` and :meth:`call_ended` (rank 0's interval, inside ``on_root``).
    ``budget_share``: the part of ``checkpoint.max_overhead`` this level may spend."""

    def __init__(self, cfg, checkpoint_dir, world, budget_share=0.5):
        self.world, self.comm = world, world.comm.Dup()  # its messages never meet training's
        self.checkpoint_dir = os.path.abspath(checkpoint_dir)
        self.base = files.base_dir(cfg.local_dir, self.checkpoint_dir)
        self.ndir = files.node_dir(self.base, world.node)
        self.auto, self.local_dir = cfg.local == "auto", cfg.local_dir  # auto: off where there is no room
        self.nodes, problems = zip(*self.comm.allgather((world.node, _local_dir_problem(cfg.local_dir, world))))
        self.off = next((p for p in problems if p), None)  # why the level is off (no space, no directory), once it is
        if self.off and not self.auto:
            raise everywhere(CheckpointError(self.off, hint="name a directory that exists on every node: /dev/shm "
                                                            "(memory), or a local disk such as /tmp or $TMPDIR"))
        self.dests, rank = files.partners(self.nodes), self.comm.Get_rank()
        self.dest, self.sources = self.dests[rank], [q for q, d in enumerate(self.dests) if d == rank]
        self.leader = world.local_rank == 0  # one rank per node tidies the node's directory
        self.every = cfg.local_every_steps
        self.interval = (AutoInterval(cfg.max_overhead * budget_share, cfg.mtbf_hours, cfg.local_every_steps)
                         if cfg.auto_interval else None if self.every else AutoInterval(DEFAULT_OVERHEAD))
        self.last_step, self.announced, self.interval_said = None, False, False

    def describe(self):
        """The run's first line of the level: on or off (``auto`` without a usable directory), where, its bound."""
        if self.off:
            return f'node-local checkpoints: off (checkpoint.local = "auto"): {self.off}'
        bound = ("while their snapshots fit in half of its free space (checked at the first; checkpoint.local=false "
                 "turns them off)" if self.auto else "(checkpoint.local = true)")
        return f"node-local checkpoints: on, in {self.local_dir} {bound}"

    # -- when

    def due(self, step, now, last_hdf5_step):
        """Rank 0: is a snapshot due (counted from the last save of either level)?"""
        if self.off is not None:
            return False
        last = max((s for s in (last_hdf5_step, self.last_step) if s is not None), default=None)
        if self.interval is None:
            return step != last and step - (last or 0) >= self.every
        due = self.interval.due_at(step, now, last)
        if self.interval.changes and not self.interval_said:  # the first choice; its re-tunings are not news
            print(f"hpctrain: node-local {self.interval.changes[0]}", flush=True)
            self.interval_said = True
        self.interval.changes.clear()
        return due

    def call_ended(self, when, step, blocked=None):
        if self.interval is not None:
            self.interval.call_ended(when, step, blocked)

    # -- saving

    def save(self, state, planner, step, run_config=None):
        """Snapshot ``state`` at ``step``; returns True once every part and copy is in place. A failure to
        write (no space) warns on rank 0, removes the snapshot and turns the level off; NaN or infinity
        raises :class:`~.format.NonFiniteState` on every rank, as a save does."""
        comm, rank, size = self.comm, self.comm.Get_rank(), self.comm.Get_size()
        info = on_root(lambda: {"meta": metadata.root_metadata(size, run_config, None, "local", step, "local", size),
                                "rng": metadata.rng_states()}, comm)
        plan = planner.plan(state, info, True)
        mark_finite(plan)
        if self.auto and not self.announced:
            self.off = _short_of_room_here(comm, plan, self.nodes, self.dests, self.local_dir)
            if self.off:
                return False
        outcome = _write_with_copies(self, plan, step)
        errors = [e for e, _, _, _ in outcome if e]
        if errors or any(b for _, b, _, _ in outcome):
            shutil.rmtree(files.step_dir(self.ndir, step), ignore_errors=True)
            comm.Barrier()  # every node's copy of this snapshot is gone before anyone goes on
            refuse_nonfinite(plan.datasets, [b for _, b, _, _ in outcome], fmt.checkpoint_name(step))
            self.off = errors[0]
            if rank == 0:
                log.warning("node-local checkpoints turned off: %s; the HDF5 checkpoints go on as configured. "
                            "HINT: give checkpoint.local_dir more space (or a local disk), or set "
                            "checkpoint.local=false", errors[0])
            return False
        if not self.announced and self.leader:
            files.mark_job(self.ndir, slurm.job_id())  # `hpctrain ckpt clean-local --job` (an epilog) finds them
        if not self.announced and rank == 0:
            print(_memory_line(self.base, self.nodes, [(n, r) for _, _, n, r in outcome], self.dest, self.sources),
                  flush=True)
        self.announced = True
        if self.leader:  # the snapshot before stays: a damaged newest one falls back to it
            previous = step if self.last_step is None else min(self.last_step, step)
            files.remove_steps(self.ndir, lambda s: s >= previous)
        self.last_step = step
        return True

    # -- recovery

    def recover(self, newer_than, retention, verify=True):
        """Make the newest usable snapshot after HDF5 step ``newer_than`` (0: no HDF5 checkpoint) an ordinary
        checkpoint file of the directory; returns its path, or None (then the HDF5 file is the newest, and rank 0
        has said what that costs). Usable: every part survives somewhere with checksums that hold; a damaged part
        is replaced by its copy on the next node, else the next older snapshot is taken."""
        if self.off:  # checkpoint.local = "auto" without a usable directory: nothing there to recover
            return None
        comm, is_root = self.comm, self.comm.Get_rank() == 0
        everything = comm.gather(files.scan_node(self.ndir, self.checkpoint_dir) if self.leader else [], root=0)
        started = time.monotonic()
        step, chosen, skipped, full, specs = _gather_usable(comm, everything, newer_than)
        if step is None:
            if skipped and is_root:
                print(_incomplete_line(skipped[0], newer_than), flush=True)
            return None
        try:
            path = _write_snapshot_file(comm, step, full, specs, self.checkpoint_dir, retention, verify)
        except CheckpointError as exc:
            if is_root:
                log.warning("the node-local checkpoint of step %d could not be used (%s); resuming from the "
                            "newest HDF5 checkpoint", step, str(exc).split("\nHINT:")[0])
            return None
        if is_root:
            holders = sorted({self.nodes[r] for r, _, _ in chosen.values()})
            print(_recovered_line(step, newer_than, holders, chosen, skipped, path, time.monotonic() - started),
                  flush=True)
        self.last_step = step
        return path

    # -- tidying

    def discard_after(self, step):
        """Remove the snapshots newer than ``step`` (the run went on from ``step``: they are another branch)."""
        if self.leader:
            files.remove_steps(self.ndir, lambda s: s <= step)
        self.comm.Barrier()

    def clear(self):
        """Remove this run's snapshots on every node of the job."""
        if self.leader:
            files.remove_node_dir(self.ndir)
        self.last_step = None
        self.comm.Barrier()

    def finish(self, last_hdf5_step):
        """At the end of a run: the snapshots go once an HDF5 checkpoint is as new (else they hold the newest
        state, and stay); the level's communicator is freed."""
        newest = self.last_step
        if newest is None or (last_hdf5_step is not None and last_hdf5_step >= newest):
            self.clear()
        elif self.comm.Get_rank() == 0:
            log.warning("the newest state (step %d) is only in the node-local checkpoints under %s: kept, "
                        "for a resume on the same nodes", newest, self.base)
        self.comm.Free()


def write_alone(level, state, run_config=None):
    """This rank's whole data-parallel state, written by this rank alone (the others may be gone) as a snapshot
    of one part at the step it finished last: a survivor's (:mod:`hpctrain.job.survivor`). Nothing collective.
    Returns ``(step, why not)``: ``why not`` None once the part is in place; else nothing is left of it."""
    step = state.progress.step
    if level.off:
        return step, f"the node-local level is off ({level.off})"
    if os.path.exists(files.step_dir(level.ndir, step)):  # the ranks' own snapshot of it, whole or being written
        return step, f"a snapshot of step {step} is there already"
    info = {"meta": metadata.root_metadata(1, run_config, None, "survivor", step, "local", 1),
            "rng": metadata.rng_states()}
    plan = plan_snapshot(snapshot.take_snapshot(state, info), 1, 0)
    mark_finite(plan)
    try:
        _, bad = files.write_part(files.part_path(level.ndir, step, 0), plan, 0, step, 1, level.checkpoint_dir,
                                  level.world.node)
    except OSError as exc:
        bad = exc
    if bad:  # a damaged replica is never the one restored from
        shutil.rmtree(files.step_dir(level.ndir, step), ignore_errors=True)
        return step, (f"writing it: {bad}" if isinstance(bad, OSError) else
                      f"its /{plan.datasets[bad[0]].path} holds NaN or infinity")
    return step, None


def _write_with_copies(level, plan, step):
    """Collective: each rank's part of ``plan`` written on its node and copied to its partner; every rank's
    ``(error or None, indices of non-finite datasets, part bytes, copy bytes stored)``."""
    comm, rank, where = level.comm, level.comm.Get_rank(), level.world.where()
    own, error, bad, nbytes = files.part_path(level.ndir, step, rank), None, [], 0
    try:
        nbytes, bad = files.write_part(own, plan, rank, step, comm.Get_size(), level.checkpoint_dir, level.world.node)
    except OSError as exc:
        error = f"{where}: writing {own}: {exc}"
    stored, copy_error = copy_to_partner(comm, None if error else own, nbytes, level.dest, level.sources,
                                         lambda q: files.part_path(level.ndir, step, q), where)
    return comm.allgather((error or copy_error, bad, nbytes, stored))


def _gather_usable(comm, everything, newer_than):
    """Collective: the newest snapshot after ``newer_than`` whose parts all read back intact (``everything``: on
    rank 0, what each rank found on its node), gathered on rank 0: ``(step, chosen, skipped, arrays, specs)``,
    ``step`` None when no snapshot is whole. A damaged part is said and passed over for its copy or an older
    snapshot."""
    damaged = []
    while True:
        step, chosen, skipped = on_root(lambda: files.choose(dict(enumerate(everything)), newer_than, damaged), comm)
        if step is None:
            return None, chosen, skipped, None, None
        full, specs, problem = gather_parts(comm, chosen)
        problem, specs = comm.bcast((problem, specs), root=0)
        if problem is None:
            return step, chosen, skipped, full, specs
        damaged.append(problem[0])
        if comm.Get_rank() == 0:
            log.warning("the node-local part %s of step %d is damaged (%s); looking for its copy or an older "
                        "snapshot", problem[0], step, problem[1])


def _write_snapshot_file(comm, step, full, specs, checkpoint_dir, retention, verify):
    """Collective: the parts of ``step`` gathered on rank 0 (``full``, described by ``specs``) written, by rank 0,
    as the checkpoint of that step (verified, renamed into place, ``latest`` and retention applied); its path."""
    final = os.path.join(checkpoint_dir, fmt.checkpoint_name(step))
    info = on_root(lambda: (directory.check_writable(checkpoint_dir),
                            {"final": final, "tmp": fsutil.temp_name(final),
                             "io": io_settings_for(checkpoint_dir)})[1], comm)
    datasets = [DatasetPlan(s["path"], tuple(s["shape"]), np.dtype(s["dtype"]), s["attrs"],
                            [(0, fmt.rows(tuple(s["shape"]), 0, s["shape"][0] if s["shape"] else 0))],
                            None if full is None else full[i], finite=s["finite"])
                for i, s in enumerate(specs["datasets"])]
    root = dict(specs["root_attrs"], io_mode="local", nwriters=1, reason="local")
    return commit.write_and_publish(WritePlan(datasets, root, specs["group_attrs"]), info, comm, False, verify,
                                    retention)


def _memory_line(base, nodes, sizes, dest, sources):
    """Rank 0's line at the first snapshot: where, and the most memory (or disk) a node's snapshots take."""
    per_node = {}
    for node, (own, copies) in zip(nodes, sizes):
        per_node[node] = per_node.get(node, 0) + own + copies
    node, most = max(per_node.items(), key=lambda kv: kv[1])
    free = f", {_mib(_free_bytes(base))} free there now" if os.path.isdir(base) else ""
    copies = ("each part also kept on the next node" if dest is not None or sources
              else "one node: no copies on another node, so the level survives a rank's loss, not the node's")
    return (f"hpctrain: node-local checkpoints in {base}/<node>: at most {_mib(KEPT * most)} per node "
            f"({KEPT} snapshots of {_mib(most)} on {node}; {copies}){free}")


def _recovered_line(step, newer_than, holders, chosen, skipped, path, seconds):
    copies = sorted(o for o, (_, _, copy) in chosen.items() if copy)
    return (f"hpctrain: recovered step {step} from the node-local checkpoints on {', '.join(holders)}"
            f"{f' (the newest HDF5 checkpoint is of step {newer_than})' if newer_than else ''}, "
            f"written to {os.path.basename(path)} in {seconds:.2f} s"
            + (f"; the part(s) of rank(s) {', '.join(map(str, copies))} from their copies" if copies else "")
            + "".join(f"; step {s} passed over: the part(s) of rank(s) {', '.join(map(str, missing))} survive "
                      f"intact nowhere" for s, missing in skipped))


def _incomplete_line(skipped, newer_than):
    lost, missing = skipped
    back = f"the HDF5 checkpoint of step {newer_than}" if newer_than else "step 0"
    return (f"hpctrain: the node-local checkpoint of step {lost} is incomplete: the parts of rank(s) "
            f"{', '.join(map(str, missing))} survive intact on no node of the job (nor any copy of them); "
            f"resuming from {back} instead: {lost - newer_than} steps to compute again")


def _short_of_room_here(comm, plan, nodes, dests, local_dir):
    """Collective, before the first snapshot with ``checkpoint.local = "auto"``: :func:`short_of_room` for this
    job's nodes, said by rank 0."""
    rank = comm.Get_rank()
    own = sum(np.asarray(d.mine).nbytes for d in plan.datasets if d.mine is not None and d.region_of(rank) is not None)
    why = short_of_room(comm.allgather((own, _free_bytes(local_dir))), nodes, dests, local_dir)
    if why and rank == 0:
        print(f'hpctrain: node-local checkpoints turned off (checkpoint.local = "auto"): {why}; the HDF5 checkpoints '
              f"go on. HINT: set checkpoint.local_dir to a local disk with room", flush=True)
    return why


def short_of_room(sizes, nodes, dests, local_dir):
    """Why the snapshots do not fit, or None: ``sizes[r]`` is rank r's ``(part bytes, free bytes where it runs)``,
    ``nodes[r]`` its node, ``dests[r]`` the rank that keeps a copy of its part (or None). A node holds :data:`KEPT`
    snapshots of its ranks' parts and of the copies sent to it, in at most half of its free space."""
    need, free = {}, {}
    for r, (nbytes, room) in enumerate(sizes):
        for q in (r, dests[r]):
            if q is not None:
                need[nodes[q]] = need.get(nodes[q], 0) + KEPT * nbytes
        free[nodes[r]] = room
    short = [n for n in need if need[n] > free[n] / 2]
    if not short:
        return None
    return (f"{KEPT} snapshots with their copies need {_mib(need[short[0]])} of {local_dir} on {short[0]}, more "
            f"than half of its {_mib(free[short[0]])} free")


def _local_dir_problem(local_dir, world):
    """Why this rank's node cannot keep snapshots in ``local_dir``, or None."""
    if not os.path.isdir(local_dir) or not os.access(local_dir, os.W_OK | os.X_OK):
        return f"checkpoint.local_dir = {local_dir!r} is not a writable directory on {world.node}"
    return None


def _free_bytes(path):
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
