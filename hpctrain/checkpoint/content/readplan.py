"""What a load reads, the mirror of :mod:`.plan`'s :class:`~.plan.WritePlan`: a :class:`ReadPlan` of
:class:`DatasetRead`, each naming the regions of one dataset this rank reads, where their values go, the
checksum they are verified against and whether they must be finite. Data-parallel, sharded and split models
differ only in the plan (:func:`plan_shared` for arrays every rank ends up holding, :mod:`.sharded` for
optimizer slices, ``hpctrain.parallel.checkpoint`` for split models); :func:`.reader.read` carries out any."""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from . import format as fmt


@dataclass
class RegionRead:
    """One region of a dataset (a :mod:`format` region: ``(start, stop)`` per dimension, ``()`` for a scalar)
    and the array its values go to, shaped like it; ``into`` None: read for its checksum alone."""

    region: tuple
    into: Optional[np.ndarray]
    checked: bool = True  # counts towards the checksum: the checked regions of all ranks tile the dataset


@dataclass
class DatasetRead:
    """One dataset of the file and this rank's ``regions`` of it."""

    path: str
    shape: Tuple[int, ...]
    dtype: np.dtype  # as stored
    crc: int  # the stored checksum of the whole dataset (format.CRC_ATTR)
    dtype_name: str  # the tensor's dtype (format.DTYPE_ATTR)
    regions: List[RegionRead]
    finite: Optional[str] = None  # what it holds, when it must hold no NaN or infinity (named in the error)
    failure: Optional[str] = None  # what a failed read of it is called (None: "reading /<path>")
    # Arrays every rank ends up holding whole: every rank's ``(rank, start, stop)`` rows of ``whole``,
    # exchanged after the checksums are verified (:func:`.reader.exchange`).
    shared: Optional[list] = None
    whole: Optional[np.ndarray] = None


@dataclass
class ReadPlan:
    """Everything one load reads, on this rank."""

    path: str
    datasets: List[DatasetRead]  # in path order: checksum errors name them so
    parallel: bool  # every rank opens the file collectively (else only ranks with regions open it)
    verify: bool = True  # compare the checksums
    problems: List[str] = field(default_factory=list)  # found while planning; agreed on with the read's
    opening: str = "opening"  # what a failure to open is called
    error: type = fmt.CheckpointCorrupt  # what every rank raises when a read fails (a CheckpointError)


def plan_shared(header, paths, rank, nreaders, finite=(), into=None):
    """``[DatasetRead]`` of ``paths`` (sorted) that every rank ends up holding whole: ``nreaders`` ranks share
    their rows (:func:`format.plan_pieces`) and exchange them afterwards. ``into``: ``{path: array}`` of the
    stored shape and dtype, C-contiguous, to read straight into instead of new arrays; ``finite``: paths that
    must hold no NaN or infinity."""
    into = into or {}
    arrays = [into[p] if p in into else np.empty(header.datasets[p][0], dtype=np.dtype(header.datasets[p][1]))
              for p in paths]
    pieces = fmt.plan_pieces([(a.shape, a.dtype.itemsize) for a in arrays], nreaders)
    out = []
    for path, array, rows in zip(paths, arrays, pieces):
        attrs = header.datasets[path][2]
        regions = [RegionRead(fmt.rows(array.shape, a, b), array[a:b] if array.ndim else array)
                   for r, a, b in rows if r == rank]
        out.append(DatasetRead(path, array.shape, array.dtype, int(attrs[fmt.CRC_ATTR]), attrs[fmt.DTYPE_ATTR],
                               regions, finite="a parameter or optimizer state" if path in finite else None,
                               shared=rows, whole=array))
    return out


def plan_checksums(header, paths, rank, nreaders):
    """``[DatasetRead]`` of ``paths`` (sorted) read for their checksums alone, ``nreaders`` ranks sharing the
    rows, for loads whose own regions do not tile the file (split models): regions added later are unchecked."""
    specs = [(tuple(header.datasets[p][0]), np.dtype(header.datasets[p][1])) for p in paths]
    pieces = fmt.plan_pieces([(s, d.itemsize) for s, d in specs], nreaders)
    out = []
    for path, (shape, dtype), rows in zip(paths, specs, pieces):
        attrs = header.datasets[path][2]
        regions = [RegionRead(fmt.rows(shape, a, b), None) for r, a, b in rows if r == rank]
        out.append(DatasetRead(path, shape, dtype, int(attrs[fmt.CRC_ATTR]), attrs[fmt.DTYPE_ATTR], regions))
    return out
