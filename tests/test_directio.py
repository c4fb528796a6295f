"""Direct writes of a rank's part into a checkpoint file (hpctrain/checkpoint/io/directio.py), on this machine's
disk: every byte lands where it is written whatever its offset and length, whole blocks go through O_DIRECT and
the ragged ends do not, a direct re-read checksums any range as zlib does, and a descriptor that refuses a
direct call hands the rest to plain ones.
tests/test_io_pattern.py checks a real save's writes under strace."""
import errno
import os

import numpy as np
import pytest

from hpctrain.checkpoint.io import directio
from hpctrain.checkpoint.io.directio import BLOCK, open_direct
from part_writes import MiB, target, writes  # noqa: F401 (target: a fixture)


def refuse_direct(monkeypatch, call, direct_fd):
    """``os.<call>`` on ``direct_fd`` fails with EINVAL, as on a file system that takes O_DIRECT at open but
    not the calls; the offsets refused."""
    real, refused = getattr(os, call), []

    def refusing(fd, data, offset):
        if fd == direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(directio.os, call, refusing)
    return refused


def test_every_byte_lands_in_place_and_only_whole_blocks_go_direct(target):
    writer = open_direct(str(target), 3 * MiB)
    if writer is None:
        pytest.fail(f"{target}'s file system refused O_DIRECT; this disk is expected to take it")
    spans = [(0, BLOCK), (5, 10), (4000, 9000), (MiB, 7 * MiB), (123457, 9 * MiB + 77), (30 * MiB, 3 * MiB + 1)]
    try:
        expected = writes(writer, target, spans)
        direct = writer.direct_bytes
    finally:
        writer.close()
    assert target.read_bytes() == expected
    whole = sum(max(0, (o + n) // BLOCK * BLOCK - -(-o // BLOCK) * BLOCK) for o, n in spans)
    assert direct == whole  # the ragged bytes at each end went through the page cache


def test_a_refused_direct_write_falls_back_to_plain_writes(target, monkeypatch):
    writer = open_direct(str(target), MiB)
    refused = refuse_direct(monkeypatch, "pwrite", writer._direct)
    try:
        expected = writes(writer, target, [(MiB, 5 * MiB), (8 * MiB, 2 * MiB)])
        assert writer.direct_bytes == 0 and len(refused) == 1  # asked once, then not again
    finally:
        writer.close()
    assert target.read_bytes() == expected


def test_a_file_system_that_refuses_o_direct_gets_none(target, monkeypatch):
    def refuse(path, flags, *args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(directio.os, "open", refuse)
    assert open_direct(str(target), MiB) is None


def test_a_full_disk_is_an_error_not_a_fallback(target, monkeypatch):
    writer = open_direct(str(target), MiB)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio.os, "pwrite", full)
    try:
        with pytest.raises(OSError, match="No space"):
            writer.write(MiB, np.zeros(2 * MiB, dtype=np.uint8))
    finally:
        monkeypatch.undo()
        writer.close()


def test_a_direct_reader_checksums_any_range_as_zlib_does(target):
    import zlib

    rng = np.random.default_rng(1)
    target.write_bytes(rng.integers(0, 256, 20 * MiB + 123, dtype=np.uint8).tobytes())
    data = target.read_bytes()
    reader = directio.open_direct_reader(str(target), MiB)
    try:
        for offset, n in [(0, 0), (0, BLOCK), (5, 10), (4000, 9000), (MiB, 7 * MiB), (123457, 3 * MiB + 77),
                          (20 * MiB, 123), (len(data) - 1, 1)]:
            assert reader.crc(offset, n, zlib.crc32) == zlib.crc32(data[offset:offset + n]), (offset, n)
        assert reader.crc(MiB, MiB, zlib.crc32, zlib.crc32(data[:MiB])) == zlib.crc32(data[:2 * MiB])
        assert reader.direct_bytes > 0
        with pytest.raises(OSError, match="the file ends"):
            reader.crc(len(data) - 10, 20, zlib.crc32)
    finally:
        reader.close()


def test_a_refused_direct_read_falls_back_to_plain_reads(target, monkeypatch):
    import zlib

    reader = directio.open_direct_reader(str(target), MiB)
    refused = refuse_direct(monkeypatch, "preadv", reader._direct)
    try:
        assert reader.crc(3, 5 * MiB, zlib.crc32) == zlib.crc32(target.read_bytes()[3:3 + 5 * MiB])
        assert reader.direct_bytes == 0 and len(refused) == 1
    finally:
        reader.close()
