"""The node-local level's messages: a part to its partner on the next node after each snapshot
(:func:`copy_to_partner`), and the parts of a snapshot to rank 0 at recovery (:func:`gather_parts`). Both run
on the level's own communicator; every message posted is received, even after an error, so that no rank is
left waiting in a send."""
import os

import numpy as np

from ...runtime import fsutil
from ..content import format as fmt
from . import files

CHUNK_BYTES = 1 << 26  # per MPI message: well under the 2 GiB a count of bytes can say
_SIZE, _DATA, _META = 7101, 7102, 7103  # message tags


def copy_to_partner(comm, own, nbytes, dest, sources, path_of, where):
    """Send the part file ``own`` (``nbytes``; None: this rank has none this time, and says so) to rank
    ``dest`` (None: no partner), and store the parts that ``sources`` send here at ``path_of(source)``.
    Returns ``(bytes stored, error or None)``; ``where``: this rank, as messages name it."""
    from mpi4py import MPI

    size = nbytes if own is not None else -1
    requests = [comm.isend(size, dest=dest, tag=_SIZE)] if dest is not None else []
    sizes = [(q, comm.recv(source=q, tag=_SIZE)) for q in sources]
    MPI.Request.Waitall(requests)
    sends = []
    if dest is not None and size > 0:
        data = np.memmap(own, dtype=np.uint8, mode="r")  # tmpfs pages sent as they are, not copied first
        sends = [comm.Isend(data[a:a + CHUNK_BYTES], dest=dest, tag=_DATA) for a in range(0, size, CHUNK_BYTES)]
    stored, error = 0, None
    for q, n in sizes:
        if n > 0:
            problem = _store(comm, q, n, path_of(q))
            error = error or (problem and f"{where}: storing rank {q}'s copy: {problem}")
            stored += 0 if problem else n
    MPI.Request.Waitall(sends)
    return stored, error


def _store(comm, source, nbytes, path):
    """Receive ``nbytes`` from ``source`` into the file ``path`` (atomically); the error, or None."""
    tmp, f, error = f"{path}.tmp-{os.getpid()}", None, None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(tmp, "wb")
    except OSError as exc:
        error = exc
    buf = np.empty(min(nbytes, CHUNK_BYTES), dtype=np.uint8)
    for a in range(0, nbytes, CHUNK_BYTES):
        part = buf[:min(CHUNK_BYTES, nbytes - a)]
        comm.Recv(part, source=source, tag=_DATA)
        if f is not None and error is None:
            try:
                f.write(memoryview(part))
            except OSError as exc:  # no space: the rest is received all the same
                error = exc
    if f is not None:
        f.close()
        if error is None:
            os.replace(tmp, path)
        else:
            fsutil.remove_quietly(tmp)
    return error


def gather_parts(comm, chosen):
    """Collective: the parts ``chosen`` names (``{owner: (holder rank, path, copy)}``) assembled on rank 0.
    Each holder reads its parts and checks their checksums; rank 0 receives them in owner order. Returns, on
    rank 0, ``(whole arrays by dataset index, description, problem)`` (``problem``: the first damaged part's
    ``(path, what is wrong)``, then the arrays are None); elsewhere ``(None, None, None)``."""
    rank = comm.Get_rank()
    for owner in sorted(chosen):
        holder, path, _ = chosen[owner]
        if rank == holder != 0:
            meta, data = _read(path)
            comm.send(meta, dest=0, tag=_META)
            for a in range(0, 0 if data is None else data.size, CHUNK_BYTES):
                comm.Send(data[a:a + CHUNK_BYTES], dest=0, tag=_DATA)
    if rank != 0:
        return None, None, None
    full, specs, problem = None, None, None
    for owner in sorted(chosen):
        holder, path, _ = chosen[owner]
        meta, data = _read(path) if holder == 0 else _receive(comm, holder)
        if problem is not None or data is None:
            problem = problem or (path, meta)
            continue
        if full is None:
            specs = {k: meta[k] for k in ("datasets", "root_attrs", "group_attrs")}
            full = [np.empty(tuple(d["shape"]), dtype=np.dtype(d["dtype"])) for d in meta["datasets"]]
        for i, region, raw in files.pieces(meta, data):
            full[i][fmt.slices(region)] = raw.view(full[i].dtype).reshape(tuple(b - a for a, b in region))
    return (None if problem else full), specs, problem


def _read(path):
    """``(description, bytes)`` of a part whose checksums hold, or ``(what is wrong, None)``."""
    try:
        meta = files.read_trailer(path)
        return meta, files.read_data(path, meta)
    except files.PartDamaged as exc:
        return str(exc), None


def _receive(comm, holder):
    meta = comm.recv(source=holder, tag=_META)
    if isinstance(meta, str):
        return meta, None
    data = np.empty(meta["size"], dtype=np.uint8)
    for a in range(0, data.size, CHUNK_BYTES):
        comm.Recv(data[a:a + CHUNK_BYTES], source=holder, tag=_DATA)
    return meta, data
