"""The checkpoint file's layout and MPI-IO hints as chosen for a file system (pure logic: mountinfo text, stripe
sizes and row cuts given as arguments). tests/test_io_pattern.py checks the files and writes themselves."""
import dataclasses
import math

import pytest

from hpctrain.checkpoint.content import format as fmt
from hpctrain.checkpoint.io.iosettings import (DEFAULT_ALIGNMENT, IOSettings, filesystem_of, io_settings_for,
                                            parse_mountinfo)
from hpctrain.config import TrainConfig
from hpctrain.config.validation import validate
from hpctrain.errors import ConfigError

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
40 27 0:50 / /lustre/scratch rw,flock - lustre 10.0.0.1@o2ib:/scratch rw
41 27 0:51 / /gpfs/work\\040area rw - gpfs work rw
42 40 0:52 / /lustre/scratch/nested rw - nfs server:/x rw
"""


def test_the_mount_holding_a_path_names_its_file_system():
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/gpfs/work area", "gpfs") in mounts  # \040 is a space
    assert filesystem_of("/lustre/scratch/me/run1", mounts) == ("lustre", "/lustre/scratch")
    assert filesystem_of("/lustre/scratch", mounts) == ("lustre", "/lustre/scratch")
    assert filesystem_of("/lustre/scratchy", mounts) == ("ext4", "/")  # a prefix of the name is not a parent
    assert filesystem_of("/lustre/scratch/nested/a", mounts) == ("nfs", "/lustre/scratch/nested")
    assert filesystem_of("/gpfs/work area/x", mounts) == ("gpfs", "/gpfs/work area")
    assert filesystem_of("/dev/shm/hpctrain", mounts) == ("tmpfs", "/dev/shm")


def test_lustre_aligns_on_its_stripe_and_gets_collective_hints():
    io = io_settings_for("/x", detected=("lustre", "/lustre"), stripe=4 << 20)
    assert io.alignment == 4 << 20 and "lustre stripe size" in io.alignment_from
    assert io.hints == {"romio_cb_write": "enable", "romio_ds_write": "disable", "striping_unit": str(4 << 20)}
    assert "aligned on 4 MiB" in io.describe() and "striping_unit=4194304" in io.describe()
    assert io.collective_writes()  # collective buffering asked for: aggregators write whole stripes


def test_a_local_disk_gets_the_default_alignment_and_no_hints():
    io = io_settings_for("/x", detected=("ext4", "/"), stripe=None)
    assert io.alignment == DEFAULT_ALIGNMENT and io.hints == {}
    assert io.h5py_kwargs() == {"alignment_threshold": fmt.SPLIT_BYTES, "alignment_interval": DEFAULT_ALIGNMENT,
                                "meta_block_size": 1 << 20}
    assert io.mpi_info() is None
    assert not io.collective_writes()  # aligned, no collective buffering: each rank writes its own parts


def test_the_users_settings_win_and_hints_become_strings():
    io = io_settings_for("/x", alignment=1, io_hints={"striping_factor": 16, "romio_cb_write": "disable",
                                                       "romio_no_indep_rw": True},
                         detected=("lustre", "/lustre"), stripe=1 << 20)
    assert io.alignment == 1 and io.h5py_kwargs() == {}  # 1: HDF5's own packing, as before
    assert io.hints["striping_factor"] == "16" and io.hints["romio_cb_write"] == "disable"
    assert io.hints["romio_no_indep_rw"] == "true" and io.hints["striping_unit"] == str(1 << 20)
    assert "no alignment" in io.describe()
    assert io.collective_writes()  # packed parts straddle boundaries: the aggregators merge them


def test_only_a_hint_that_asks_for_them_or_forbids_independent_io_makes_aligned_writes_collective():
    local = io_settings_for("/x", detected=("ext4", "/"), stripe=None)
    assert not local.collective_writes()
    for hints, collective in (({"romio_cb_write": "enable"}, True), ({"romio_no_indep_rw": True}, True),
                              ({"romio_cb_write": "disable"}, False), ({"cb_nodes": 4}, False)):
        io = io_settings_for("/x", io_hints=hints, detected=("ext4", "/"), stripe=None)
        assert io.collective_writes() is collective, hints
    lustre = io_settings_for("/x", io_hints={"romio_cb_write": "disable"}, detected=("lustre", "/lustre"),
                             stripe=1 << 20)
    assert not lustre.collective_writes()  # the user turned collective buffering off


def test_only_parts_written_alone_aligned_on_blocks_of_a_local_file_system_go_out_with_o_direct():
    def io(fstype="ext4", **kw):
        return io_settings_for("/x", direct=kw.pop("direct", True), detected=(fstype, "/"), stripe=None, **kw)

    assert not io(direct=False).direct_writes() and "O_DIRECT" not in io(direct=False).describe()  # the default
    assert io().direct_writes() and io("xfs").direct_writes()
    assert "parts written with O_DIRECT (checkpoint.direct_io)" in io("xfs").describe()
    for fstype in ("tmpfs", "nfs", "lustre", "gpfs", ""):  # no lock to dodge, or O_DIRECT less sure
        settings = io(fstype, io_hints={"romio_cb_write": "disable"})
        assert not settings.collective_writes() and not settings.direct_writes(), fstype
        assert "checkpoint.direct_io not used: O_DIRECT is for ext4 and XFS" in settings.describe()
    assert not io(io_hints={"romio_cb_write": "enable"}).direct_writes()  # the aggregators write
    assert not io(alignment=1).direct_writes()
    assert not io(alignment=6 << 10).direct_writes()
    assert io(alignment=8 << 10).direct_writes()


def test_parts_written_alone_on_a_local_file_system_are_mapped_unless_they_go_direct():
    def io(fstype="ext4", **kw):
        return io_settings_for("/x", detected=(fstype, "/"), stripe=None, **kw)

    assert io().mapped_writes() and io("xfs").mapped_writes()  # the default there
    assert "parts copied into a shared mapping of the file" in io().describe()
    assert not io(direct=True).mapped_writes() and io(direct=True).direct_writes()  # one way around the lock
    assert io(direct=True, alignment=6 << 10).mapped_writes()  # O_DIRECT cannot take it: mapped still
    for fstype in ("tmpfs", "nfs", "lustre", "gpfs", ""):  # no lock to dodge, or other nodes' clients
        assert not io(fstype).mapped_writes() and "mapping" not in io(fstype).describe(), fstype
    assert not io(io_hints={"romio_cb_write": "enable"}).mapped_writes()  # the aggregators write
    assert not io(alignment=1).mapped_writes()  # packed: collective calls
    assert not dataclasses.replace(io(), mapped=False).mapped_writes()  # the bench's buffered row


def test_an_unknown_file_system_is_said():
    assert "unknown file system" in IOSettings().describe()


def test_each_ranks_part_starts_on_the_boundary():
    align = 1 << 20
    for rows, cols, ranks in ((5_000_000, 1, 4), (1500, 1024, 2), (1500, 1024, 16), (100_000, 48, 7), (977, 3001, 5)):
        (pieces,) = fmt.plan_pieces([((rows, cols), 4)], ranks, alignment=align)
        assert pieces[0][1] == 0 and pieces[-1][2] == rows
        assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))  # contiguous, in order
        assert len({r for r, _, _ in pieces}) == len(pieces) <= ranks
        row = cols * 4
        if align // math.gcd(align, row) <= rows:
            assert all(start * row % align == 0 for _, start, _ in pieces), (rows, cols, ranks, pieces)
    # More ranks than aligned steps: fewer, larger parts, each on a rank of its own.
    (pieces,) = fmt.plan_pieces([(((3 << 20) // 4,), 4)], 16, alignment=align)  # 3 MiB of float32
    assert [(r, a, b) for r, a, b in pieces] == [(0, 0, 262144), (1, 262144, 524288), (2, 524288, 786432)]
    # Rows that never meet the boundary in reach: the equal split of before.
    (pieces,) = fmt.plan_pieces([((40, (1 << 18) + 1), 4)], 4, alignment=align)
    assert [(a, b) for _, a, b in pieces] == [(0, 10), (10, 20), (20, 30), (30, 40)]


def split_loads(specs, ranks, align):
    load = [0] * ranks
    for (shape, itemsize), pieces in zip(specs, fmt.plan_pieces(specs, ranks, alignment=align)):
        for rank, start, stop in pieces:
            load[rank] += (stop - start) * fmt.row_bytes(shape, itemsize)
    return load


def test_aligned_cuts_even_out_the_ranks_over_many_tensors():
    # 12 tensors of 4864 rows of 19 KiB (an MLP's weights and Adam moments, 1.1 GB): 1 MiB steps are 1024 rows,
    # so one tensor splits 2048 + 2816 at best. The larger part goes to the rank holding less: the ranks end
    # within a step of each other, not 42% / 58% as the larger part on rank 1 every time gave.
    specs = [((4864, 4864), 4)] * 12
    load = split_loads(specs, 2, 1 << 20)
    assert sum(load) == 12 * 4864 * 4864 * 4 and max(load) - min(load) <= 1024 * 4864 * 4, load
    # 16 ranks: each tensor has 4 steps (3 of 1024 rows, 1 of 1792), so 4 ranks take a part of it; the next
    # tensors' parts go to the ranks that hold the least (the same cuts from rank 0 on gave rank 0 5.9x the mean).
    specs = [((4864, 4864), 4)] * 48
    load = split_loads(specs, 16, 1 << 20)
    assert max(load) <= 1.06 * sum(load) / 16, load
    for (shape, _), pieces in zip(specs, fmt.plan_pieces(specs, 16, alignment=1 << 20)):
        assert all(start * shape[1] * 4 % (1 << 20) == 0 for _, start, _ in pieces)
        assert len({r for r, _, _ in pieces}) == len(pieces) == 4
    # Already uneven loads: the largest part goes to the least loaded rank.
    assert fmt.aligned_cuts(4864, 4864 * 4, 2, 1 << 20, load=[5, 0]) == [(0, 0, 2048), (1, 2048, 4864)]
    assert fmt.aligned_cuts(4864, 4864 * 4, 2, 1 << 20, load=[0, 5]) == [(1, 0, 2048), (0, 2048, 4864)]
    assert fmt.aligned_cuts(4864, 4864 * 4, 2, 1 << 20, load=[9, 5]) == [(0, 0, 2048), (1, 2048, 4864)]


def test_unaligned_plans_are_the_ones_of_before():
    specs = [((1000, 256), 4), ((262144,), 4), ((10,), 4), ((5_000_000,), 4)]
    assert fmt.plan_pieces(specs, 4) == fmt.plan_pieces(specs, 4, alignment=1)
    assert fmt.plan_pieces(specs, 4)[3] == [(0, 0, 1250000), (1, 1250000, 2500000), (2, 2500000, 3750000),
                                           (3, 3750000, 5000000)]


@pytest.mark.parametrize("override, message", [
    ({"alignment": -1}, "checkpoint.alignment"),
    ({"io_hints": {"striping_factor": [1, 2]}}, "checkpoint.io_hints.striping_factor"),
])
def test_bad_io_settings_are_refused_with_the_fix(override, message):
    cfg = TrainConfig()
    cfg.data.path = "data.h5"
    for key, value in override.items():
        setattr(cfg.checkpoint, key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value)
