"""The checkpoint file format: names, layout, version, dtype encoding, checksums, and how datasets are shared
out among ranks. Pure functions (numpy only): no MPI, no h5py, no torch at import time, so the fast unit tests
and ``hpctrain ckpt`` on a login node can use them. ``docs/checkpoint-format.md`` documents the layout too;
keep the two in step."""
import json
import math
import re
import zlib

from ...errors import CheckpointError

FORMAT_NAME = "hpctrain-checkpoint"
FORMAT_VERSION = 2
# Versions this code can read. A newer writer bumps FORMAT_VERSION; old readers refuse it. Version 2 added the
# metadata checksum (METADATA_CRC_ATTR), which a version-2 file must have; version-1 files are still read,
# with a warning that their attributes are unchecked.
READABLE_VERSIONS = (1, 2)

MODEL = "model"
OPTIMIZER = "optimizer"
OPT_STATE = "optimizer/state"
TRAINER = "trainer"
RNG = "trainer/rng"

LATEST = "latest"
NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")

# Tensors from this size on are split along axis 0 across all ranks (plan_pieces): below ~1 MiB one collective
# per rank costs more than the bytes it would save.
SPLIT_BYTES = 1 << 20

CRC_ATTR = "crc32"
DTYPE_ATTR = "dtype"
# Root attribute (version 2): CRC-32 of metadata_text(): every attribute, dataset shape and stored dtype.
METADATA_CRC_ATTR = "metadata_crc32"

# Where a run's abandoned branches are kept, inside the checkpoint directory.
ABANDONED = "abandoned"


class CheckpointCorrupt(CheckpointError):
    """The file is damaged or not a checkpoint this code can read (resume may fall back)."""


class NonFiniteState(CheckpointError):
    """The state to save holds NaN or infinite parameters or optimizer state (not written)."""


# ---------------------------------------------------------------- names

def checkpoint_name(step):
    """``ckpt-00000120.h5``: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"ckpt-{step:08d}.h5"


def parse_step(name):
    """Step of a checkpoint file name, or None if the name is not one (temp files are not)."""
    match = NAME_RE.match(name)
    return int(match.group(1)) if match else None


def param_key(name):
    """HDF5 path component for a tensor name: dots are kept, '/' would make a group."""
    return name.replace("/", "%2F")


def param_name(key):
    return key.replace("%2F", "/")


# ---------------------------------------------------------------- dtypes
# torch dtypes without a numpy type: raw bits of the same width; the ``dtype`` attribute names the real one.
# bool too: h5py would store numpy bool as an HDF5 enum; uint8 is plainer.
RAW_STORAGE = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "float8_e4m3fnuz": "uint8",
               "float8_e5m2fnuz": "uint8", "bool": "uint8"}


def storage_dtype(torch_dtype_name):
    """numpy dtype name used on disk for a torch dtype name (``"float32"``, ``"bfloat16"``)."""
    return RAW_STORAGE.get(torch_dtype_name, torch_dtype_name)


# ---------------------------------------------------------------- checksums
# A dataset's checksum: the standard CRC-32 (zlib.crc32) of its raw little-endian C-order bytes, so anyone can
# check it with ``zlib.crc32(f[path][()].tobytes())``. Ranks checksum their own slices; crc32_combine joins
# them in order without the bytes.

def _gf2_times(matrix, vector):
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix):
    return [_gf2_times(matrix, column) for column in matrix]


def _zero_byte_operator():
    # The raw CRC register update over zero bytes is linear in the register: read its
    # 32 columns off zlib itself (its init/final xor cancels between the two calls).
    base = zlib.crc32(b"\0", 0)
    return [zlib.crc32(b"\0", 1 << i) ^ base for i in range(32)]


_ZERO_POWERS = [_zero_byte_operator()]  # operator for 2**k zero bytes, k = index


def _shift(crc, nbytes):
    """The register ``crc`` advanced over ``nbytes`` zero bytes (O(log n))."""
    k = 0
    while nbytes:
        while k >= len(_ZERO_POWERS):
            _ZERO_POWERS.append(_gf2_square(_ZERO_POWERS[-1]))
        if nbytes & 1:
            crc = _gf2_times(_ZERO_POWERS[k], crc)
        nbytes >>= 1
        k += 1
    return crc


def crc32_combine(crc_a, crc_b, len_b):
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _shift(crc_a, len_b) ^ crc_b


def combine_pieces(pieces):
    """CRC-32 of a dataset from ``[(byte_offset, nbytes, crc)]`` pieces, in any order; they must tile its
    bytes exactly (a gap or overlap is a bug)."""
    crc, expected = 0, 0
    for offset, nbytes, piece_crc in sorted(pieces):
        if offset != expected:
            raise ValueError(f"pieces do not tile the dataset: gap or overlap at byte {expected}")
        crc = crc32_combine(crc, piece_crc, nbytes) if nbytes else crc
        expected = offset + nbytes
    return crc


def combine_checksums(gathered, ndatasets):
    """Per-dataset CRC-32 from every rank's ``own_checksums`` lists."""
    per = [[] for _ in range(ndatasets)]
    for rank_list in gathered:
        for i, offset, nbytes, crc in rank_list:
            per[i].append((offset, nbytes, crc))
    return [combine_pieces(p) for p in per]


