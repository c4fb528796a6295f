"""The I/O of a collective save, recorded, not assumed: every rank runs under strace, which logs each write
into the checkpoint file (offset and length); the file's layout is read back. On 2, 4 and 16 ranks
(oversubscribed): each rank's part of a large dataset starts on the alignment; every large write starts there
too; the data of a part goes out in one write; HDF5's metadata in a few; the file opens in plain h5py and
h5dump. On 2, 4, 8 and 16 ranks: hpctrain makes the same number of collective calls per save, and the bytes
rank 0 receives grow no faster than docs/performance.md ("At scale") says. An unaligned save (alignment = 1,
the layout of before) shows what the checks catch, and still loads. Without a hint asking for collective
buffering (on 2 and 16 ranks), every rank writes its own parts: by default (the disk here is ext4) each allocated
in one call and copied into windows of a shared mapping of the file, never with a plain write; with
checkpoint.direct_io each in one write through a descriptor opened with O_DIRECT, and the verification reads
them back through such a descriptor. With the hint, or unaligned, nothing is mapped, or written or read so."""
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import h5py
import pytest

from mpi_harness import PYTHON, ROOT, mpirun
from system_packages import install_debian

# One worker for the module: the 16-rank launch of the aligned-parts test also gives the collective-calls test
# its 16-rank default save (--then-default), kept in _DEFAULT.
pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.xdist_group("io_pattern")]

SCRIPT = ROOT / "tests" / "mpi" / "io_pattern.py"
MiB = 1 << 20
# pwrite64(fd</path>, "..."..., count, offset) = n; pwritev(fd</path>, [...], iovcnt, offset) = n
WRITE = re.compile(r"^(pwrite64|pwritev)\((\d+)<([^>]*)>, .*, (\d+)\) = (\d+)$")
# openat(AT_FDCWD<...>, "/path", O_WRONLY|O_DIRECT|O_CLOEXEC) = 18</path>
# preadv2(fd</path>, [{iov_base=..., iov_len=n}], 1, offset, flags) = n (Python's os.preadv; preadv without
# the flags where it calls that): the direct re-read of a part
READ = re.compile(r"^(?:preadv2\((\d+)<([^>]*)>, .*, (\d+), \d+|preadv\((\d+)<([^>]*)>, .*, (\d+))\) = (\d+)$")
OPEN = re.compile(r"^openat\(.*, \"([^\"]*)\", ([A-Z_|]+)(?:, \d+)?\) = (\d+)")
# fallocate(fd</path>, 0, offset, length) = 0 (posix_fallocate): a part's space, allocated before it is mapped
ALLOC = re.compile(r"^fallocate\((\d+)<([^>]*)>, 0, (\d+), (\d+)\) = 0$")
# mmap(NULL, length, PROT_READ|PROT_WRITE, MAP_SHARED, fd</path>, offset) = 0x...: a window of a mapped write
MAP = re.compile(r"^mmap\(NULL, (\d+), PROT_READ\|PROT_WRITE, MAP_SHARED, (\d+)<([^>]*)>, (0x[0-9a-f]+|\d+)\) = 0x")


@pytest.fixture(scope="module")
def strace():
    """strace, with a seccomp filter where it has one (strace >= 5.3): then only the traced calls stop the
    process, not every call of 16 ranks importing torch (a traced 16-rank save: 35 s here instead of 54)."""
    if shutil.which("strace") is None:
        assert os.geteuid() == 0, "strace is missing and only root can install it: apt-get install strace"
        install_debian("strace")
    probe = subprocess.run([shutil.which("strace"), "--seccomp-bpf", "-f", "-e", "trace=openat", "-o", "/dev/null",
                            "true"], capture_output=True, timeout=60)
    return [shutil.which("strace")] + (["--seccomp-bpf"] if probe.returncode == 0 else [])


_DEFAULT = {}  # ranks -> the report of a default save made by a launch of another test (--then-default)


