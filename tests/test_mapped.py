"""Mapped writes of a rank's parts into a checkpoint file (hpctrain/checkpoint/io/mapped.py), on this machine's disk:
every byte lands where it is written whatever its offset, length and window, each range is allocated before it
is mapped, a full disk is an OSError (never a SIGBUS), a file system that cannot allocate ahead gets
plain writes, and an end beyond the file's size extends it. tests/test_io_pattern.py checks a real save's
calls under strace."""
import errno
import os

import numpy as np
import pytest

from hpctrain.checkpoint.io import mapped
from hpctrain.checkpoint.io.mapped import PAGE, open_mapped
from part_writes import MiB, target, writes  # noqa: F401 (target: a fixture)


def recorded(monkeypatch, name):
    """Calls of ``mapped.os.<name>`` recorded as ``(offset, length)``, still made."""
    real, calls = getattr(os, name), []

    def record(fd, *args):
        calls.append(args[-2:] if name == "posix_fallocate" else (args[-1], len(args[0])))
        return real(fd, *args)

    monkeypatch.setattr(mapped.os, name, record)
    return calls


def test_every_byte_lands_in_place_through_windows_allocated_first(target, monkeypatch):
    allocated, plain = recorded(monkeypatch, "posix_fallocate"), recorded(monkeypatch, "pwrite")
    writer = open_mapped(str(target), 2 * MiB)
    # page-aligned and not, shorter than a page, across several windows, and past the file's end
    spans = [(0, PAGE), (5, 10), (4000, 9000), (MiB, 7 * MiB), (123457, 9 * MiB + 77), (38 * MiB, 3 * MiB + 1)]
    try:
        expected = writes(writer, target, spans)
        assert writer.mapped_bytes == sum(n for _, n in spans)
    finally:
        writer.close()
    assert target.read_bytes() == expected
    assert allocated == spans and plain == []  # each range allocated once, before any byte of it is mapped


def test_a_full_disk_is_an_oserror_and_maps_nothing(target, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    before = target.read_bytes()
    writer = open_mapped(str(target), MiB)
    try:
        with pytest.raises(OSError) as raised:
            writer.write(MiB, np.ones(3 * MiB, dtype=np.uint8))
        assert raised.value.errno == errno.ENOSPC and writer.mapped_bytes == 0
    finally:
        writer.close()
    assert target.read_bytes() == before


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS])
def test_a_file_system_that_cannot_allocate_ahead_gets_plain_writes(target, monkeypatch, code):
    asked = []

    def unsupported(fd, offset, length):
        asked.append(offset)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(mapped.os, "posix_fallocate", unsupported)
    writer = open_mapped(str(target), MiB)
    try:
        expected = writes(writer, target, [(MiB, 5 * MiB), (8 * MiB + 3, 2 * MiB)])
        assert writer.mapped_bytes == 0 and len(asked) == 1  # asked once, then plain writes without asking
    finally:
        writer.close()
    assert target.read_bytes() == expected


def test_the_window_is_bounded_whatever_the_call_size(target):
    assert open_mapped(str(target), 1).close() is None  # opens and closes
    for asked, window in [(1, mapped.MIN_WINDOW), (4 * MiB, 4 * MiB), (512 * MiB, mapped.MAX_WINDOW)]:
        writer = open_mapped(str(target), asked)
        try:
            assert writer._window == window and window % PAGE == 0
        finally:
            writer.close()
