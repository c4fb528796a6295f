"""Reading and verifying checkpoints: the header without the data (:func:`read_header`), any
:class:`~.readplan.ReadPlan` (:func:`read`, the one read path of every load), every array on every rank
(:func:`read_arrays`), and, for ``hpctrain ckpt verify``, every checksum in one process
(:func:`verify_file`)."""
import logging

import numpy as np

from ...runtime.coordination import everywhere
from ...runtime.flat import bcast_bytes
from ...errors import CheckpointError
from ..content import format as fmt
from .agreement import agree
from .directio import open_direct_reader
from ..content.readplan import ReadPlan, plan_shared

log = logging.getLogger("hpctrain.checkpoint")

# Bytes read at a time when only checksumming (one reused buffer): small enough that the checksum finds the
# block still in cache, and that h5py (which holds the GIL for a whole read) lets training run between reads
# when a background save verifies.
VERIFY_BYTES = 4 << 20


def _attr(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


class Header:
    """What a checkpoint holds, read without its data."""

    def __init__(self, path, root_attrs, group_attrs, datasets):
        # group_attrs: group path -> dict; datasets: path -> (shape, numpy dtype str, attrs)
        self.path, self.root_attrs, self.group_attrs, self.datasets = path, root_attrs, group_attrs, datasets

    @property
    def metrics(self):
        return fmt.from_json(self.root_attrs.get("metrics", "{}"), "/ metrics")


def read_header(path):
    """Open ``path`` serially (h5py) and check that it is a checkpoint this code can read: format, version,
    the datasets with shapes, dtypes and checksums, every group's attributes. Raises
    :class:`CheckpointCorrupt` naming the file and what is wrong."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} does not exist",
                              hint="check the path, or use checkpoint.resume=auto") from exc
    except Exception as exc:  # truncated or not HDF5 at all
        raise fmt.CheckpointCorrupt(f"{path} is not a readable HDF5 file ({type(exc).__name__}: {exc})",
                                    hint="the file is damaged (a truncated or interrupted copy?); "
                                         "use an earlier checkpoint") from exc
    with f:
        try:
            root = {k: _attr(v) for k, v in f.attrs.items()}
            if root.get("format") != fmt.FORMAT_NAME:
                raise fmt.CheckpointCorrupt(
                    f"{path} is not an hpctrain checkpoint (attribute format={root.get('format')!r}, "
                    f"expected {fmt.FORMAT_NAME!r})")
            version = root.get("format_version")
            if version not in fmt.READABLE_VERSIONS:
                raise fmt.CheckpointCorrupt(
                    f"{path} has checkpoint format version {version}; this hpctrain reads "
                    f"version(s) {', '.join(map(str, fmt.READABLE_VERSIONS))}",
                    hint="read it with the hpctrain version that wrote it "
                         f"(hpctrain {root.get('hpctrain_version', '?')})")
            groups, datasets = {}, {}

            def visit(name, obj):
                attrs = {k: _attr(v) for k, v in obj.attrs.items()}
                if isinstance(obj, h5py.Dataset):
                    datasets[name] = (tuple(obj.shape), obj.dtype.str, attrs)
                else:
                    groups[name] = attrs

            f.visititems(visit)
        except fmt.CheckpointCorrupt:
            raise
        except Exception as exc:
            raise fmt.CheckpointCorrupt(f"{path}: cannot read its structure ({type(exc).__name__}: {exc})",
                                        hint="the file is damaged; use an earlier checkpoint") from exc
    for required in (fmt.MODEL, fmt.OPTIMIZER, fmt.TRAINER):
        if required not in groups:
            raise fmt.CheckpointCorrupt(f"{path}: group /{required} is missing")
    for name, (_, _, attrs) in datasets.items():
        if fmt.CRC_ATTR not in attrs or fmt.DTYPE_ATTR not in attrs:
            raise fmt.CheckpointCorrupt(f"{path}: dataset /{name} has no {fmt.CRC_ATTR} or {fmt.DTYPE_ATTR} attribute")
    listed = fmt.from_json(root.get("datasets", "[]"), "/ datasets")
    missing = [p for p in listed if p not in datasets]
    if missing:
        raise fmt.CheckpointCorrupt(f"{path}: dataset(s) missing: " + ", ".join("/" + p for p in missing[:20]),
                                    hint="the file is damaged or was edited; use an earlier checkpoint")
    if root.get("ndatasets") != len(datasets):
        extra = sorted(set(datasets) - set(listed))
        raise fmt.CheckpointCorrupt(
            f"{path}: holds {len(datasets)} datasets but was written with {root.get('ndatasets')}"
            + (f" (not written by hpctrain: {', '.join('/' + p for p in extra[:20])})" if extra else ""))
    _check_metadata(path, root, groups, datasets)  # after the checks above, which say more precisely what is wrong
    return Header(path, root, groups, datasets)


_WARNED_V1 = set()


def _check_metadata(path, root, groups, datasets):
    """Version 2: the metadata checksum must be there and match. Version 1 had none: warn once."""
    if root.get("format_version") == 1:
        if path not in _WARNED_V1:
            _WARNED_V1.add(path)
            log.warning("%s is a version-1 checkpoint: its data is checksummed, but its attributes (step, "
                        "learning rates, optimizer settings) are not; a save with this hpctrain adds that", path)
        return
    stored = root.get(fmt.METADATA_CRC_ATTR)
    if not isinstance(stored, int):
        raise fmt.CheckpointCorrupt(f"{path}: the metadata checksum (attribute {fmt.METADATA_CRC_ATTR} of /) is "
                                    f"missing", hint="the file is damaged or was edited; use an earlier checkpoint")
    found = fmt.metadata_crc(root, groups, datasets)
    if found != stored:
        raise fmt.CheckpointCorrupt(
            f"{path}: metadata checksum mismatch (stored {fmt.METADATA_CRC_ATTR} {stored:08x}, attributes and "
            f"dataset shapes give {found:08x}): an attribute, a dataset's shape or type was changed",
            hint="the file was damaged after it was written; use an earlier checkpoint")


def _flat(array):
    return array.reshape(-1).view(np.uint8)


# MPI counts and displacements are C ints: datasets larger than this travel in pieces.
MPI_MAX_BYTES = (1 << 31) - 1


def exchange(arrays, plan, comm):
    """Every rank holds the pieces ``plan`` gives it; afterwards every rank holds all. The bytes move in
    place, straight into ``arrays``: one ``Allgatherv`` (``MPI_IN_PLACE``) per split dataset, one ``Bcast``
    from its owner per whole one. No staging buffers."""
    from mpi4py import MPI

    size = comm.Get_size()
    if size == 1:
        return
    for array, pieces in zip(arrays, plan):
        flat = _flat(array)
        if len(pieces) == 1:
            bcast_bytes(flat, pieces[0][0], comm)
            continue
        rb = fmt.row_bytes(array.shape, array.dtype.itemsize)
        if flat.nbytes <= MPI_MAX_BYTES:
            counts, displs = [0] * size, [0] * size
            for r, start, stop in pieces:
                counts[r], displs[r] = (stop - start) * rb, start * rb
            comm.Allgatherv(MPI.IN_PLACE, [flat, counts, displs, MPI.BYTE])
        else:
            for r, start, stop in pieces:
                bcast_bytes(flat[start * rb:stop * rb], r, comm)


def _read_region(f, i, d, region, scratch, errors):
    """Read one region of dataset ``d`` (index ``i``); return its checksums as :func:`.plan.own_checksums`
    gives them, where it is ``checked``."""
    dset = f[d.path]
    if region.into is None:  # for the checksum alone, a block at a time
        a, b = region.region[0] if region.region else (0, 1)
        crc, nbytes, _ = _crc_rows(dset, a, b, d.shape, d.dtype, scratch)
        return [(i, a * fmt.row_bytes(d.shape, d.dtype.itemsize), nbytes, crc)]
    part = region.into
    if part.size:
        dset.read_direct(part, fmt.slices(region.region) if region.region else None)
    if d.finite and not fmt.all_finite(part, d.dtype_name):
        errors.append(f"/{d.path} holds NaN or infinite values ({d.finite} of a run that had diverged)")
    if not region.checked:
        return []
    flat, out, pos = _flat(np.ascontiguousarray(part)), [], 0
    for offset, nbytes in fmt.runs(d.shape, region.region, d.dtype.itemsize):
        out.append((i, offset, nbytes, fmt.crc32(flat[pos:pos + nbytes]) if nbytes else 0))
        pos += nbytes
    return out


def _read_all(f, plan, rank_datasets, errors):
    """Read this rank's regions of ``plan``: their checksums; a failure is one more entry of ``errors``."""
    unread = [(d.shape, d.dtype) for d in rank_datasets if any(r.into is None for r in d.regions)]
    scratch = _scratch(unread) if unread else None
    sums = []
    for i, d in enumerate(plan.datasets):
        for region in d.regions:
            try:
                sums += _read_region(f, i, d, region, scratch, errors)
            except Exception as exc:
                errors.append(f"{d.failure or 'reading /' + d.path}: {type(exc).__name__}: {exc}")
    return sums


def read(plan, comm):
    """Collective: carry out the :class:`~.readplan.ReadPlan` ``plan``: open the file (collectively when
    ``plan.parallel``), read every region into its array, check for NaN and infinity, agree across ranks
    (every rank raises the same ``plan.error`` naming every rank's problems, or none does), verify the checksums
    (the same :class:`CheckpointCorrupt` everywhere on a mismatch), then exchange the shared arrays' rows.
    The arrays are written before the checksums are compared: on an error they hold part of the file."""
    rank_datasets = [d for d in plan.datasets if d.regions]
    sums, errors, f = [], list(plan.problems), None
    if plan.parallel or rank_datasets:
        try:
            f = open_for_read(plan.path, comm, plan.parallel)
        except Exception as exc:
            errors.append(f"{plan.opening}: {type(exc).__name__}: {exc}")
        else:
            sums = _read_all(f, plan, rank_datasets, errors)
        finally:
            close_recording(f, errors)
    try:
        agree(errors, comm, plan.path, "reading")
    except CheckpointError as exc:
        if type(exc) is plan.error:
            raise
        raise everywhere(plan.error(str(exc))) from exc
    if plan.verify:
        found = fmt.combine_checksums(comm.allgather(sums), len(plan.datasets))
        check_checksums(plan.path, [d.path for d in plan.datasets], [d.crc for d in plan.datasets], found)
    shared = [(d.whole, d.shared) for d in plan.datasets if d.shared is not None]
    exchange([a for a, _ in shared], [p for _, p in shared], comm)


def check_checksums(path, paths, expected, found):
    bad = [f"/{p}: stored crc32 {e:08x}, data has {c:08x}"
           for p, e, c in zip(paths, expected, found) if e != c]
    if bad:
        raise everywhere(fmt.CheckpointCorrupt(
            f"{path}: checksum mismatch in {len(bad)} dataset(s):\n  " + "\n  ".join(bad[:20]),
            hint="the file was damaged after it was written; use an earlier checkpoint"))


def open_for_read(path, comm, parallel):
    import h5py

    return h5py.File(path, "r", driver="mpio", comm=comm) if parallel else h5py.File(path, "r")


def read_arrays(header, comm, parallel, keep=None, verify=True, into=None):
    """Collective: every rank returns ``{path: array}`` of every dataset (or those ``keep`` accepts): each
    rank reads a share, the checksums are verified across ranks, then the shares are exchanged; any number of
    ranks reads a file, whatever number wrote it. ``into``: ``{path: array}`` of the stored shape and dtype,
    C-contiguous, to read those datasets straight into instead of new arrays (the same paths on every rank).
    They are written before the checksums are compared: on an error they hold part of the file."""
    paths = sorted(p for p in header.datasets if keep is None or keep(p))
    finite = fmt.finite_paths(header.group_attrs, paths) if verify else set()
    datasets = plan_shared(header, paths, comm.Get_rank(), comm.Get_size() if parallel else 1, finite, into)
    read(ReadPlan(header.path, datasets, parallel, verify=verify), comm)
    return {d.path: d.whole for d in datasets}


def _scratch(shapes):
    """One buffer for every block read while checksumming: fresh memory costs page faults
    on every touch, a reused buffer only once."""
    return np.empty(max([VERIFY_BYTES] + [fmt.row_bytes(shape, dtype.itemsize) for shape, dtype in shapes]),
                    dtype=np.uint8)


def _raw_offset(dset):
    """Where ``dset``'s bytes start in the file, if they lie there as they are checksummed (contiguous, placed,
    little-endian); else None."""
    return dset.id.get_offset() if dset.dtype.byteorder != ">" else None


def close_recording(f, errors):
    """Close ``f`` if open; a failure becomes one more entry of ``errors``."""
    if f is not None:
        try:
            f.close()
        except Exception as exc:
            errors.append(f"closing: {type(exc).__name__}: {exc}")


def _crc_rows(dset, start, stop, shape, dtype, scratch, finite=None):
    """``(crc, nbytes, all finite)`` of rows [start, stop) of ``dset``, read a block at a time into
    ``scratch``; ``finite``: torch dtype to check for NaN and infinity (None: no check, reported finite)."""
    if len(shape) == 0:
        value = np.asarray(dset[()])
        return fmt.crc32_bytes(value), dtype.itemsize, finite is None or fmt.all_finite(value, finite)
    rb = fmt.row_bytes(shape, dtype.itemsize)
    block = max(1, scratch.nbytes // max(1, rb))
    crc, total, ok = 0, 0, True
    for a in range(start, stop, block):
        b = min(stop, a + block)
        n = (b - a) * rb
        if n == 0:
            continue
        part = scratch[:n].view(dtype).reshape((b - a,) + tuple(shape[1:]))
        dset.read_direct(part, np.s_[a:b])
        crc = fmt.crc32_combine(crc, fmt.crc32_bytes(part), n)
        if finite is not None and ok:
            ok = fmt.all_finite(part, finite)
        total += n
    return crc, total, ok


def verify_written(path, expected, comm, parallel, direct=False):
    """Collective: re-read ``path`` (each rank its share) and compare with ``expected``
    (``{dataset path: crc}``). The same CheckpointError on every rank on a mismatch. ``direct``: the parts
    of split datasets were written with ``O_DIRECT`` (:mod:`.directio`) and are read back so."""
    rank, size = comm.Get_rank(), comm.Get_size()
    paths = sorted(expected)
    nreaders = size if parallel else 1
    sums, errors, f, raw = [], [], None, None
    if parallel or rank == 0:
        try:
            f = open_for_read(path, comm, parallel)
            raw = open_direct_reader(path, VERIFY_BYTES) if direct and parallel else None
            shapes = [(f[p].shape, f[p].dtype) for p in paths]
            plan = fmt.plan_pieces([(s, d.itemsize) for s, d in shapes], nreaders)
            scratch = _scratch([sd for sd, pieces in zip(shapes, plan) if any(r == rank for r, _, _ in pieces)])
            for i, (p, (shape, dtype), pieces) in enumerate(zip(paths, shapes, plan)):
                rb = fmt.row_bytes(shape, dtype.itemsize)
                offset = _raw_offset(f[p]) if raw is not None and len(pieces) > 1 else None
                for start, stop in [(a, b) for r, a, b in pieces if r == rank]:
                    nbytes = (stop - start) * rb
                    crc = (raw.crc(offset + start * rb, nbytes, fmt.crc32) if offset is not None
                           else _crc_rows(f[p], start, stop, shape, dtype, scratch)[0])
                    sums.append((i, start * rb, nbytes, crc))
        except Exception as exc:
            errors.append(f"re-reading for verification: {type(exc).__name__}: {exc}")
        finally:
            if raw is not None:
                raw.close()
            close_recording(f, errors)
    agree(errors, comm, path, "verifying")
    found = fmt.combine_checksums(comm.allgather(sums), len(paths))
    check_checksums(path, paths, [expected[p] for p in paths], found)


def verify_file(path):
    """Check one file serially; returns a list of problems (empty: valid)."""
    import h5py

    try:
        header = read_header(path)
    except CheckpointError as exc:
        return [str(exc).split("\nHINT:")[0]]
    problems = []
    try:
        scratch = _scratch([(shape, np.dtype(dtype)) for shape, dtype, _ in header.datasets.values()])
        finite = fmt.finite_paths(header.group_attrs, header.datasets)
        with h5py.File(path, "r") as f:
            for name, (shape, dtype, attrs) in sorted(header.datasets.items()):
                check = attrs[fmt.DTYPE_ATTR] if name in finite else None
                try:
                    dset = f[name]
                    crc, _, ok = _crc_rows(dset, 0, shape[0] if shape else 1, shape, np.dtype(dtype), scratch,
                                           check)
                except Exception as exc:
                    problems.append(f"/{name}: cannot be read ({type(exc).__name__}: {exc})")
                    continue
                if crc != int(attrs[fmt.CRC_ATTR]):
                    problems.append(f"/{name}: checksum mismatch (stored crc32 {int(attrs[fmt.CRC_ATTR]):08x}, "
                                    f"data has {crc:08x})")
                elif not ok:
                    problems.append(f"/{name}: non-finite values (NaN or Inf) in a parameter or optimizer state")
    except Exception as exc:
        problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return problems
