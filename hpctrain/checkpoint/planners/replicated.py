"""Checkpoints of data-parallel states: every rank holds the whole model (and, with ``comm.shard``, its slice
of the optimizer: :mod:`.sharded`). The ranks share out the rows of the one model to write and read
(:func:`format.plan_pieces`); the replicas are compared first (``checkpoint.consistency``).
:class:`DataParallelPlanner` is what :class:`~.manager.CheckpointManager` asks by default: it hands a state to
:class:`ReplicatedPlanner` or, sharded, to :class:`~.sharded.ShardedPlanner` (split models hand the manager
theirs: ``hpctrain.parallel.checkpoint.SplitPlanner``); every planner loads through :func:`.reader.read`.
:func:`save_checkpoint`, :func:`load_checkpoint` and :func:`verify_checkpoint` do the same for one file,
without a manager."""
import os

from ...runtime import allocator
from ...runtime.coordination import all_or_none, on_root
from ...runtime.system import usable_cpus
from ..commit import begin, io_mode, write_into_place
from ..content import format as fmt
from ..content import snapshot
from ..content.plan import copy_own_pieces, plan_snapshot
from ..io import reader
from ..io.iosettings import io_of, io_settings_for
from . import sharded
from .consistency import check_consistency

class ReplicatedPlanner:
    """Who writes and reads what of a data-parallel state, for the manager: the ranks share out the rows of
    the one model (and optimizer) they all hold."""

    collective_only = False  # serial HDF5 (rank 0 alone) will do where h5py has no MPI-IO

    def __init__(self, comm, consistency="check"):
        self.comm, self.consistency = comm, consistency

    def check_replicas(self, state):
        """Collective: the ranks holding copies of the same tensors must agree."""
        check_consistency(state.model, self.comm, self.consistency)

    def plan(self, state, info, parallel, buffers=None):
        """This rank's plan; ``buffers`` (a background save): its pieces copied into them."""
        plan = plan_snapshot(snapshot.take_snapshot(state, info), self.comm.Get_size() if parallel else 1,
                             self.comm.Get_rank(), io_of(info).alignment)
        if buffers is not None:
            copy_own_pieces(plan, buffers, workers=min(4, usable_cpus()))
        return plan

    def load(self, path, state, restore_rng=True):
        """Collective: read ``path`` into ``state``; returns its header."""
        comm = self.comm
        parallel, _ = io_mode(comm)

        def header():
            h = reader.read_header(path)
            snapshot.check_model_against(state.model, h.datasets, path)
            return h

        h = on_root(header, comm)
        all_or_none(lambda: snapshot.check_optimizer_groups(state, h.group_attrs, path), comm)
        own = snapshot.in_place_targets(state, h.datasets)
        # What is not read in place allocates and frees large buffers once: reused, not faulted in afresh each
        # time, and given back afterwards (hpctrain.runtime.allocator).
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


class DataParallelPlanner:
    """The manager's default planner: each call goes to :class:`~.sharded.ShardedPlanner` for a state with a
    sharded optimizer (``comm.shard``), to :class:`ReplicatedPlanner` otherwise; the state decides, not the
    configuration, so a manager built before the optimizer is wrapped still plans right."""

    collective_only = False

    def __init__(self, comm, consistency="check"):
        self.replicated = ReplicatedPlanner(comm, consistency)
        self.sharded = sharded.ShardedPlanner(comm, consistency)

    def planner_for(self, state):
        return self.sharded if sharded.is_sharded(state) else self.replicated

    def check_replicas(self, state):
        self.planner_for(state).check_replicas(state)

    def plan(self, state, info, parallel, buffers=None):
        return self.planner_for(state).plan(state, info, parallel, buffers)

    def load(self, path, state, restore_rng=True):
        return self.planner_for(state).load(path, state, restore_rng)


def _comm(comm):
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return getattr(comm, "comm", comm)  # a World is accepted too


def save_checkpoint(path, state, comm=None, run_config=None, metrics=None, reason="manual",
                    verify=True, consistency="check", io=None):
    """Collective: write ``state`` to the checkpoint file ``path`` (atomically: temp file, checksums verified,
    fsync, rename). No ``latest``, no retention: see :class:`~.manager.CheckpointManager`. ``io``: the file's
    layout and MPI-IO hints (:class:`~.iosettings.IOSettings`); None: chosen for the directory's file system.

    >>> save_checkpoint("run/ckpt-00000100.h5", state, comm)   # doctest: +SKIP
    """
    comm = _comm(comm)
    parallel, _ = io_mode(comm)
    planner = DataParallelPlanner(comm, consistency)
    planner.check_replicas(state)
    if io is None:
        io = on_root(lambda: io_settings_for(os.path.dirname(os.path.abspath(path))), comm)
    info = begin(path, comm, parallel, run_config=run_config, metrics=metrics, reason=reason, step=state.progress.step,
                 io=io)
    return write_into_place(planner.plan(state, info, parallel), info, comm, parallel, verify)


def load_checkpoint(path, state, comm=None, restore_rng=True):
    """Collective: read checkpoint ``path`` into ``state`` (model, optimizer, progress) in place, on any
    number of ranks (each reads a share), checksums verified. A file that does not fit ``state`` (model
    shapes, optimizer groups) or cannot be opened raises :class:`CheckpointError` on every rank before
    ``state`` changes. The data is read straight into the state's own CPU tensors (not a second copy in
    memory), so a ``CheckpointCorrupt`` for failed checksums leaves them holding part of the file: load
    another checkpoint before training on (``CheckpointManager.resume`` tries the previous one itself).

    >>> load_checkpoint("run/checkpoints/ckpt-00000100.h5", state)   # doctest: +SKIP
    """
    return DataParallelPlanner(_comm(comm)).load(path, state, restore_rng)


def verify_checkpoint(path):
    """Check every checksum of ``path`` in this process alone. Returns the problems found,
    each naming the dataset; an empty list means the file is valid.

    >>> assert not verify_checkpoint("ckpt-00000100.h5")   # doctest: +SKIP
    """
    return reader.verify_file(path)