try:  # the same CRC-32 as zlib's, from ISA-L: 36 GB/s against zlib's 7 here (x86-64, aarch64)
    from isal.isal_zlib import crc32
except ImportError:  # a platform without an isal wheel: zlib's
    crc32 = zlib.crc32


def crc32_bytes(array):
    """CRC-32 of a numpy array's bytes in C order (a copy only if it is not contiguous)."""
    import numpy as np

    return crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------- the metadata checksum
# Attributes are outside the per-dataset CRCs, yet resume reads them (step, learning rates, optimizer state
# values). One CRC-32 covers them all: of a canonical JSON text of every attribute of ``/``, of every group
# with attributes, and of every dataset (its attributes, shape and stored dtype). Writer and reader build the
# text from the values, not the bytes HDF5 stores, so any reader can recompute it (docs/checkpoint-format.md).

def attr_value(value):
    """An attribute value as plain Python (bytes -> str, numpy scalars and arrays -> Python)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if hasattr(value, "tolist"):  # numpy scalar or array
        return value.tolist()
    return value


def metadata_text(root_attrs, group_attrs, datasets):
    """The canonical text the metadata checksum is taken of.

    ``root_attrs``: ``{name: value}`` of ``/`` (``metadata_crc32`` itself is left out);
    ``group_attrs``: ``{group path: {name: value}}`` (groups without attributes are left out);
    ``datasets``: ``{dataset path: (shape, numpy dtype str such as "<f4", {name: value})}``."""
    def plain(attrs):
        return {k: attr_value(v) for k, v in attrs.items()}

    doc = {"root": plain({k: v for k, v in root_attrs.items() if k != METADATA_CRC_ATTR}),
           "groups": {g: plain(a) for g, a in group_attrs.items() if a},
           "datasets": {p: [list(shape), str(dtype), plain(a)] for p, (shape, dtype, a) in datasets.items()}}
    return json.dumps(doc, sort_keys=True, allow_nan=True, ensure_ascii=True, separators=(",", ":"))


def metadata_crc(root_attrs, group_attrs, datasets):
    return zlib.crc32(metadata_text(root_attrs, group_attrs, datasets).encode("ascii"))


# ---------------------------------------------------------------- non-finite values
# A checkpoint of a blown-up run is worthless and, kept by retention, pushes out good ones: parameters and
# optimizer state must be finite. Buffers may hold infinities on purpose (a causal mask of -inf): unchecked.

# For the dtypes stored as raw bits: (mask, value): the element is NaN or infinite when
# ``bits & mask == value`` (all exponent bits set; the fnuz formats' only NaN is 0x80).
_RAW_NONFINITE = {"bfloat16": (0x7F80, 0x7F80), "float8_e5m2": (0x7C, 0x7C), "float8_e4m3fn": (0x7F, 0x7F),
                  "float8_e4m3fnuz": (0xFF, 0x80), "float8_e5m2fnuz": (0xFF, 0x80)}


def can_be_nonfinite(dtype_name):
    """True for floating dtypes (torch dtype names as in the ``dtype`` attribute)."""
    return dtype_name.startswith("float") or dtype_name in ("bfloat16", "half", "double")


def all_finite(array, dtype_name):
    """True if no element of ``array`` (as stored, see :func:`storage_dtype`) is NaN or
    infinite. Integer and bool dtypes are always finite."""
    import numpy as np

    if array.size == 0 or not can_be_nonfinite(dtype_name):
        return True
    raw = _RAW_NONFINITE.get(dtype_name)
    if raw is None:
        return bool(np.isfinite(array).all())
    mask, value = raw
    return not bool(((array & array.dtype.type(mask)) == value).any())


def finite_paths(header_groups, dataset_paths):
    """Dataset paths of a file that must be finite: the model's parameters (the names the
    optimizer's ``param_groups`` list) and every optimizer state tensor. Buffers are not
    in ``param_groups``; files without an optimizer have only their state checked."""
    groups = from_json(header_groups.get(OPTIMIZER, {}).get("param_groups", "[]"), "/optimizer param_groups")
    params = {f"{MODEL}/{param_key(n)}" for g in groups if isinstance(g, dict)
              for n in g.get("params", []) if isinstance(n, str)}
    return {p for p in dataset_paths if p in params or p.startswith(OPT_STATE + "/")}


# ---------------------------------------------------------------- sharing out the work
# A region is ``((start, stop), ...)``, one pair per dimension of the dataset (``()`` for a
# scalar): the part of a dataset that one rank writes or reads.

def row_bytes(shape, itemsize):
    return itemsize * math.prod(shape[1:]) if shape else itemsize


def nbytes_of(shape, itemsize):
    return itemsize * math.prod(shape)


def plan_pieces(specs, nranks, split_bytes=SPLIT_BYTES, alignment=1):
    """Which rank handles which rows of which dataset. ``specs``: ``[(shape, itemsize)]``, one per dataset,
    the same on every rank. Returns one list per dataset of ``(rank, start_row, stop_row)`` pieces in row
    order. Scalars are one piece ``(rank, 0, 1)``. Large tensors are split along axis 0 into ``nranks`` nearly
    equal parts (empty parts are left out); with ``alignment`` (bytes), each part starts on a multiple of it
    from the dataset's start (:func:`aligned_cuts`: fewer parts where the tensor holds fewer aligned steps, the
    larger ones to the ranks that hold the least so far). Small ones go whole to the least-loaded rank (lowest
    rank on ties), so the result depends only on the arguments (their order too)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    load = [0] * nranks
    plan = [None] * len(specs)
    for i, (shape, itemsize) in enumerate(specs):
        size = nbytes_of(shape, itemsize)
        if shape and size >= split_bytes and nranks > 1 and shape[0] > 1:
            rows, width = shape[0], row_bytes(shape, itemsize)
            pieces = aligned_cuts(rows, width, nranks, alignment, load)
            if pieces is None:
                pieces = [(rank, rows * rank // nranks, rows * (rank + 1) // nranks) for rank in range(nranks)]
            pieces = [(rank, start, stop) for rank, start, stop in pieces if stop > start]
            for rank, start, stop in pieces:
                load[rank] += (stop - start) * width
            plan[i] = pieces
    for i, (shape, itemsize) in enumerate(specs):
        if plan[i] is None:
            rank = min(range(nranks), key=lambda r: (load[r], r))
            load[rank] += nbytes_of(shape, itemsize)
            plan[i] = [(rank, 0, shape[0] if shape else 1)]
    return plan


def aligned_cuts(rows, row_bytes, nparts, alignment, load=None):
    """``[(part, start_row, stop_row)]`` of ``rows`` rows of ``row_bytes`` cut into at most ``nparts`` nearly
    equal parts, each starting a multiple of ``alignment`` bytes from the dataset's start; fewer parts where
    the rows hold fewer aligned steps. None where not even one step fits (rows much longer than the alignment
    and no common multiple in reach), or without an alignment (``alignment`` <= 1).

    The parts go largest first to the least loaded of ``range(nparts)`` (``load``: the bytes each already
    holds of other tensors; none: equal), each to a different one. An aligned step can be a large slice of
    a tensor (1 MiB over rows of 19 KiB is 1024 rows), so the parts are often unequal; giving the larger one to
    the same rank every time would leave it writing far more than the others over many tensors."""
    if alignment <= 1:
        return None
    unit = alignment // math.gcd(alignment, row_bytes)  # rows per aligned step
    steps = rows // unit
    if steps < 1:
        return None
    parts = min(nparts, steps)
    cuts = [0] + [round(steps * k / parts) * unit for k in range(1, parts)] + [rows]
    load, free, owner = load or [0] * nparts, list(range(nparts)), {}
    for k in sorted(range(parts), key=lambda k: (cuts[k] - cuts[k + 1], k)):  # the largest first
        owner[k] = min(free, key=lambda r: (load[r], r))
        free.remove(owner[k])
    return [(owner[k], cuts[k], cuts[k + 1]) for k in range(parts) if cuts[k + 1] > cuts[k]]


def rows(shape, start, stop):
    """The region of rows ``[start, stop)`` of a dataset of ``shape``."""
    return ((start, stop),) + tuple((0, n) for n in shape[1:]) if shape else ()


def slices(region):
    """The region as a tuple of slices, to index a dataset or array with."""
    return tuple(slice(a, b) for a, b in region)


def runs(shape, region, itemsize):
    """Byte ``(offset, nbytes)`` of the contiguous runs ``region`` covers in the C-order dataset of ``shape``,
    in the order of the region's own C-order elements; whole rows are one run."""
    import numpy as np

    if not shape:
        return [(0, itemsize)]
    last = max((d for d, (a, b) in enumerate(region) if (a, b) != (0, shape[d])), default=0)
    inner = math.prod(shape[last + 1:])
    a, b = region[last]
    run = (b - a) * inner * itemsize
    outer = [range(lo, hi) for lo, hi in region[:last]]
    if not outer:
        return [(a * inner * itemsize, run)]
    idx = np.stack(np.meshgrid(*outer, indexing="ij"), axis=-1).reshape(-1, last)
    start = np.concatenate([idx, np.full((len(idx), 1), a)], axis=1)
    flat = np.ravel_multi_index(tuple(start.T), shape[:last + 1]) * inner * itemsize
    return [(int(o), run) for o in flat]


# ---------------------------------------------------------------- JSON attributes

def to_json(value):
    """JSON text for attribute values: tensors/arrays become lists, tuples lists, the rest
    ``str``. Floats keep every bit (Python prints the shortest exact repr)."""
    def default(obj):
        if hasattr(obj, "tolist"):
            return obj.tolist()
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        return str(obj)

    return json.dumps(value, default=default, sort_keys=True, allow_nan=True)


def from_json(text, what):
    if isinstance(text, bytes):
        text = text.decode()
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"attribute {what} is not valid JSON: {exc}") from exc
