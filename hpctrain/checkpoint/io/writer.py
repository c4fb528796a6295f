"""Writing a checkpoint file from a :class:`~.plan.WritePlan`: collectively through MPI-IO (every rank writes
its pieces), or by rank 0 alone where h5py has no MPI support.

Parallel HDF5 requires every rank to make the same metadata calls with the same arguments and to enter every
collective write. So a rank that fails keeps going through the remaining calls with an empty share, and the
ranks agree on the errors at fixed points (:mod:`.agreement`): one rank's failure becomes the same
:class:`CheckpointError` on all, never a hang. The HDF5 file itself (its creation, layout, seal and
close): :mod:`.h5file`."""
import math
import os
import threading

import numpy as np

from ...errors import CheckpointError
from ...runtime import fsutil
from ...runtime.coordination import any_rank, on_root
from ..content import format as fmt
from ..content.plan import mark_finite, piece_checksums, refuse_nonfinite
from . import h5file
from .agreement import agree, describe_error, hint_for
from .directio import open_direct
from .iosettings import IOSettings
from .mapped import open_mapped


def h5py_parallel():
    import h5py

    return bool(h5py.get_config().mpi)


# Bytes per write call. h5py holds the GIL for a whole call: a background save makes small calls so training
# runs between them, and independent ones (none waits for another rank's background thread, which training
# slows); a foreground save makes fewer, larger ones (each collective call waits for the slowest rank).
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


def region_to_write(d, rank):
    """The region of dataset ``d`` that this rank writes (None: nothing). The seam where the
    tests make one rank's write fail as a full disk would (tests/mpi/ckpt_scenarios.py): an
    OSError here still has the rank take part in every collective call, with an empty share."""
    return d.region_of(rank)


def _write_alone(dset, d, region, call_bytes, parts=None):
    """Independent writes of this rank's piece, ``call_bytes`` a call; a part of a split dataset straight to
    its place in the file through ``parts`` (a :class:`~.directio.DirectWriter` or
    :class:`~.mapped.MappedWriter`) where there is one."""
    offset = dset.id.get_offset() if parts is not None and len(d.pieces) > 1 else None
    if offset is None:  # HDF5 has not placed it (never so in a parallel file: it allocates at creation)
        for local, where in _chunks(d, region, call_bytes):
            dset[fmt.slices(where)] = d.mine[local]
        return
    flat, pos = np.ascontiguousarray(d.mine).reshape(-1).view(np.uint8), 0
    for start, nbytes in fmt.runs(d.shape, region, d.dtype.itemsize):
        parts.write(offset + start, flat[pos:pos + nbytes])
        pos += nbytes


def write_parallel(path, plan, comm, call_bytes=CALL_BYTES, collective=True, io=None):
    """All ranks write ``plan`` into a new file ``path`` (collective); returns the checksums.

    Datasets split among ranks are written in collective calls of up to ``call_bytes`` per rank where ``io``
    asks for them (:meth:`~.iosettings.IOSettings.collective_writes`); a dataset that one rank holds whole is
    written by that rank alone (independent I/O), so small tensors cost no collective call and no rank waits
    on another's small write. ``collective=False`` (a background save), or an aligned layout without
    collective buffering: every piece is written independently, and a rank's parts of split datasets go to the
    places HDF5 gave them past HDF5: through :mod:`.directio` where ``io`` asks for direct writes
    (:meth:`~.iosettings.IOSettings.direct_writes`), else through :mod:`.mapped` on a local file system
    (:meth:`~.iosettings.IOSettings.mapped_writes`). Each piece is checksummed (and checked for
    NaN) right before it is written, so the disk is busy from the first dataset on; the checksums, the same on
    every rank once gathered, are written into their attributes after the data (:func:`.h5file.seal`). A NaN found on
    any rank refuses the save on all, and the file is left for the caller to remove. ``io``: the layout and
    MPI-IO hints (:class:`~.iosettings.IOSettings`; None: HDF5's packing, no hints)."""
    import h5py

    rank = comm.Get_rank()
    io = io or IOSettings()
    collective = collective and io.collective_writes()
    mark_finite(plan)
    errors, f, failed, refusal, checksums = [], None, False, None, None
    try:
        f = h5file.create_parallel(path, comm, io)
    except Exception as exc:
        errors.append(f"creating the file: {describe_error(exc)}")
    agree(errors, comm, path, "creating")
    try:
        try:
            dsets = h5file.create_layout(f, plan)
        except Exception as exc:
            errors.append(f"creating datasets: {describe_error(exc)}")
        agree(errors, comm, path, "creating datasets in")
        parts = _parts_writer(path, io, call_bytes)
        try:
            sums, bad = _write_datasets(plan, dsets, rank, call_bytes, collective, errors, parts)
        finally:
            if parts is not None:
                parts.close()
        gathered = comm.allgather((errors, sums, bad))
        failed = any(e for e, _, _ in gathered)
        if not failed:
            try:
                refuse_nonfinite(plan.datasets, [b for _, _, b in gathered], path)
                checksums = fmt.combine_checksums([s for _, s, _ in gathered], len(plan.datasets))
                h5file.seal(f, plan, dsets, checksums)  # the same values on every rank
            except fmt.NonFiniteState as exc:
                refusal, failed = exc, True
            except Exception as exc:
                errors.append(f"writing the checksums: {describe_error(exc)}")
                failed = any_rank(True, comm)
            else:
                failed = any_rank(False, comm)
        if failed and rank == 0:
            # The file is garbage now. Truncating it gives back the space a full disk needs for the metadata
            # that closing writes; a close that fails leaves HDF5 in a state that crashes the process later.
            try:
                os.truncate(path, 0)
            except OSError:
                pass
        comm.Barrier()
        # No flush (MPI_File_sync) here: closing writes the metadata, and every rank then
        # fsyncs the file itself (:func:`sync_started`), while the verification re-reads it.
    finally:
        h5file.close_parallel(f, path, rank, errors, failed)
    if refusal is not None:
        raise refusal
    if errors:
        errors.append(_space_note(path, plan.nbytes))
    agree(errors, comm, path, "writing")
    return checksums


