"""Writing a checkpoint file: collectively through MPI-IO (every rank writes its pieces),
or by rank 0 alone where h5py has no MPI support.

What differs between data-parallel and split models is only the *plan*: a list of
:class:`DatasetPlan` saying, for every dataset, which rank writes which region and, on this
rank, the array of its piece. :func:`plan_snapshot` makes it for data-parallel replicas
(every rank holds every array; :func:`format.plan_pieces` shares out rows);
``hpctrain.parallel.checkpoint`` makes it for split models.

Parallel HDF5 requires every rank to make the same metadata calls with the same arguments
and to enter every collective write. So a rank that fails keeps going through the
remaining calls with an empty share, and the ranks agree on the errors at fixed points:
one rank's failure becomes the same :class:`CheckpointError` on all, never a hang.
"""
import contextlib
import errno
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import fsutil
from ..coordination import any_rank, everywhere, on_root, raise_if_any
from ..errors import CheckpointError
from . import format as fmt

log = logging.getLogger("hpctrain.checkpoint")

# Lowest HDF5 format features that allow attributes over 64 KiB (large param_groups JSON)
# while staying readable by any HDF5 >= 1.8.
LIBVER = ("v108", "v108")

# Test hook: {"rank": r, "path": dataset path} makes rank r fail that dataset's write with
# ENOSPC, as a full disk would, while still taking part in the collective.
FAULT = None

_UNCLOSABLE = []


@dataclass
class DatasetPlan:
    """One dataset of the file and who writes it: ``pieces`` is ``[(rank, region)]`` for
    every rank (regions as in :mod:`format`, at most one per rank, together the whole
    dataset); ``mine`` is this rank's piece, shaped like its region, or None."""

    path: str
    shape: Tuple[int, ...]
    dtype: np.dtype  # as stored
    attrs: Dict[str, Any]
    pieces: List[Tuple[int, tuple]]
    mine: Optional[np.ndarray] = None
    finite: bool = False  # must hold no NaN or infinity (parameters, optimizer state)
    private: bool = False  # ``mine`` is the save's own memory, not a view of training's tensor

    @property
    def nbytes(self):
        return fmt.nbytes_of(self.shape, self.dtype.itemsize)

    def region_of(self, rank):
        return next((region for r, region in self.pieces if r == rank), None)


@dataclass
class Plan:
    """Everything one file holds, and who writes which part of it."""

    datasets: List[DatasetPlan]
    root_attrs: Dict[str, Any]
    group_attrs: Dict[str, Dict[str, Any]]  # group path -> attributes
    finite_checked: bool = False  # check_finite already ran (a background save checks first)
    own_nonfinite: Optional[List[int]] = None  # this rank's non-finite datasets, where already known

    @property
    def nbytes(self):
        return sum(d.nbytes for d in self.datasets)


def plan_snapshot(snap, nwriters, rank):
    """The plan for a data-parallel :class:`~.snapshot.Snapshot`, of which every rank holds
    every array: ``nwriters`` ranks share the rows as :func:`format.plan_pieces` says."""
    arrays = [e.array for e in snap.entries]
    rows = fmt.plan_pieces([(a.shape, a.dtype.itemsize) for a in arrays], nwriters)
    datasets = []
    for entry, array, pieces in zip(snap.entries, arrays, rows):
        mine = next((array[a:b] if array.ndim else array for r, a, b in pieces if r == rank), None)
        datasets.append(DatasetPlan(entry.path, array.shape, array.dtype, entry.attrs,
                                    [(r, fmt.rows(array.shape, a, b)) for r, a, b in pieces], mine,
                                    finite=entry.finite, private=entry.private))
    return Plan(datasets, snap.root_attrs, snap.group_attrs)


def h5py_parallel():
    import h5py

    return bool(h5py.get_config().mpi)


# Bytes checksummed (and checked for NaN) at a time: small enough to stay in cache between
# the two, a multiple of every itemsize.
SCAN_BYTES = 1 << 20