def save(ranks, strace=None, alignment=0, *hints, io=None, direct=False, then_default=False):
    """One save on ``ranks`` ranks: the script's report, and ``[[(offset, length), ...] per traced process]``
    of its writes into the checkpoint file, a mapped write counted as the range it allocated first. The
    report's ``direct`` lists the writes made through a descriptor opened with O_DIRECT, ``direct_reads`` the
    reads so; ``allocated`` the ranges allocated for mapped writes, ``mapped`` ``[(allocated, windows)]`` per
    process that mapped, ``pwrites`` the plain writes. ``direct``: checkpoint.direct_io. ``io``: Open MPI's
    MPI-IO component (default: its own choice)."""
    work = Path(tempfile.mkdtemp(prefix=f"hpctrain-io-{ranks}-"))
    calls = "openat,pwrite64,pwritev,pwritev2,write,writev,preadv,preadv2,fallocate,mmap"
    traced = [*strace, "-f", "-ff", "-y", "-e", f"trace={calls}", "-o", str(work / "trace")] if strace else []
    args = [*traced, PYTHON, SCRIPT] if strace else [SCRIPT]
    then = ["--then-default", work / "default"] if then_default else []
    result = mpirun(ranks, [*args, work / "ckpt", alignment, *hints, *(["--direct"] if direct else []), *then],
                    timeout=240, env={"OMPI_MCA_io": io} if io else None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("IO_PATTERN "))
    report = json.loads(line.split(" ", 1)[1])
    if then_default:
        line = next(x for x in result.stdout.splitlines() if x.startswith("IO_PATTERN_DEFAULT "))
        _DEFAULT[ranks] = json.loads(line.split(" ", 1)[1])
    writes, report["direct"], report["direct_reads"] = [], [], []
    report["allocated"], report["mapped"], report["pwrites"] = [], [], []
    for trace in sorted(work.glob("trace.*")):
        mine, direct_fds, allocated, windows = [], set(), [], []
        for text in trace.read_text(errors="replace").splitlines():
            text = text.split(" ", 1)[1] if text[:1].isdigit() else text
            opened = OPEN.match(text)
            if opened:  # a descriptor number is reused: what it is now is what the last open made it
                direct_fds.discard(opened.group(3))
                if ".h5.tmp-" in opened.group(1) and "O_DIRECT" in opened.group(2).split("|"):
                    direct_fds.add(opened.group(3))
            m = WRITE.match(text)
            if m and ".h5.tmp-" in m.group(3) and "/ckpt/" in m.group(3):
                mine.append((int(m.group(4)), int(m.group(5))))
                report["pwrites"].append(mine[-1])
                if m.group(2) in direct_fds:
                    report["direct"].append(mine[-1])
            a = ALLOC.match(text)
            if a and ".h5.tmp-" in a.group(2) and "/ckpt/" in a.group(2):
                allocated.append((int(a.group(3)), int(a.group(4))))
                mine.append(allocated[-1])
            w = MAP.match(text)
            if w and ".h5.tmp-" in w.group(3):
                windows.append((w.group(3), int(w.group(4), 0), int(w.group(1))))
            r = READ.match(text)
            fd, path, offset = (r.group(1, 2, 3) if r.group(1) else r.group(4, 5, 6)) if r else (None,) * 3
            if r and fd in direct_fds and ".h5.tmp-" in path:
                report["direct_reads"].append((int(offset), int(r.group(7))))
        if mine:
            writes.append(mine)
        # the file itself, not the companions Open MPI maps elsewhere (a shared file pointer's, a semaphore)
        windows = [(o, n) for path, o, n in windows
                   if "/ckpt/" in path and re.search(r"\.h5\.tmp-[^/.]*$", path)]
        if allocated or windows:
            report["allocated"] += allocated
            report["mapped"].append((allocated, windows))
    assert not strace or writes, f"no write into the checkpoint file in the traces of {work}"
    return report, writes


