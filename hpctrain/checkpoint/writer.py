"""Writing a snapshot into one HDF5 file: collectively through MPI-IO (every rank writes
its share), or by rank 0 alone where h5py has no MPI support.

Parallel HDF5 requires every rank to make the same metadata calls with the same arguments
and to enter every collective write. So a rank that fails keeps going through the
remaining calls with an empty share, and the ranks agree on the errors at fixed points:
one rank's failure becomes the same :class:`CheckpointError` on all, never a hang.
"""
import errno
import logging
import os

import numpy as np

from ..coordination import on_root
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


def h5py_parallel():
    import h5py

    return bool(h5py.get_config().mpi)


def _piece(array, start, stop):
    return array if array.ndim == 0 else array[start:stop]


def own_piece_checksums(entries, plan, rank):
    """``[(dataset index, byte offset, nbytes, crc)]`` of this rank's pieces."""
    out = []
    for i, (entry, pieces) in enumerate(zip(entries, plan)):
        rb = fmt.row_bytes(entry.array.shape, entry.array.dtype.itemsize)
        for r, start, stop in pieces:
            if r == rank:
                part = _piece(entry.array, start, stop)
                out.append((i, start * rb, part.nbytes, fmt.crc32_bytes(part)))
    return out


def combine_checksums(gathered, ndatasets):
    """Per-dataset CRC-32 from every rank's ``own_piece_checksums`` lists."""
    per = [[] for _ in range(ndatasets)]
    for rank_list in gathered:
        for i, offset, nbytes, crc in rank_list:
            per[i].append((offset, nbytes, crc))
    return [fmt.combine_pieces(p) for p in per]


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"


def agree(errors, comm, path, what):
    """Raise the same CheckpointError on every rank if any rank has errors."""
    import socket

    mine = [f"rank {comm.Get_rank()} on {socket.gethostname()}: {e}" for e in errors]
    everyone = comm.allgather(mine)
    problems = [p for rank_list in everyone for p in rank_list]
    if problems:
        raise fmt.everywhere(CheckpointError(f"{what} {path} failed:\n  " + "\n  ".join(problems[:20]),
                                             hint=_hint(problems)))


def _hint(problems):
    text = " ".join(problems)
    if "No space left" in text or "ENOSPC" in text or "errno = 28" in text:
        return "the file system is full: free space, lower checkpoint.keep_last, or point checkpoint.directory elsewhere"
    if "Permission denied" in text or "Read-only" in text:
        return "make the checkpoint directory writable by the job, or set checkpoint.directory"
    return "the previous checkpoint and `latest` are untouched; see the messages above for the failing rank"


def create_layout(f, snap, checksums):
    for gpath in sorted(snap.group_attrs):
        group = f.require_group(gpath)
        for key, value in sorted(snap.group_attrs[gpath].items()):
            group.attrs[key] = value
    dsets = []
    for entry, crc in zip(snap.entries, checksums):
        # fill_time="never": without it parallel HDF5 writes zeros over the whole dataset first.
        dset = f.create_dataset(entry.path, shape=entry.array.shape, dtype=entry.array.dtype,
                                fill_time="never")
        dset.attrs[fmt.CRC_ATTR] = np.uint32(crc)
        for key, value in sorted(entry.attrs.items()):
            dset.attrs[key] = value
        dsets.append(dset)
    for key, value in sorted(snap.root_attrs.items()):
        f.attrs[key] = value
    f.attrs["ndatasets"] = len(snap.entries)
    # Every dataset's path, so that a reader can name one that went missing.
    f.attrs["datasets"] = fmt.to_json([e.path for e in snap.entries])
    return dsets


# Bytes per write call. h5py holds the GIL for a whole call, so a background save keeps its
# calls small enough for the training thread to run between them; a save in the foreground
# makes fewer, larger calls (each collective call waits for the slowest rank).
CALL_BYTES = 32 << 20
FOREGROUND_CALL_BYTES = 512 << 20


