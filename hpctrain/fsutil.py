"""Durable file updates, written once for every file hpctrain replaces in place
(checkpoints, ``latest``, the run lock, generated data sets).

The order is what makes a file survive a crash: write a temp file, fsync it, rename it over
the old name (atomic on POSIX), fsync the directory so that the rename itself is on disk.
"""
import contextlib
import logging
import os
import secrets

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
    """Write ``path`` all or nothing, by name: yields the temp path to create; on success it
    is fsynced and renamed over ``path``, on an exception it is removed and ``path`` is
    untouched.

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
