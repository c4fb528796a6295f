"""What this process may use of its node: the CPUs it is bound to, the C library. Looked up in one place,
once, for the modules that tune around them (torch's threads, the checkpoint writer's core, glibc's allocator,
early write-back of checkpoint files)."""
import ctypes
import ctypes.util
import functools
import os


def proc_state(pid):
    """(state letter, start time in clock ticks since boot) of process ``pid`` from /proc, or (None, None)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None, None


def usable_cpus():
    """The CPUs this process may run on: its affinity set where the system has one (Linux:
    what mpirun's or srun's binding left it), else the node's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def libc():
    """The C library, loaded once (``errno`` kept for calls that set it); ``OSError`` where it cannot be."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