def _parts_writer(path, io, call_bytes):
    """This rank's writer of its parts of split datasets into ``path``: a :class:`~.directio.DirectWriter` where
    ``io`` asks for direct writes, a :class:`~.mapped.MappedWriter` where it maps them; None elsewhere, or where
    the file cannot be opened so (HDF5 then writes every byte, as without)."""
    try:
        if io.direct_writes():
            return open_direct(path, call_bytes)
        if io.mapped_writes():
            return open_mapped(path, call_bytes)
    except OSError:
        pass
    return None


def _write_datasets(plan, dsets, rank, call_bytes, collective, errors, parts=None):
    """This rank's share of every dataset, each piece checksummed right before it is written: ``(checksums,
    non-finite dataset indices)``. A failure goes into ``errors``; the rank still enters every collective."""
    sums, bad = [], []
    finite = not plan.finite_checked

    def checked(i, d):
        runs, ok = piece_checksums(i, d, rank, finite=finite)
        sums.extend(runs)
        if not ok:
            bad.append(i)

    alone = []
    for i, (d, dset) in enumerate(zip(plan.datasets, dsets)):
        try:
            region = region_to_write(d, rank)
        except OSError as exc:
            errors.append(f"writing /{d.path}: {describe_error(exc)}")
            region = None  # still enter the collectives, with nothing
        if len(d.pieces) == 1 or not collective:
            if region is not None:
                alone.append((i, d, dset, region))
            continue
        if region is not None:
            try:
                checked(i, d)
            except Exception as exc:  # this rank still enters the collectives, with nothing
                errors.append(f"checksumming /{d.path}: {describe_error(exc)}")
                region = None
        chunks = _chunks(d, region, call_bytes) if region is not None else []
        for call in range(_calls(d, call_bytes)):
            try:
                with dset.collective:
                    if call < len(chunks):
                        local, where = chunks[call]
                        dset[fmt.slices(where)] = d.mine[local]
                    else:
                        h5file.write_empty(dset)
            except Exception as exc:  # from HDF5 itself, e.g. the disk filled up
                errors.append(f"writing /{d.path}: {describe_error(exc)}")
    for i, d, dset, region in alone:
        try:
            checked(i, d)
            _write_alone(dset, d, region, call_bytes, parts)
        except Exception as exc:
            errors.append(f"writing /{d.path}: {describe_error(exc)}")
    return sums, bad


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


def write_serial(path, plan, call_bytes=FOREGROUND_CALL_BYTES, io=None):
    """This process alone writes ``plan`` (made for one writer, rank 0) with the default (POSIX) driver;
    returns the checksums, taken as in :func:`write_parallel`. On any error the caller removes the file."""
    import h5py

    mark_finite(plan)
    sums, bad = [], []
    try:
        with h5file.create_serial(path, io) as f:
            dsets = h5file.create_layout(f, plan)
            for i, (d, dset) in enumerate(zip(plan.datasets, dsets)):
                runs, ok = piece_checksums(i, d, 0, finite=not plan.finite_checked)
                sums.extend(runs)
                if not ok:
                    bad.append(i)
                    continue  # refused below: no need to write it
                try:
                    _write_alone(dset, d, region_to_write(d, 0), call_bytes)
                except Exception as exc:
                    raise CheckpointError(f"writing {path} failed: /{d.path}: {describe_error(exc)}",
                                          hint=hint_for([str(exc)])) from exc
            refuse_nonfinite(plan.datasets, [bad], path)
            checksums = fmt.combine_checksums([sums], len(plan.datasets))
            h5file.seal(f, plan, dsets, checksums)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"writing {path} failed: {describe_error(exc)}", hint=hint_for([str(exc)])) from exc
    return checksums


def sync_started(path, parallel, rank):
    """Start fsyncing ``path`` in a thread on this rank (every rank when ``parallel``, so each node's writes
    reach the file system as ``MPI_File_sync`` would have; else rank 0 alone): the disk writes back while the
    caller re-reads and checksums from memory. Returns ``finish()``, which waits for it and returns its error
    messages (``[]``: durable)."""
    if not parallel and rank != 0:
        return lambda: []
    errors = []

    def run():
        try:
            fsutil.fsync_path(path)
        except Exception as exc:
            errors.append(f"fsync: {describe_error(exc)}")

    thread = threading.Thread(target=run, name="hpctrain-checkpoint-fsync", daemon=True)
    thread.start()

    def finish():
        thread.join()
        return errors

    return finish


def write_file(path, plan, comm, parallel, call_bytes=CALL_BYTES, collective=True, io=None):
    """Write ``plan`` to ``path`` on every rank's behalf; the same outcome on all ranks. Without ``parallel``
    the plan must give everything to rank 0. ``collective``, ``io``: see :func:`write_parallel`."""
    if parallel:
        return write_parallel(path, plan, comm, call_bytes, collective, io)
    return on_root(lambda: write_serial(path, plan, call_bytes, io), comm)