def own_checksums(datasets, rank, crc=True, finite=True):
    """``([(dataset index, byte offset, nbytes, crc)], [indices of non-finite datasets])`` of
    this rank's pieces: one checksum per contiguous run of bytes its region covers, and, for
    datasets marked ``finite``, whether its piece holds a NaN or infinity. One pass over the
    bytes does both (``crc`` / ``finite`` False: leave that part out)."""
    out, bad = [], []
    for i, d in enumerate(datasets):
        sums, ok = piece_checksums(i, d, rank, crc, finite)
        out += sums
        if not ok:
            bad.append(i)
    return out, bad


def piece_checksums(i, d, rank, crc=True, finite=True):
    """``own_checksums`` of dataset ``d`` alone (its index ``i``): ``(runs, finite)``."""
    region = d.region_of(rank)
    if region is None:
        return [], True
    flat = np.ascontiguousarray(d.mine).reshape(-1).view(np.uint8)
    check = finite and d.finite and fmt.can_be_nonfinite(d.attrs.get(fmt.DTYPE_ATTR, ""))
    out, ok, pos = [], True, 0
    for offset, nbytes in fmt.runs(d.shape, region, d.dtype.itemsize):
        c = 0
        for a in range(pos, pos + nbytes, SCAN_BYTES):
            chunk = flat[a:min(pos + nbytes, a + SCAN_BYTES)]
            if crc:
                c = fmt.crc32(chunk, c)
            if check and ok:
                ok = fmt.all_finite(chunk.view(d.dtype), d.attrs[fmt.DTYPE_ATTR])
        if crc:
            out.append((i, offset, nbytes, c))
        pos += nbytes
    return out, ok


def refuse_nonfinite(datasets, gathered_bad, path):
    """Raise :class:`~.format.NonFiniteState` (the same on every rank: ``gathered_bad`` is
    every rank's list of non-finite dataset indices) naming the tensors, if there are any."""
    bad = sorted({i for rank_bad in gathered_bad for i in rank_bad})
    if not bad:
        return
    names = [f"/{datasets[i].path}" for i in bad]
    raise everywhere(fmt.NonFiniteState(
        f"refusing to write {os.path.basename(_final_name(path))}: NaN or infinite values in {len(bad)} "
        f"tensor(s) that must be finite: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}; "
        f"the checkpoint was not written, the previous checkpoints and `latest` are untouched",
        hint="the run has diverged: roll back to the last good checkpoint (CheckpointManager.load_latest, "
             "or restart with checkpoint.resume=auto) and lower the learning rate or clip gradients"))


def _final_name(path):
    """The checkpoint's name from its temp file's name."""
    from ..fsutil import TMP_MARK

    return path.split(TMP_MARK)[0]


def mark_finite(plan):
    """Mark as ``finite`` what a reader checks too (:func:`format.finite_paths`): the
    parameters the optimizer's ``param_groups`` name, and optimizer state; so plans made
    elsewhere (split models) are checked alike."""
    must = fmt.finite_paths(plan.group_attrs, [d.path for d in plan.datasets])
    for d in plan.datasets:
        d.finite = d.finite or d.path in must


def check_finite(plan, comm, path):
    """Collective: refuse (the same error on every rank) if a dataset marked ``finite`` holds
    NaN or infinity. Every rank checks only the rows it will write (or has checked them
    already: :func:`copy_own_pieces`)."""
    mark_finite(plan)
    bad = plan.own_nonfinite
    if bad is None:
        _, bad = own_checksums(plan.datasets, comm.Get_rank(), crc=False)
    refuse_nonfinite(plan.datasets, comm.allgather(bad), path)
    plan.finite_checked = True


# Elements a copy worker takes at a time (of SCAN_BYTES each): the unit the threads share.
COPY_TASK_SCANS = 16


