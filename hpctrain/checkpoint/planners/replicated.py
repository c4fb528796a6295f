"""Checkpoints of data-parallel states: every rank holds the whole model (and, with ``comm.shard``, its slice
of the optimizer: :mod:`.sharded`). The ranks share out the rows of the one model to write and read
(:func:`format.plan_pieces`); the replicas are compared first (``checkpoint.consistency``).
:class:`ReplicatedPlanner` is what :class:`~.manager.CheckpointManager` asks by default (split models hand it
theirs: ``hpctrain.parallel.checkpoint.SplitPlanner``); :func:`save_checkpoint`, :func:`load_checkpoint` and
:func:`verify_checkpoint` do the same for one file, without a manager."""
import logging
import os

from ...errors import CheckpointError
from ...runtime import allocator
from ...runtime.coordination import all_or_none, everywhere, on_root
from ...runtime.replicas import compare_replicas, copy_replica
from ...runtime.system import usable_cpus
from ..commit import begin, io_mode, write_into_place
from ..content import format as fmt
from ..content import snapshot
from ..content.plan import copy_own_pieces, plan_snapshot
from ..io import reader
from ..io.iosettings import io_of, io_settings_for
from . import sharded

log = logging.getLogger("hpctrain.checkpoint")


def check_consistency(model, comm, mode="check"):
    """Collective: compare fingerprints of every rank's model tensors (the ranks of ``comm`` hold replicas of
    one model, or of one part of it). ``"check"``: raise CheckpointError naming the ranks that diverged;
    ``"repair"``: copy the tensors of the largest group of equal ranks to the others (with a warning);
    ``"off"``: do nothing."""
    found = None if mode == "off" else compare_replicas(model, comm)
    if found is None:
        return
    root, (diverged, source), first = found
    ranks = ", ".join(map(str, diverged))
    if mode == "repair":
        if comm.Get_rank() == 0:
            log.warning("ranks %s hold model tensors that differ from rank %d's (first: %s); copying "
                        "rank %d's to every rank (checkpoint.consistency=repair)", ranks, source, first, source)
        copy_replica(model, comm, root)
        return
    raise everywhere(CheckpointError(
        f"ranks {ranks} hold model tensors that differ from rank {source}'s (first differing: {first}); "
        f"the replicas have diverged, so no checkpoint was written",
        hint="look for rank-dependent code in the model or a missed broadcast of the initial "
             "parameters; checkpoint.consistency=repair copies one replica's parameters to the others"))


class ReplicatedPlanner:
    """Who writes and reads what of a data-parallel (or sharded) state, for the manager."""

    collective_only = False  # serial HDF5 (rank 0 alone) will do where h5py has no MPI-IO

    def __init__(self, comm, consistency="check"):
        self.comm, self.consistency = comm, consistency

    def check_replicas(self, state):
        """Collective: the ranks holding copies of the same tensors must agree."""
        check_consistency(state.model, self.comm, self.consistency)

    def plan(self, state, info, parallel, buffers=None):
        """This rank's plan; ``buffers`` (a background save): its pieces copied into them."""
        return _plan(state, info, self.comm, parallel, copy=buffers is not None, buffers=buffers)

    def load(self, path, state):
        """Collective: read ``path`` into ``state``; returns its header."""
        return load_checkpoint(path, state, self.comm)


def _plan(state, info, comm, parallel, copy=False, buffers=None):
    if sharded.is_sharded(state):  # comm.shard: each rank writes its optimizer slice's rows
        sharded.check_parallel(parallel)
        return sharded.plan(state, info, comm, copy=copy)
    snap = snapshot.take_snapshot(state, info)
    plan = plan_snapshot(snap, comm.Get_size() if parallel else 1, comm.Get_rank(), io_of(info).alignment)
    if copy:
        copy_own_pieces(plan, {} if buffers is None else buffers, workers=min(4, usable_cpus()))
    return plan


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
    check_consistency(state.model, comm, consistency)
    if io is None:
        io = on_root(lambda: io_settings_for(os.path.dirname(os.path.abspath(path))), comm)
    info = begin(path, comm, parallel, run_config=run_config, metrics=metrics, reason=reason, step=state.progress.step,
                 io=io)
    return write_into_place(_plan(state, info, comm, parallel), info, comm, parallel, verify)


def load_checkpoint(path, state, comm=None, restore_rng=True):
    """Collective: read checkpoint ``path`` into ``state`` (model, optimizer, progress) in place, on any
    number of ranks (each reads a share), checksums verified. A file that does not fit ``state`` (model
    shapes, optimizer groups) or cannot be opened raises :class:`CheckpointError` on every rank before
    ``state`` changes. The data is read straight into the state's own CPU tensors (not a second copy in
    memory), so a ``CheckpointCorrupt`` for failed checksums leaves them holding part of the file: load
    another checkpoint before training on (``CheckpointManager.resume`` tries the previous one itself).

    >>> load_checkpoint("run/checkpoints/ckpt-00000100.h5", state)   # doctest: +SKIP
    """
    comm = _comm(comm)
    parallel, _ = io_mode(comm)
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


def verify_checkpoint(path):
    """Check every checksum of ``path`` in this process alone. Returns the problems found,
    each naming the dataset; an empty list means the file is valid.

    >>> assert not verify_checkpoint("ckpt-00000100.h5")   # doctest: +SKIP
    """
    return reader.verify_file(path)
