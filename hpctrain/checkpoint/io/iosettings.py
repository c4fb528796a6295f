"""How a checkpoint file is laid out and opened for the file system it goes to: the boundary its large datasets,
and every rank's region of them, start on (``checkpoint.alignment``), and the MPI-IO hints the file is opened
with (``checkpoint.io_hints``), both chosen from the file system of the checkpoint directory where it can be
detected (docs/checkpoint-format.md, "Aligned layout"; docs/performance.md, "At scale").

On Lustre and GPFS a shared file written by many ranks runs at a fraction of the hardware's speed when the
writes straddle stripe or block boundaries: two ranks then lock and write the same stripe. Aligned regions
make every rank's writes its own stripes."""
import os
import subprocess
from dataclasses import dataclass, field
from typing import Dict

from ..content import format as fmt
from .directio import BLOCK

DEFAULT_ALIGNMENT = 1 << 20  # 1 MiB: Lustre's default stripe size, and a divisor of GPFS block sizes
# HDF5 aligns objects from this size on: the datasets split among ranks (format.SPLIT_BYTES). Smaller ones stay
# packed, so a model of many small tensors does not grow by a boundary's padding per tensor.
ALIGN_FROM = fmt.SPLIT_BYTES
# Bytes HDF5 reserves for metadata at a time (its default is 2 KiB): a file's object headers and attributes
# then sit together in a few blocks, written in few operations, not scattered between the datasets.
META_BLOCK = 1 << 20
# Shared-file systems whose clients lock stripes or blocks: collective buffering (a few aggregators write
# whole stripes) and no data sieving (a read-modify-write of the gaps) pay there.
PARALLEL = ("lustre", "gpfs", "beegfs", "wekafs", "pvfs2", "orangefs")
COLLECTIVE_HINTS = {"romio_cb_write": "enable", "romio_ds_write": "disable"}
# Local file systems where ranks' buffered writes into one file wait on its inode lock, and where both ways
# around it are solid: O_DIRECT, and shared mappings of space allocated ahead (fallocate).
LOCAL = ("ext4", "xfs")


@dataclass(frozen=True)
class IOSettings:
    """The layout and hints of one run's checkpoint files, the same on every rank (rank 0 chooses them)."""

    alignment: int = 1  # bytes; 1: HDF5's own packing (no alignment)
    hints: Dict[str, str] = field(default_factory=dict)  # MPI_Info keys and values
    filesystem: str = ""  # as /proc/self/mountinfo names it, e.g. "lustre"; "" unknown
    mount: str = ""
    alignment_from: str = ""  # where the alignment came from, said in the run's first lines
    direct: bool = False  # checkpoint.direct_io: O_DIRECT where direct_writes() allows it
    mapped: bool = True  # shared mappings where mapped_writes() allows them (False: HDF5's buffered writes)

    def h5py_kwargs(self):
        """``h5py.File`` arguments for the layout (none for an unaligned file)."""
        if self.alignment <= 1:
            return {}
        return {"alignment_threshold": min(ALIGN_FROM, self.alignment), "alignment_interval": self.alignment,
                "meta_block_size": META_BLOCK}

    def collective_writes(self):
        """Whether a foreground save writes the parts of split datasets in collective calls: where the
        layout is packed (parts straddle boundaries, and the aggregators merge them), or the hints ask for
        collective buffering (``romio_cb_write=enable``, the default on shared-file systems: a few aggregators
        write whole stripes) or forbid independent I/O (``romio_no_indep_rw=true``). Otherwise each rank
        writes its aligned parts alone: no rank waits for another between datasets, and no aggregator cuts a
        part off its boundary (docs/performance.md, "At scale")."""
        return (self.alignment <= 1 or self.hints.get("romio_cb_write") == "enable"
                or self.hints.get("romio_no_indep_rw") == "true")

    def direct_writes(self):
        """Whether each rank writes its aligned parts of split datasets with ``O_DIRECT`` (:mod:`.directio`):
        where ``direct`` asks for it, each rank writes them alone, the layout is aligned on whole blocks, and
        the file system is one of ``LOCAL``. Elsewhere (Lustre, GPFS, NFS, tmpfs, unknown) through HDF5."""
        return self.direct and self._direct_possible()

    def _direct_possible(self):
        return self._alone_on_local() and self.alignment % BLOCK == 0

    def mapped_writes(self):
        """Whether each rank copies its parts of split datasets into a shared mapping of the file
        (:mod:`.mapped`): where each rank writes them alone on a file system of ``LOCAL`` and no direct writes
        are made. There the ranks' buffered writes would take turns on the file's lock."""
        return self.mapped and self._alone_on_local() and not self.direct_writes()

    def _alone_on_local(self):
        return not self.collective_writes() and self.filesystem in LOCAL

    def mpi_info(self):
        """The hints as an ``MPI.Info`` (None without hints); the caller frees it."""
        if not self.hints:
            return None
        from mpi4py import MPI

        info = MPI.Info.Create()
        for key, value in sorted(self.hints.items()):
            info.Set(key, value)
        return info

    def describe(self):
        fs = f"{self.filesystem or 'unknown file system'}{' at ' + self.mount if self.mount else ''}"
        align = (f"large datasets and each rank's part aligned on {_size(self.alignment)} ({self.alignment_from})"
                 if self.alignment > 1 else "no alignment (checkpoint.alignment = 1)")
        hints = ", ".join(f"{k}={v}" for k, v in sorted(self.hints.items())) or "none"
        direct = ("" if not self.direct else "; parts written with O_DIRECT (checkpoint.direct_io)"
                  if self._direct_possible() else "; checkpoint.direct_io not used: O_DIRECT is for ext4 and "
                  "XFS, without collective buffering, aligned on a multiple of 4 KiB")
        mapped = "; parts copied into a shared mapping of the file" if self.mapped_writes() else ""
        return f"checkpoint I/O: {fs}; {align}; MPI-IO hints: {hints}{direct}{mapped}"