def copy_own_pieces(plan, buffers, workers=1):
    """A background save's pieces in memory that training does not touch.

    Each piece this rank writes (``mine``, a view of training's tensor) is copied into the
    host buffer ``buffers`` kept for its path from the previous save, where it still fits
    (fresh memory costs a page fault per page on top of the copy), and checked for NaN in
    the same pass, while it is in cache. Only this rank's rows are copied: on n ranks, 1/n
    of the state. ``workers`` threads share the bytes (numpy copies and checks without the
    GIL): cores that the rank may use and training, waiting for this, does not. ``buffers``
    is updated to hold exactly this save's buffers; reuse them only once it is written.
    Sets ``plan.own_nonfinite`` for :func:`check_finite`."""
    mark_finite(plan)
    old = dict(buffers)
    buffers.clear()
    tasks = []
    for i, d in enumerate(plan.datasets):
        if d.mine is None or d.private:
            continue
        src = np.ascontiguousarray(d.mine)
        buf = old.get(d.path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = np.empty_like(src)
        buffers[d.path] = d.mine = buf
        name = d.attrs.get(fmt.DTYPE_ATTR, "")
        check = d.finite and fmt.can_be_nonfinite(name)
        flat_src, flat_buf = src.reshape(-1), buf.reshape(-1)
        scan = max(1, SCAN_BYTES // src.dtype.itemsize)
        step = scan * COPY_TASK_SCANS
        tasks += [(i, flat_src, flat_buf, lo, min(lo + step, flat_src.size), scan, name if check else None)
                  for lo in range(0, flat_src.size, step)]

    def run(task):
        i, src, buf, lo, hi, scan, name = task
        ok = True
        for a in range(lo, hi, scan):
            b = min(hi, a + scan)
            np.copyto(buf[a:b], src[a:b])
            if name is not None and ok:
                ok = fmt.all_finite(buf[a:b], name)
        return i, ok

    if workers > 1 and len(tasks) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(workers, len(tasks)), thread_name_prefix="hpctrain-snapshot") as pool:
            checks = list(pool.map(run, tasks))
    else:
        checks = [run(t) for t in tasks]
    plan.own_nonfinite = sorted({i for i, ok in checks if not ok})
    return plan.own_nonfinite


def combine_checksums(gathered, ndatasets):
    """Per-dataset CRC-32 from every rank's ``own_checksums`` lists."""
    per = [[] for _ in range(ndatasets)]
    for rank_list in gathered:
        for i, offset, nbytes, crc in rank_list:
            per[i].append((offset, nbytes, crc))
    return [fmt.combine_pieces(p) for p in per]


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"


def agree(errors, comm, path, what):
    """Raise the same CheckpointError on every rank if any rank has errors."""
    raise_if_any(errors, comm, lambda problems: CheckpointError(
        f"{what} {path} failed:\n  " + "\n  ".join(problems[:20]), hint=_hint(problems)))


def _hint(problems):
    text = " ".join(problems)
    if "No space left" in text or "ENOSPC" in text or "errno = 28" in text:
        return "the file system is full: free space, lower checkpoint.keep_last, or point checkpoint.directory elsewhere"
    if "Permission denied" in text or "Read-only" in text:
        return "make the checkpoint directory writable by the job, or set checkpoint.directory"
    return "the previous checkpoint and `latest` are untouched; see the messages above for the failing rank"


def _dataset_attrs(d, crc):
    # Created with crc 0 and sealed with the real one: the metadata checksum covers this set.
    return dict(d.attrs, **{fmt.CRC_ATTR: np.uint32(crc)})


def _root_attrs(plan):
    # Every dataset's path, so that a reader can name one that went missing.
    return dict(plan.root_attrs, ndatasets=len(plan.datasets), datasets=fmt.to_json([d.path for d in plan.datasets]))


def create_layout(f, plan):
    """Every group, dataset and attribute of ``plan``. The checksums (each dataset's CRC-32
    and the metadata checksum) are 0 here: they are taken while the data is written, and
    :func:`seal` writes them over in place, so the file is laid out as if they were known."""
    for gpath in sorted(plan.group_attrs):
        group = f.require_group(gpath)
        for key, value in sorted(plan.group_attrs[gpath].items()):
            group.attrs[key] = value
    dsets = []
    for d in plan.datasets:
        # fill_time="never": without it parallel HDF5 writes zeros over the whole dataset first.
        dset = f.create_dataset(d.path, shape=d.shape, dtype=d.dtype, fill_time="never")
        for key, value in sorted(_dataset_attrs(d, 0).items()):
            dset.attrs[key] = value
        dsets.append(dset)
    for key, value in sorted(_root_attrs(plan).items()):
        f.attrs[key] = value
    f.attrs[fmt.METADATA_CRC_ATTR] = np.uint32(0)
    return dsets


def seal(f, plan, dsets, checksums):
    """Write the CRC-32 of every dataset, and last the metadata checksum over every attribute
    (:func:`format.metadata_crc`, computed from the values written), into their places. The
    same values on every rank."""
    described = {}
    for d, dset, crc in zip(plan.datasets, dsets, checksums):
        dset.attrs.modify(fmt.CRC_ATTR, np.uint32(crc))
        described[d.path] = (d.shape, np.dtype(d.dtype).str, _dataset_attrs(d, crc))
    groups = {gpath: dict(attrs) for gpath, attrs in plan.group_attrs.items()}
    f.attrs.modify(fmt.METADATA_CRC_ATTR, np.uint32(fmt.metadata_crc(_root_attrs(plan), groups, described)))


# Bytes per write call. h5py holds the GIL for a whole call, so a background save keeps its
# calls small enough for the training thread to run between them (and writes independently:
# no call waits for another rank's background thread, which training slows down); a save in
# the foreground makes fewer, larger calls (each collective call waits for the slowest rank).
CALL_BYTES = 4 << 20
FOREGROUND_CALL_BYTES = 512 << 20


def _rows_per_call(region, itemsize, call_bytes):
    return max(1, call_bytes // max(1, itemsize * math.prod(b - a for a, b in region[1:])))


def _calls(d, call_bytes):
    """Collective calls for one dataset: the same number on every rank (from the plan)."""
    if not d.shape:
        return 1
    return max(1, max((-(-(r[0][1] - r[0][0]) // _rows_per_call(r, d.dtype.itemsize, call_bytes))
                       for _, r in d.pieces), default=0))


def _chunks(d, region, call_bytes):
    """``[(rows of the local piece, global region)]`` of the write calls for ``region``."""
    if not region:  # a scalar (``...`` keeps it an array)
        return [(..., ())]
    (a, b), rest = region[0], region[1:]
    step = _rows_per_call(region, d.dtype.itemsize, call_bytes)
    return [(slice(lo - a, min(b, lo + step) - a), ((lo, min(b, lo + step)),) + rest)
            for lo in range(a, b, step)]


def _check_fault(path, rank):
    if FAULT and FAULT.get("rank") == rank and FAULT.get("path") == path:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def write_empty(dset):
    """Take part in a collective write with nothing to write."""
    from h5py import h5fd, h5p, h5s

    fspace = dset.id.get_space()
    fspace.select_none()
    mspace = h5s.create_simple((1,))
    mspace.select_none()
    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    dset.id.write(mspace, fspace, np.zeros(1, dtype=dset.dtype), dxpl=dxpl)


def _write_alone(dset, d, region, call_bytes):
    """Independent writes of this rank's piece, ``call_bytes`` a call."""
    for local, where in _chunks(d, region, call_bytes):
        dset[fmt.slices(where)] = d.mine[local]


# Seconds that HDF5's collective metadata write (flush, close) may take before the job is
# aborted. When one rank's write fails inside it (a file-size limit, a full disk, an I/O
# error on one node), the other ranks wait in MPI for ever and no exception reaches them;
# an abort that names the file is the only way out that does not hang.
COLLECTIVE_TIMEOUT = 600.0
# The same after a write failed on some rank: the data is not written any more (the file was
# truncated), closing has only the metadata left to write.
FAILED_CLOSE_TIMEOUT = 60.0


@contextlib.contextmanager
def or_abort(what, path, rank, errors=(), seconds=None):
    """Abort the job if the block has not finished in ``seconds`` (``COLLECTIVE_TIMEOUT``);
    ``errors``: what already failed on this rank, said first."""
    seconds = COLLECTIVE_TIMEOUT if seconds is None else seconds

    def fire():
        from mpi4py import MPI

        from ..coordination import abort_job
        from ..world import node_name

        os.write(2, (f"hpctrain: error: rank {rank} on {node_name()}: {what} {path} did not finish in "
                     f"{seconds:.0f} s{' after ' + '; '.join(errors) if errors else ''}: a rank's write failed inside HDF5's collective call (see the "
                     f"MPI-IO messages above) and the other ranks would wait for ever; aborting the job. "
                     f"The previous checkpoint and `latest` are untouched.\nHINT: check space, quotas and "
                     f"file-size limits (ulimit -f) of {os.path.dirname(path)} on every node\n").encode())
        abort_job(MPI.COMM_WORLD)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def write_parallel(path, plan, comm, call_bytes=CALL_BYTES, collective=True):
    """All ranks write ``plan`` into a new file ``path`` (collective); returns the checksums.

    Datasets split among ranks are written in collective calls of up to ``call_bytes``
    per rank; a dataset that one rank holds whole is written by that rank alone
    (independent I/O), so small tensors cost no collective call and no rank waits on
    another's small write. ``collective=False``: every piece is written independently
    (a background save: its ranks do not wait for each other between calls).

    Each piece is checksummed (and checked for NaN) right before it is written, so the
    disk is busy from the first dataset on; the checksums, the same on every rank once
    gathered, are written into their attributes after the data (:func:`seal`). A NaN found
    on any rank refuses the save on all, and the file is left for the caller to remove."""
    import h5py

    rank = comm.Get_rank()
    datasets = plan.datasets
    mark_finite(plan)
    finite = not plan.finite_checked
    sums, bad = [], []

    def checked(i, d):
        runs, ok = piece_checksums(i, d, rank, finite=finite)
        sums.extend(runs)
        if not ok:
            bad.append(i)

    errors, f, failed, refusal = [], None, False, None
    try:
        f = h5py.File(path, "w", driver="mpio", comm=comm, libver=LIBVER)
    except Exception as exc:
        errors.append(f"creating the file: {_describe(exc)}")
    agree(errors, comm, path, "creating")
    try:
        try:
            dsets = create_layout(f, plan)
        except Exception as exc:
            errors.append(f"creating datasets: {_describe(exc)}")
        agree(errors, comm, path, "creating datasets in")
        alone = []
        for i, (d, dset) in enumerate(zip(datasets, dsets)):
            region = d.region_of(rank)
            try:
                _check_fault(d.path, rank)  # the hook fails the named rank, owner or not
            except OSError as exc:
                errors.append(f"writing /{d.path}: {_describe(exc)}")
                region = None  # still enter the collectives, with nothing
            if len(d.pieces) == 1 or not collective:
                if region is not None:
                    alone.append((i, d, dset, region))
                continue
            if region is not None:
                try:
                    checked(i, d)
                except Exception as exc:  # this rank still enters the collectives, with nothing
                    errors.append(f"checksumming /{d.path}: {_describe(exc)}")
                    region = None
            chunks = _chunks(d, region, call_bytes) if region is not None else []
            for call in range(_calls(d, call_bytes)):
                try:
                    with dset.collective:
                        if call < len(chunks):
                            local, where = chunks[call]
                            dset[fmt.slices(where)] = d.mine[local]
                        else:
                            write_empty(dset)
                except Exception as exc:  # from HDF5 itself, e.g. the disk filled up
                    errors.append(f"writing /{d.path}: {_describe(exc)}")
        for i, d, dset, region in alone:
            try:
                checked(i, d)
                _write_alone(dset, d, region, call_bytes)
            except Exception as exc:
                errors.append(f"writing /{d.path}: {_describe(exc)}")
        gathered = comm.allgather((errors, sums, bad))
        failed = any(e for e, _, _ in gathered)
        if not failed:
            try:
                refuse_nonfinite(datasets, [b for _, _, b in gathered], path)
                checksums = combine_checksums([s for _, s, _ in gathered], len(datasets))
                seal(f, plan, dsets, checksums)  # the same values on every rank
            except fmt.NonFiniteState as exc:
                refusal, failed = exc, True
            except Exception as exc:
                errors.append(f"writing the checksums: {_describe(exc)}")
                failed = any_rank(True, comm)
            else:
                failed = any_rank(False, comm)
        if failed and rank == 0:
            # The file is garbage now. Truncating it gives back the space a full disk
            # needs for the metadata that closing writes; a close that fails leaves
            # HDF5 in a state that crashes the process later.
            try:
                os.truncate(path, 0)
            except OSError:
                pass
        comm.Barrier()
        # No flush (MPI_File_sync) here: closing writes the metadata, and every rank then
        # fsyncs the file itself (:func:`sync_started`), while the verification re-reads it.
    finally:
        if f is not None:
            try:
                with or_abort("closing", path, rank, list(errors),
                              min(COLLECTIVE_TIMEOUT, FAILED_CLOSE_TIMEOUT) if failed else None):
                    f.close()
            except Exception as exc:
                errors.append(f"closing: {_describe(exc)}")
                _UNCLOSABLE.append(f)  # never let HDF5 free it again (see above)
    if refusal is not None:
        raise refusal
    if errors:
        errors.append(_space_note(path, plan.nbytes))
    agree(errors, comm, path, "writing")
    return checksums


def _space_note(path, needed):
    """HDF5 reports a full disk as "file write failed" without errno: say it in words."""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return "could not ask the file system for its free space"
    free = st.f_bavail * st.f_frsize
    if free < needed:
        return f"No space left on device: {free} bytes free, the checkpoint needs {needed}"
    return f"{free} bytes free on the file system, the checkpoint needs {needed}"


def write_serial(path, plan, call_bytes=FOREGROUND_CALL_BYTES):
    """This process alone writes ``plan`` (made for one writer, rank 0) with the default
    (POSIX) driver; returns the checksums, taken as in :func:`write_parallel` while each
    dataset is written. The file is left for the caller to remove on any error."""
    import h5py

    mark_finite(plan)
    sums, bad = [], []
    try:
        with h5py.File(path, "w", libver=LIBVER) as f:
            dsets = create_layout(f, plan)
            for i, (d, dset) in enumerate(zip(plan.datasets, dsets)):
                runs, ok = piece_checksums(i, d, 0, finite=not plan.finite_checked)
                sums.extend(runs)
                if not ok:
                    bad.append(i)
                    continue  # refused below: no need to write it
                try:
                    _check_fault(d.path, 0)
                    _write_alone(dset, d, d.region_of(0), call_bytes)
                except Exception as exc:
                    raise CheckpointError(f"writing {path} failed: /{d.path}: {_describe(exc)}",
                                          hint=_hint([str(exc)])) from exc
            refuse_nonfinite(plan.datasets, [bad], path)
            checksums = combine_checksums([sums], len(plan.datasets))
            seal(f, plan, dsets, checksums)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"writing {path} failed: {_describe(exc)}", hint=_hint([str(exc)])) from exc
    return checksums


def sync_started(path, parallel, rank):
    """Start fsyncing ``path`` on this rank (every rank when ``parallel``, so that each node's
    writes reach the file system, as ``MPI_File_sync`` would have; rank 0 alone otherwise) in a
    thread: the disk writes back while this thread re-reads and checksums from memory.
    Returns ``finish()``, which waits for it and returns its error messages (``[]``: durable)."""
    if not parallel and rank != 0:
        return lambda: []
    errors = []

    def run():
        try:
            fsutil.fsync_path(path)
        except Exception as exc:
            errors.append(f"fsync: {_describe(exc)}")

    thread = threading.Thread(target=run, name="hpctrain-checkpoint-fsync", daemon=True)
    thread.start()

    def finish():
        thread.join()
        return errors

    return finish


def write_file(path, plan, comm, parallel, call_bytes=CALL_BYTES, collective=True):
    """Write ``plan`` to ``path`` on every rank's behalf; the same outcome on all ranks.
    Without ``parallel`` the plan must give everything to rank 0. ``collective``: see
    :func:`write_parallel`."""
    if parallel:
        return write_parallel(path, plan, comm, call_bytes, collective)
    return on_root(lambda: write_serial(path, plan, call_bytes), comm)