def split_datasets(report):
    return {name: d for name, d in report["datasets"].items() if len(d["starts"]) > 1 or d["nbytes"] >= MiB}


def data_extent(report, offset):
    """The dataset whose data holds file ``offset``, or None (then it is metadata)."""
    return next((name for name, d in report["datasets"].items()
                 if d["offset"] <= offset < d["offset"] + d["nbytes"]), None)


def covered(reads, offset, length):
    """Whether ``reads`` ``[(offset, length)]`` together hold every byte of ``[offset, offset + length)``."""
    pos = offset
    for o, n in sorted(reads):
        if o <= pos < o + n:
            pos = o + n
    return pos >= offset + length


COLLECTIVE = ("romio_cb_write=enable",)  # the hint that asks for collective writes, as on Lustre and GPFS


# Without collective buffering (this disk's default) each rank writes its aligned parts alone. With it, Open MPI's
# OMPIO (its default) cuts a collective write among its aggregators at points of its own on a file system that
# reports no stripe (on 16 ranks here: 4120576 into a 6 MB dataset), whatever the regions; ROMIO's aggregators
# follow the aligned regions. So the 16-rank collective case runs on ROMIO (docs/performance.md, "At scale").
# checkpoint.direct_io is asked for in all but the first: it applies where each rank writes its parts alone.
@pytest.mark.parametrize("ranks, hints, io, direct", [(2, (), None, False), (2, (), None, True), (16, (), None, True),
                                                      (4, COLLECTIVE, None, True), (16, COLLECTIVE, "romio321", True)],
                         ids=["2", "2-direct", "16-direct", "4-collective", "16-collective-romio"])
def test_a_save_writes_aligned_parts_in_few_large_writes(strace, ranks, hints, io, direct):
    report, writes = save(ranks, strace, 0, *hints, io=io, direct=direct, then_default=(ranks == 16 and not io))
    align = report["alignment"]
    assert align == MiB and "aligned on 1 MiB" in report["describe"]  # this machine's disk reports no stripe
    # The layout read back: every rank's part of a large dataset starts on the boundary.
    large = split_datasets(report)
    assert len(large) == 6  # embed, proj weight and their two Adam moments
    for name, d in large.items():
        assert all(start % align == 0 for start in d["starts"]), (name, d)
    # The writes themselves: large ones start on the boundary; each part goes out in one write at most per
    # writer (the MPI-IO layer may merge parts into fewer writes: two-phase collective buffering).
    flat = [w for mine in writes for w in mine]
    big = [(o, n) for o, n in flat if n >= MiB]
    assert big and all(o % align == 0 for o, n in big), big
    parts = sum(len(d["starts"]) for d in large.values())
    data = [(o, n) for o, n in flat if data_extent(report, o) in large]
    assert len(data) <= parts, (len(data), parts, data)
    assert sum(n for _, n in data) == sum(d["nbytes"] for d in large.values())  # every byte once
    if not hints:  # no collective buffering asked for (this disk's default): each rank writes its own parts
        assert report["hints"] == {}
        owned = {}  # rank -> the starts of its parts, as the plan gives them
        for d in large.values():
            for rank, start in zip(d["ranks"], d["starts"]):
                owned.setdefault(rank, set()).add(start)
        written = [sorted(o for o, _ in mine if data_extent(report, o) in large) for mine in writes]
        written = [w for w in written if w]
        # One process per rank wrote exactly its rank's parts, one write each: no aggregator wrote another's.
        assert sorted(written) == sorted(sorted(s) for s in owned.values()), (written, owned)
    if not hints and not direct:  # the default here: each rank's parts copied into a shared mapping of the file
        assert report["direct"] == report["direct_reads"] == [] and "O_DIRECT" not in report["describe"]
        assert "parts copied into a shared mapping of the file" in report["describe"]
        # Every part allocated first (a full disk is then an error, not a SIGBUS), in one call, and none written
        # with a plain write ...
        assert sorted(report["allocated"]) == sorted(data), (report["allocated"], data)
        assert not [(o, n) for o, n in report["pwrites"] if data_extent(report, o) in large]
        # ... then copied through windows of its own process's shared mappings that cover every byte of it.
        for allocated, windows in report["mapped"]:
            assert all(covered(windows, o, n) for o, n in allocated), (allocated, windows)
    elif not hints:  # checkpoint.direct_io: straight to the disk, every write of a part through O_DIRECT
        assert "parts written with O_DIRECT" in report["describe"]
        assert sorted(report["direct"]) == sorted(data), (report["direct"], data)
        assert report["mapped"] == [] and "mapping" not in report["describe"]
        # ... and read back so for the checksums, every byte of every part.
        assert all(covered(report["direct_reads"], o, n) for o, n in data), (report["direct_reads"], data)
    else:  # collective buffering: the MPI-IO layer's aggregators write, through the page cache
        assert report["direct"] == report["direct_reads"] == [] and report["mapped"] == []
        assert "checkpoint.direct_io not used" in report["describe"]
    # HDF5's metadata: written collectively, in a few vectored writes per writer, not one per object.
    metadata = [[(o, n) for o, n in mine if data_extent(report, o) is None] for mine in writes]
    assert max(len(m) for m in metadata) <= 6, metadata
    # The padding the alignment costs is bounded: at most one boundary per large dataset and metadata block.
    assert report["file_bytes"] <= report["data_bytes"] + (len(large) + 2) * align
    # Plain HDF5 tools open it.
    with h5py.File(report["file"], "r") as f:
        assert f["model/embed.weight"].shape == (1500, 1024)
    if shutil.which("h5dump"):
        dump = subprocess.run(["h5dump", "-H", report["file"]], capture_output=True, text=True, timeout=60)
        assert dump.returncode == 0 and "model" in dump.stdout, dump.stderr[-2000:]


