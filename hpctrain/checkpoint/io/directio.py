"""Writing a rank's aligned parts of a shared checkpoint file straight to the disk (``O_DIRECT``), where
``checkpoint.direct_io`` asks for it and each rank writes its own parts alone
(:meth:`~.iosettings.IOSettings.direct_writes`), and reading them back the same way for the checksums that
verify the file.

On a local file system (ext4, XFS) buffered writes into one file take its inode lock in turn: two ranks writing
their parts of the same file wait for each other while each copies its part into the page cache. Direct
writes of whole blocks from an aligned buffer skip the page cache and the lock's long hold, and the ranks'
writes reach the disk side by side; but the re-read then comes from the disk, not from memory, which is why it
is an option (docs/performance.md, "Direct writes"). The file is still opened and laid
out by parallel HDF5; this module only writes and re-reads the bytes of datasets whose place in the file HDF5
has given. The re-read goes direct too: through the page cache it would cost the page allocations the direct
writes saved."""
import errno
import mmap
import os

from ...runtime.fsutil import pwrite_all

BLOCK = 4096  # the logical block size O_DIRECT wants offsets, lengths and buffers aligned on, on these disks
MIN_CHUNK = 1 << 20
MAX_CHUNK = 16 << 20  # larger writes were no faster; the bounce buffer stays small


class _DirectFile:
    """An ``O_DIRECT`` descriptor of a file and a plain one, and the aligned buffer the direct calls use."""

    def __init__(self, direct_fd, plain_fd, chunk_bytes):
        self._direct, self._plain = direct_fd, plain_fd
        self._buffer, self._view = _aligned_buffer(chunk_bytes)
        self.direct_bytes = 0  # what went through O_DIRECT (the rest through the page cache)

    def _refused(self, exc):
        """After an OSError of a direct call: True (plain calls from here on) if it refused direct I/O."""
        if exc.errno != errno.EINVAL:
            return False
        os.close(self._direct)  # this file system takes O_DIRECT at open but not these calls
        self._direct = None
        return True

    def close(self):
        for fd in (self._direct, self._plain):
            if fd is not None:
                os.close(fd)
        self._direct = self._plain = None
        self._view.release()
        self._buffer.close()


class DirectWriter(_DirectFile):
    """One rank's writes into ``path``: whole blocks through an ``O_DIRECT`` descriptor from a reused
    page-aligned buffer (``chunk_bytes`` a call), the ragged bytes before the first and after the last whole
    block through a plain one. :func:`open_direct` makes one, or returns None where the file system refuses
    direct I/O."""

    def write(self, offset, data):
        """Write ``data`` (bytes-like, C-contiguous) at file ``offset``; an OSError as a plain write raises it."""
        data = memoryview(data).cast("B")
        end = offset + len(data)
        first, last = -(-offset // BLOCK) * BLOCK, end // BLOCK * BLOCK
        if last <= first or self._direct is None:  # no whole block inside, or direct writes refused before
            self._plain_write(offset, data)
            return
        self._plain_write(offset, data[:first - offset])
        pos = first
        while pos < last:
            n = min(len(self._buffer), last - pos)
            chunk = data[pos - offset:pos - offset + n]
            self._view[:n] = chunk
            if not self._direct_write(pos, n, chunk):
                self._plain_write(pos, data[pos - offset:last - offset])
                break
            pos += n
        self._plain_write(last, data[last - offset:])

    def _direct_write(self, offset, n, same_bytes):
        """The buffer's first ``n`` bytes at ``offset``; False if the descriptor refuses direct I/O here."""
        try:
            done = os.pwrite(self._direct, self._view[:n], offset)
        except OSError as exc:
            if self._refused(exc):
                return False
            raise
        if done < n:  # a short direct write (rare: a signal, a full disk): the rest as a plain write
            self._plain_write(offset + done, same_bytes[done:])
        self.direct_bytes += done
        return True

    def _plain_write(self, offset, data):
        pwrite_all(self._plain, data, offset)


class DirectReader(_DirectFile):
    """CRC-32s of byte ranges of ``path``, read through an ``O_DIRECT`` descriptor into a reused page-aligned
    buffer (``chunk_bytes`` a call), or through a plain one once the direct one refuses a read.
    :func:`open_direct_reader` makes one."""

    def crc(self, offset, nbytes, crc32, value=0):
        """``value`` continued over the ``nbytes`` bytes at ``offset`` with ``crc32(data, value)`` (zlib's
        signature). A file that ends before them raises OSError."""
        pos, end = offset, offset + nbytes
        while pos < end:
            start = pos // BLOCK * BLOCK  # whole blocks from an aligned offset; the bytes around are not used
            n = min(len(self._buffer), -(-(end - start) // BLOCK) * BLOCK)
            got = self._read(start, n)
            if start + got <= pos:
                raise OSError(errno.EIO, f"the file ends at byte {start + got}, before byte {end} of a dataset")
            take = min(end, start + got) - pos
            value = crc32(self._view[pos - start:pos - start + take], value)
            pos += take
        return value

    def _read(self, offset, n):
        if self._direct is not None:
            try:
                got = os.preadv(self._direct, [self._view[:n]], offset)
                self.direct_bytes += got
                return got
            except OSError as exc:
                if not self._refused(exc):
                    raise
        return os.preadv(self._plain, [self._view[:n]], offset)


def _aligned_buffer(chunk_bytes):
    """A page-aligned buffer (anonymous maps are, as O_DIRECT needs) of whole blocks, and its view."""
    size = max(MIN_CHUNK, min(MAX_CHUNK, chunk_bytes)) // BLOCK * BLOCK
    buffer = mmap.mmap(-1, size)
    return buffer, memoryview(buffer)


def _open_pair(path, mode):
    """``(direct fd, plain fd)`` of ``path`` opened with ``mode``, or None where ``O_DIRECT`` is refused."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        direct = os.open(path, mode | flag)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    try:
        return direct, os.open(path, mode)
    except OSError:
        os.close(direct)
        raise


def open_direct(path, chunk_bytes):
    """A :class:`DirectWriter` for the existing file ``path``, or None where it cannot be opened with
    ``O_DIRECT`` (tmpfs, some network file systems, a platform without it): the caller then writes through
    HDF5 as before. Any other OSError (the file gone, no permission) is raised."""
    fds = _open_pair(path, os.O_WRONLY)
    return DirectWriter(*fds, chunk_bytes) if fds else None


def open_direct_reader(path, chunk_bytes):
    """A :class:`DirectReader` of ``path``, or None where it cannot be opened with ``O_DIRECT``; other
    OSErrors are raised."""
    fds = _open_pair(path, os.O_RDONLY)
    return DirectReader(*fds, chunk_bytes) if fds else None
