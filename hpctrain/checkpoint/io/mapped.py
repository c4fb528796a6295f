"""Writing a rank's parts of a shared checkpoint file by copying them into a shared mapping of the file, where
each rank writes its own parts alone on a local file system (:meth:`~.iosettings.IOSettings.mapped_writes`).

On ext4 and XFS a buffered ``write`` holds the file's inode lock while it copies into the page cache, so the
ranks of a node writing their parts of one file take turns; in a fresh process every copied page is also a page
the kernel must find first, and that too happens under the lock. A page fault in a shared mapping does not take
that lock: the ranks fill their parts side by side, as they would files of their own (docs/performance.md,
"Mapped writes"). The pages are the page cache's, so the fsync and the verification's re-read see them as after
a ``write``.

A write into a mapping cannot report a full disk or an exceeded quota; the kernel sends SIGBUS instead. So every
range is first allocated with ``fallocate``, which reports ENOSPC and EDQUOT as errors; where the file system
cannot allocate ahead, the writer writes plainly (``pwrite``) from then on. The mapping is made a window at a
time, so a rank's resident memory grows by one window, not by its parts."""
import errno
import mmap
import os

import numpy as np

from ...runtime.fsutil import pwrite_all

PAGE = mmap.ALLOCATIONGRANULARITY  # mapping offsets must be multiples of it
MIN_WINDOW = 1 << 20
MAX_WINDOW = 16 << 20  # as the direct writes' buffer: the resident mapped pages stay few (a munmap each)
# fallocate's refusals that mean "cannot allocate ahead here", not a failure of the disk
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class MappedWriter:
    """One rank's writes into a file open for reading and writing (``fd``, closed by :meth:`close`): each range
    allocated, then copied into a shared mapping of it, ``window_bytes`` at a time (:func:`open_mapped`)."""

    def __init__(self, fd, window_bytes):
        self._fd = fd
        self._window = max(MIN_WINDOW, min(MAX_WINDOW, window_bytes)) // PAGE * PAGE
        self._mapping = True  # False once the file system cannot allocate ahead: pwrite from then on
        self.mapped_bytes = 0  # what went through the mapping (the rest through pwrite)

    def write(self, offset, data):
        """Write ``data`` (bytes-like, C-contiguous) at file ``offset``. An OSError (ENOSPC from the allocation,
        EIO) is raised as a write would raise it."""
        data = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if not len(data):
            return
        if self._mapping:
            self._mapping = _allocate(self._fd, offset, len(data))
        if not self._mapping:  # a write into a mapping of unallocated blocks could end in SIGBUS
            pwrite_all(self._fd, data, offset)
            return
        pos, end = offset, offset + len(data)
        while pos < end:
            start = pos // PAGE * PAGE
            n = min(end, start + self._window) - start
            with mmap.mmap(self._fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start) as m:
                window = np.frombuffer(m, dtype=np.uint8)
                window[pos - start:] = data[pos - offset:start + n - offset]
                del window  # the mapping closes only when no view of it is left
            self.mapped_bytes += start + n - pos
            pos = start + n

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None


def _allocate(fd, offset, nbytes):
    """Allocate ``[offset, offset + nbytes)`` of ``fd`` on the disk; False where the file system cannot (only
    ext4 and XFS map, and both can: glibc's slow emulation of posix_fallocate does not happen there)."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def open_mapped(path, window_bytes):
    """A :class:`MappedWriter` for the existing file ``path``; an OSError (the file gone, no permission) is
    raised."""
    return MappedWriter(os.open(path, os.O_RDWR), window_bytes)