def test_without_alignment_parts_straddle_boundaries_and_the_file_still_loads(strace):
    report, writes = save(2, strace, 1, direct=True)
    assert report["alignment"] == 1 and "no alignment" in report["describe"]
    starts = [s for d in split_datasets(report).values() for s in d["starts"]]
    assert any(s % MiB for s in starts)  # what the aligned layout prevents
    big = [(o, n) for mine in writes for o, n in mine if n >= MiB]
    assert any(o % MiB for o, _ in big)
    # checkpoint.direct_io asked for: an unaligned part is not whole blocks, so HDF5 writes it, buffered
    assert report["direct"] == report["direct_reads"] == [] and "direct_io not used" in report["describe"]
    assert report["mapped"] == []  # nor mapped: the packed layout is written in collective calls
    # The unaligned file of before loads with today's reader, on another rank count.
    out = mpirun(4, [SCRIPT, "--load", report["file"]], timeout=240)
    assert out.returncode == 0 and out.stdout.count("LOADED OK") == 4, out.stdout[-3000:] + out.stderr[-3000:]


def test_collective_calls_per_save_do_not_grow_with_the_ranks():
    reports = {n: _DEFAULT.get(n) or save(n)[0] for n in (2, 4, 8, 16)}
    calls = {n: set(r["calls"]) for n, r in reports.items()}
    assert all(len(c) == 1 for c in calls.values()), calls  # every rank makes the same calls
    assert len({c.pop() for c in calls.values()}) == 1, reports  # and as many on 16 ranks as on 2
    # Rank 0 receives every rank's checksums of the parts it wrote: linear in the ranks, a few hundred bytes
    # a rank (docs/performance.md, "At scale").
    received = {n: r["received"][0] for n, r in reports.items()}
    per_rank = (received[16] - received[2]) / 14
    assert 0 <= per_rank <= 1024, received
    assert received[16] <= received[2] + 14 * 1024