def io_of(info):
    """The :class:`IOSettings` a save's ``info`` (:func:`~.commit.begin`) carries; none: no alignment, no hints."""
    return info.get("io") or IOSettings()


def _size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


# ---------------------------------------------------------------- the file system

def parse_mountinfo(text):
    """``[(mount point, fstype)]`` from the text of ``/proc/self/mountinfo`` (pure)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        mounts.append((fields[4].encode().decode("unicode_escape"), tail[0]))  # "\040" is a space
    return mounts


def filesystem_of(path, mounts):
    """``(fstype, mount point)`` of the mount holding ``path`` (an absolute, resolved path), the longest mount
    point that contains it; the last mounted wins where one is mounted over another (pure)."""
    best = ("", "")
    for point, fstype in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[1]):
            best = (fstype, point)
    return best


def _existing(path):
    """``path`` resolved, or its nearest existing parent (the directory may not exist yet)."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def detect(directory):
    """``(fstype, mount point)`` of ``directory`` on this node (``("", "")`` where /proc is not there)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = parse_mountinfo(f.read())
    except OSError:
        return "", ""
    return filesystem_of(_existing(directory), mounts)


def stripe_size(directory, fstype):
    """The file system's own unit of ``directory`` in bytes, or None: Lustre's stripe size (``lfs getstripe
    -S``, the layout new files there get), GPFS's block size (what ``statvfs`` reports there)."""
    where = _existing(directory)
    if fstype == "lustre":
        try:
            out = subprocess.run(["lfs", "getstripe", "-d", "-S", where], capture_output=True, text=True,
                                 timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        words = out.stdout.split()
        return int(words[-1]) if out.returncode == 0 and words and words[-1].isdigit() else None
    if fstype == "gpfs":
        try:
            return os.statvfs(where).f_bsize or None
        except OSError:
            return None
    return None


# ---------------------------------------------------------------- the choice

def io_settings_for(directory, alignment=0, io_hints=None, direct=False, detected=None, stripe=None):
    """The :class:`IOSettings` of checkpoints in ``directory`` (rank 0; the caller hands them to every rank).

    ``alignment``: bytes; 0 chooses it: the stripe (or block) size where the file system reports one, else
    1 MiB; 1: none. ``io_hints``: the user's MPI-IO hints, over the defaults for the file system (collective
    buffering on, data sieving off on the shared-file systems of ``PARALLEL``; Lustre's stripe size as
    ``striping_unit``). ``direct``: checkpoint.direct_io. ``detected``, ``stripe``: the file system and its
    unit, when known (tests)."""
    fstype, mount = detect(directory) if detected is None else detected
    unit = stripe_size(directory, fstype) if stripe is None else stripe
    if alignment:
        chosen, why = alignment, "checkpoint.alignment"
    elif unit:
        chosen, why = unit, f"the {fstype} {'stripe' if fstype == 'lustre' else 'block'} size"
    else:
        chosen, why = DEFAULT_ALIGNMENT, "hpctrain's default"
    hints = dict(COLLECTIVE_HINTS) if fstype in PARALLEL else {}
    if fstype == "lustre" and unit:
        hints["striping_unit"] = str(unit)
    hints.update({str(k): hint_value(v) for k, v in (io_hints or {}).items()})
    return IOSettings(chosen, hints, fstype, mount, why, bool(direct))


def hint_value(value):
    """A TOML value as MPI_Info wants it: a string (``true`` -> ``"true"``, 8 -> ``"8"``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
