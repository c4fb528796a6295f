"""Durable file updates, written once for every file hpctrain replaces in place (checkpoints, ``latest``, the
run lock, generated data sets). The order is what makes a file survive a crash: write a temp file, fsync it,
rename it over the old name (atomic on POSIX), fsync the directory so that the rename itself is on disk."""
import contextlib
import functools
import logging
import os
import secrets
import threading

log = logging.getLogger("hpctrain")

TMP_MARK = ".tmp-"


def temp_name(path, token=None):
    """``<path>.tmp-<token>``: next to ``path`` (so the rename stays on one file system)."""
    return f"{path}{TMP_MARK}{token or f'{os.getpid()}-{secrets.token_hex(3)}'}"


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages back; do not wait


@functools.lru_cache(maxsize=None)
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None; looked up once."""
    import ctypes

    from .system import libc

    try:
        call = libc().sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


def early_writeback(path, interval=0.02):
    """Start writing ``path``'s dirty pages to the disk while the file is still being written: a thread asks
    the kernel (``sync_file_range``) every ``interval`` seconds, from the moment the file exists, so the fsync
    that follows waits for the tail, not the whole file. Returns ``stop()``. Does nothing where the call is
    missing (not Linux); its errors are ignored: the fsync reports any that matter."""
    call = _sync_file_range()
    if call is None:
        return lambda: None
    done = threading.Event()

    def run():
        fd = None
        try:
            while not done.wait(interval):
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError:
                        continue  # not created yet
                call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        finally:
            if fd is not None:
                os.close(fd)

    thread = threading.Thread(target=run, name="hpctrain-writeback", daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()

    return stop


def pwrite_all(fd, data, offset):
    """Every byte of ``data`` (bytes-like) at ``offset`` of ``fd``: one ``pwrite`` may write fewer."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        offset, view = offset + done, view[done:]


def durable_rename(tmp, final):
    """fsync the data, rename into place, fsync the directory entry."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)), directory=True)


def remove_quietly(path):
    """Remove ``path`` if it exists; True if it is gone (a failure is logged, not raised)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
        return False
    return True


@contextlib.contextmanager
def replaced(path):
    """Write ``path`` all or nothing, by name: yields the temp path to create; on success it is fsynced and
    renamed over ``path``, on an exception it is removed and ``path`` is untouched.

    >>> with replaced("data/digits.h5") as tmp:    # doctest: +SKIP
    ...     h5py.File(tmp, "w").close()
    """
    tmp = temp_name(path)
    try:
        yield tmp
        durable_rename(tmp, path)
    finally:
        remove_quietly(tmp)


def write_text(path, text):
    """Replace the text file ``path`` atomically and durably."""
    with replaced(path) as tmp, open(tmp, "w") as f:
        f.write(text)  # closed before the rename, which fsyncs it
