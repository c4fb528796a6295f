"""The C library's allocator, tuned for training when asked for, and during a checkpoint load. glibc's
``malloc`` serves a block larger than its mmap threshold (128 KiB, rising to at most 32 MiB as blocks are
freed) with a fresh ``mmap`` and unmaps it when freed, and it returns the top of its heap to the system beyond
the trim threshold. A training step allocates and frees the same large temporaries every step (gradients, an
optimizer's intermediate tensors), so each step faults those pages in again and zeroes them. Measured on a
25M-parameter MLP, 2 ranks, one thread each: AdamW over one 12.7M-element slice took 89-95 ms a step with
glibc's defaults and 35 ms with the thresholds below (replicated: 68-78 ms against 60 ms), the whole step
296-301 against 272 ms replicated.

Freed memory then stays with the process for reuse instead of going back to the system, and blocks of many
sizes can fragment the kept heap; at one model size the peaks measured within about 40 MiB of glibc's
defaults, but long runs have not been measured (docs/performance.md). So this is asked for, not the default:
``HPCTRAIN_MALLOC=reuse`` sets the thresholds, unless the user set glibc's own (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``) or preloads jemalloc/tcmalloc/mimalloc (``LD_PRELOAD``)."""
import contextlib
import os
import platform

from .. import settings
from .system import libc

MMAP_THRESHOLD = 256 << 20  # blocks up to this size come from the heap, and are reused
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before returning it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_done = None


def why_not(environ=None, malloc=None):
    """Why the allocator is left as it is (a sentence), or None to tune it (pure but for ``platform``).
    ``malloc``: what ``HPCTRAIN_MALLOC`` says (default: read it)."""
    env = os.environ if environ is None else environ
    if (settings.get("MALLOC", "", environ=env) if malloc is None else malloc) != "reuse":
        return "glibc's defaults; HPCTRAIN_MALLOC=reuse keeps large blocks for reuse: faster, more memory"
    own = [k for k in _USERS_OWN if k in env]
    if own:
        return f"{own[0]} is set"
    other = [a for a in _OTHER_ALLOCATORS if a in env.get("LD_PRELOAD", "")]
    if other:
        return f"{other[0]} is preloaded"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    return None


def _keep_large_blocks(libc):
    """Raise glibc's mmap and trim thresholds; True if glibc took both."""
    return libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def tune(environ=None):
    """Set glibc's thresholds once per process, unless :func:`why_not`; returns what was
    done, as a phrase for the run's first lines."""
    global _done
    if _done is not None:
        return _done
    reason = why_not(environ)
    if reason is None and not _keep_large_blocks(libc()):
        reason = "mallopt refused"
    _done = (f"malloc keeps blocks up to {MMAP_THRESHOLD >> 20} MiB for reuse (HPCTRAIN_MALLOC=reuse)"
             if reason is None else f"malloc as it is ({reason})")
    return _done


@contextlib.contextmanager
def reusing_large_blocks(environ=None):
    """Within: large blocks freed are kept for reuse (as with ``HPCTRAIN_MALLOC=reuse``); after: glibc's
    steady-state thresholds again (a 32 MiB mmap threshold, the most its own dynamic rule reaches, and twice
    that for trimming) and the free pages go back to the system. For a phase that allocates and frees many
    large buffers once, such as loading a checkpoint (measured: 1.78-2.41 s cold and 1.97-2.03 s warm for
    1.07 GiB on 2 ranks without it, 0.50-0.51 s and 0.27-0.31 s with it)."""
    env = os.environ if environ is None else environ
    own = _done is not None and _done.startswith("malloc keeps")  # already reusing: nothing to undo
    reason = why_not(env, malloc="reuse")
    if own or reason is not None:
        yield
        return
    c = libc()
    _keep_large_blocks(c)
    try:
        yield
    finally:
        c.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        c.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        c.malloc_trim(0)

