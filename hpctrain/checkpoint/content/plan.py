"""What one checkpoint file holds and who writes which part of it: a :class:`WritePlan` of
:class:`DatasetPlan`. Data-parallel, sharded and split models differ only in the plan: :func:`plan_snapshot`
makes it for data-parallel replicas, :mod:`.sharded` for sharded optimizers, ``hpctrain.parallel.checkpoint``
for split models. Here too: the checksums and NaN checks of this rank's pieces (:func:`own_checksums`), and a
background save's private copy (:func:`copy_own_pieces`)."""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...runtime.coordination import everywhere
from ...runtime.fsutil import TMP_MARK
from . import format as fmt


@dataclass
class DatasetPlan:
    """One dataset of the file: ``pieces``, every rank's ``(rank, region)`` (:mod:`format` regions, at most
    one per rank, together the whole dataset); ``mine``, this rank's piece shaped like its region, or None."""

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
class WritePlan:
    """Everything one file holds, and who writes which part of it."""

    datasets: List[DatasetPlan]
    root_attrs: Dict[str, Any]
    group_attrs: Dict[str, Dict[str, Any]]  # group path -> attributes
    finite_checked: bool = False  # check_finite already ran (a background save checks first)
    own_nonfinite: Optional[List[int]] = None  # this rank's non-finite datasets, where already known

    @property
    def nbytes(self):
        return sum(d.nbytes for d in self.datasets)


def plan_snapshot(snap, nwriters, rank, alignment=1):
    """The plan for a data-parallel :class:`~.snapshot.Snapshot`, of which every rank holds
    every array: ``nwriters`` ranks share the rows as :func:`format.plan_pieces` says, each
    rank's part of a large tensor starting on a multiple of ``alignment`` bytes."""
    arrays = [e.array for e in snap.entries]
    rows = fmt.plan_pieces([(a.shape, a.dtype.itemsize) for a in arrays], nwriters, alignment=alignment)
    datasets = []
    for entry, array, pieces in zip(snap.entries, arrays, rows):
        mine = next((array[a:b] if array.ndim else array for r, a, b in pieces if r == rank), None)
        datasets.append(DatasetPlan(entry.path, array.shape, array.dtype, entry.attrs,
                                    [(r, fmt.rows(array.shape, a, b)) for r, a, b in pieces], mine,
                                    finite=entry.finite, private=entry.private))
    return WritePlan(datasets, snap.root_attrs, snap.group_attrs)


# Bytes checksummed and NaN-checked at a time (stays in cache between the two); a multiple of every itemsize.
SCAN_BYTES = 1 << 20


def own_checksums(datasets, rank, crc=True, finite=True):
    """``([(dataset index, byte offset, nbytes, crc)], [indices of non-finite datasets])`` of this rank's
    pieces: a checksum per contiguous run of bytes its region covers and, for datasets marked ``finite``,
    whether it holds NaN or infinity, both in one pass over the bytes (``crc``/``finite`` False: skip it)."""
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
        f"refusing to write {os.path.basename(path.split(TMP_MARK)[0])}: NaN or infinite values in {len(bad)} "
        f"tensor(s) that must be finite: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}; "
        f"the checkpoint was not written, the previous checkpoints and `latest` are untouched",
        hint="the run has diverged: roll back to the last good checkpoint (CheckpointManager.load_latest, "
             "or restart with checkpoint.resume=auto) and lower the learning rate or clip gradients"))


def mark_finite(plan):
    """Mark ``finite`` what a reader checks too (:func:`format.finite_paths`: the parameters the optimizer's
    ``param_groups`` name, and optimizer state), so plans made elsewhere (split models) are checked alike."""
    must = fmt.finite_paths(plan.group_attrs, [d.path for d in plan.datasets])
    for d in plan.datasets:
        d.finite = d.finite or d.path in must


def check_finite(plan, comm, path):
    """Collective: refuse (the same error on every rank) if a dataset marked ``finite`` holds NaN or infinity;
    each rank checks only the rows it writes (unless :func:`copy_own_pieces` did already)."""
    mark_finite(plan)
    bad = plan.own_nonfinite
    if bad is None:
        _, bad = own_checksums(plan.datasets, comm.Get_rank(), crc=False)
    refuse_nonfinite(plan.datasets, comm.allgather(bad), path)
    plan.finite_checked = True


# Elements a copy worker takes at a time (of SCAN_BYTES each): the unit the threads share.
COPY_TASK_SCANS = 16


def copy_own_pieces(plan, buffers, workers=1):
    """A background save's pieces in memory that training does not touch: each piece this rank writes
    (``mine``, a view of training's tensor) is copied into the host buffer ``buffers`` kept for its path from
    the previous save, where it still fits (fresh memory costs a page fault per page on top of the copy), and
    checked for NaN in the same pass, while it is in cache. Only this rank's rows are copied: on n ranks, 1/n
    of the state. ``workers`` threads share the bytes (numpy copies and checks without the GIL): cores that
    the rank may use and training, waiting for this, does not. ``buffers`` then holds just this save's
    buffers; reuse them only once it is written. Sets ``plan.own_nonfinite`` for :func:`check_finite`."""
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