def _rows_per_call(array, call_bytes=CALL_BYTES):
    return max(1, call_bytes // max(1, fmt.row_bytes(array.shape, array.dtype.itemsize)))


def _calls(array, pieces, call_bytes=CALL_BYTES):
    """Collective calls for one dataset: the same number on every rank (from the plan)."""
    if array.ndim == 0:
        return 1
    step = _rows_per_call(array, call_bytes)
    return max(1, max(-(-(b - a) // step) for _, a, b in pieces))


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


def _write_rows(dset, array, start, stop, step):
    """Independent writes of rows [start, stop), ``step`` rows a call."""
    if array.ndim == 0:
        dset[()] = array
        return
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        dset[lo:hi] = array[lo:hi]


def write_parallel(path, snap, comm, call_bytes=CALL_BYTES):
    """All ranks write ``snap`` into a new file ``path`` (collective).

    Datasets split among ranks are written in collective calls of up to ``call_bytes``
    per rank; a dataset that one rank holds whole is written by that rank alone
    (independent I/O), so small tensors cost no collective call and no rank waits on
    another's small write."""
    import h5py

    rank, size = comm.Get_rank(), comm.Get_size()
    entries = snap.entries
    plan = fmt.plan_pieces([(e.array.shape, e.array.dtype.itemsize) for e in entries], size)
    # Checksums first: parallel HDF5 wants attribute values identical on every rank.
    checksums = combine_checksums(comm.allgather(own_piece_checksums(entries, plan, rank)), len(entries))

    errors, f = [], None
    try:
        f = h5py.File(path, "w", driver="mpio", comm=comm, libver=LIBVER)
    except Exception as exc:
        errors.append(f"creating the file: {_describe(exc)}")
    agree(errors, comm, path, "creating")
    try:
        try:
            dsets = create_layout(f, snap, checksums)
        except Exception as exc:
            errors.append(f"creating datasets: {_describe(exc)}")
        agree(errors, comm, path, "creating datasets in")
        alone = []
        for entry, dset, pieces in zip(entries, dsets, plan):
            if len(pieces) == 1:
                try:
                    _check_fault(entry.path, rank)  # the hook fails the named rank, owner or not
                    if pieces[0][0] == rank:
                        alone.append((entry, dset, pieces[0]))
                except OSError as exc:
                    errors.append(f"writing /{entry.path}: {_describe(exc)}")
                continue
            mine = [(a, b) for r, a, b in pieces if r == rank and b > a]
            try:
                _check_fault(entry.path, rank)
            except OSError as exc:
                errors.append(f"writing /{entry.path}: {_describe(exc)}")
                mine = []  # still enter the collectives, with nothing
            step = _rows_per_call(entry.array, call_bytes)
            for call in range(_calls(entry.array, pieces, call_bytes)):
                part = None
                if mine:
                    a, b = mine[0]
                    lo, hi = a + call * step, min(b, a + (call + 1) * step)
                    part = (lo, hi) if hi > lo else None
                try:
                    with dset.collective:
                        if part is None:
                            write_empty(dset)
                        else:
                            dset[part[0]:part[1]] = entry.array[part[0]:part[1]]
                except Exception as exc:  # from HDF5 itself, e.g. the disk filled up
                    errors.append(f"writing /{entry.path}: {_describe(exc)}")
        for entry, dset, (_, a, b) in alone:
            try:
                _write_rows(dset, entry.array, a, b, _rows_per_call(entry.array, call_bytes))
            except Exception as exc:
                errors.append(f"writing /{entry.path}: {_describe(exc)}")
        failed = bool(comm.allreduce(len(errors)))
        if failed and rank == 0:
            # The file is garbage now. Truncating it gives back the space a full disk
            # needs for the metadata that closing writes; a close that fails leaves
            # HDF5 in a state that crashes the process later.
            try:
                os.truncate(path, 0)
            except OSError:
                pass
        comm.Barrier()
        if not failed:
            try:
                f.flush()  # MPI_File_sync: the data is on the file system before anyone renames
            except Exception as exc:
                errors.append(f"flushing: {_describe(exc)}")
    finally:
        if f is not None:
            try:
                f.close()
            except Exception as exc:
                errors.append(f"closing: {_describe(exc)}")
                _UNCLOSABLE.append(f)  # never let HDF5 free it again (see above)
    if errors:
        errors.append(_space_note(path, snap.nbytes))
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


def write_serial(path, snap):
    """Rank 0 alone writes the same format with the default (POSIX) driver."""
    import h5py

    entries = snap.entries
    checksums = [fmt.crc32_bytes(e.array) for e in entries]
    try:
        with h5py.File(path, "w", libver=LIBVER) as f:
            dsets = create_layout(f, snap, checksums)
            for entry, dset in zip(entries, dsets):
                try:
                    _check_fault(entry.path, 0)
                    dset[()] = entry.array
                except Exception as exc:
                    raise CheckpointError(f"writing {path} failed: /{entry.path}: {_describe(exc)}",
                                          hint=_hint([str(exc)])) from exc
            f.flush()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"writing {path} failed: {_describe(exc)}", hint=_hint([str(exc)])) from exc
    return checksums


def write_file(path, snap, comm, parallel, call_bytes=CALL_BYTES):
    """Write ``snap`` to ``path`` on every rank's behalf; the same outcome on all ranks."""
    if parallel:
        return write_parallel(path, snap, comm, call_bytes)
    return on_root(lambda: write_serial(path, snap), comm)
