"""The HDF5 file a checkpoint is written into: created over MPI-IO with the file system's hints and layout
(:mod:`.iosettings`) and its metadata written collectively (:func:`create_parallel`), or by one process
(:func:`create_serial`); every group, dataset and attribute of a plan laid out before the data
(:func:`create_layout`) and the checksums sealed in place after it (:func:`seal`); a collective write with
nothing to write (:func:`write_empty`); and the collective close, which aborts the job rather than leave
ranks waiting for ever inside HDF5 (:func:`close_parallel`, :func:`or_abort`). What each rank writes, and
when: :mod:`.writer`."""
import contextlib
import functools
import os
import threading

import numpy as np

from ...runtime.coordination import abort_job
from ...runtime.world import node_name
from ..content import format as fmt
from .agreement import describe_error
from .iosettings import IOSettings

# Lowest HDF5 file format allowing attributes over 64 KiB (large param_groups JSON); any HDF5 >= 1.8 reads it.
LIBVER = ("v108", "v108")


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
    """Write every dataset's CRC-32 and, last, the metadata checksum over every attribute
    (:func:`format.metadata_crc`, from the values written) in place; the same values on every rank."""
    described = {}
    for d, dset, crc in zip(plan.datasets, dsets, checksums):
        dset.attrs.modify(fmt.CRC_ATTR, np.uint32(crc))
        described[d.path] = (d.shape, np.dtype(d.dtype).str, _dataset_attrs(d, crc))
    groups = {gpath: dict(attrs) for gpath, attrs in plan.group_attrs.items()}
    f.attrs.modify(fmt.METADATA_CRC_ATTR, np.uint32(fmt.metadata_crc(_root_attrs(plan), groups, described)))


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


# Seconds HDF5's collective metadata write (flush, close) may take before the job is aborted: when one rank's
# write fails inside it (a file-size limit, a full disk, an I/O error on one node), the other ranks wait in
# MPI for ever and no exception reaches them; an abort naming the file is the only way out that does not hang.
COLLECTIVE_TIMEOUT = 600.0
# The same once a write failed on some rank: the file was truncated, so closing has only metadata to write.
FAILED_CLOSE_TIMEOUT = 60.0


@contextlib.contextmanager
def or_abort(what, path, rank, errors=(), seconds=None):
    """Abort the job if the block has not finished in ``seconds`` (``COLLECTIVE_TIMEOUT``);
    ``errors``: what already failed on this rank, said first."""
    seconds = COLLECTIVE_TIMEOUT if seconds is None else seconds

    def fire():
        from mpi4py import MPI

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


def create_parallel(path, comm, io):
    """Collective: a new HDF5 file over MPI-IO with ``io``'s hints and layout (:mod:`.iosettings`), and its
    metadata written collectively: at close the ranks write every object header and attribute in a few
    large vectored writes, not each in its own small write (measured by tests/test_io_pattern.py)."""
    import h5py
    from h5py import h5f, h5p
    from mpi4py import MPI

    fapl = h5p.create(h5p.FILE_ACCESS)
    info = io.mpi_info()
    try:
        fapl.set_fapl_mpio(comm, MPI.INFO_NULL if info is None else info)
    finally:
        if info is not None:
            info.Free()  # HDF5 keeps its own copy
    fapl.set_libver_bounds(h5f.LIBVER_V18, h5f.LIBVER_V18)  # LIBVER
    layout = io.h5py_kwargs()
    if layout:
        fapl.set_alignment(layout["alignment_threshold"], layout["alignment_interval"])
        fapl.set_meta_block_size(layout["meta_block_size"])
    collective_metadata_writes(fapl)
    return h5py.File(h5f.create(os.fsencode(path), h5f.ACC_TRUNC, fapl=fapl))


def collective_metadata_writes(fapl):
    """``H5Pset_coll_metadata_write(fapl, true)`` (HDF5 >= 1.10), which h5py does not offer: called in the
    libhdf5 this process has loaded whose version is h5py's. True if set; False where no such library is
    found (the file is then written as before, its metadata in many small writes)."""
    function = _find_hdf5_function("H5Pset_coll_metadata_write")
    return function is not None and function(fapl.id, True) >= 0


@functools.lru_cache(maxsize=None)  # looked up once per process
def _find_hdf5_function(name):
    import ctypes

    import h5py

    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "libhdf5" in line})
    except OSError:
        return None
    for lib in libs:
        base = os.path.basename(lib)
        if not base.startswith("libhdf5") or "_hl" in base or "_cpp" in base or "fortran" in base:
            continue
        try:
            dll = ctypes.CDLL(lib)
            version = [ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()]
            if dll.H5get_libversion(*[ctypes.byref(v) for v in version]) < 0:
                continue
            function = getattr(dll, name, None)
        except (OSError, AttributeError):
            continue
        if function is not None and tuple(v.value for v in version) == h5py.version.hdf5_version_tuple[:3]:
            function.argtypes, function.restype = [ctypes.c_int64, ctypes.c_bool], ctypes.c_int
            return function
    return None


def create_serial(path, io=None):
    """A new HDF5 file for this process alone (the default POSIX driver), with ``io``'s layout
    (:class:`~.iosettings.IOSettings`; None: HDF5's packing)."""
    import h5py

    return h5py.File(path, "w", libver=LIBVER, **(io or IOSettings()).h5py_kwargs())


# Files whose collective close failed. HDF5 left in that state crashes the process when it frees the file
# later, so they stay referenced until the process ends.
_UNCLOSABLE = []


def close_parallel(f, path, rank, errors, failed):
    """Close the parallel file, aborting the job if HDF5's collective close never returns."""
    if f is None:
        return
    try:
        with or_abort("closing", path, rank, list(errors),
                      min(COLLECTIVE_TIMEOUT, FAILED_CLOSE_TIMEOUT) if failed else None):
            f.close()
    except Exception as exc:
        errors.append(f"closing: {describe_error(exc)}")
        _UNCLOSABLE.append(f)  # never let HDF5 free it again
