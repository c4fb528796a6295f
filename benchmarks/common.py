"""Shared pieces of the benchmark scripts: world set-up, timing, JSON output.

Every script runs under ``mpirun -n N`` (one rank is fine), measures its baseline in the
same process as the thing it compares, and writes one JSON file from rank 0. Times of a
collective are the slowest rank's: a step is not over until every rank is done.
"""
import json
import os
import platform
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as `python benchmarks/x.py` from anywhere
    sys.path.insert(0, ROOT)

KIB, MIB, GIB = 2 ** 10, 2 ** 20, 2 ** 30


def init(threads=1):
    """The MPI world of this launch, with ``threads`` torch threads per rank. Call it before
    importing mpi4py's ``MPI``: MPI starts here, with hpctrain's settings, as in training."""
    import torch

    from hpctrain.runtime.world import init_world

    world = init_world(pin=False)
    torch.set_num_threads(threads)
    return world


def median(values):
    return statistics.median(values) if values else None


def timed(comm, fn, reps, warmup=1, barrier=True):
    """Run ``fn`` ``warmup + reps`` times; the slowest rank's seconds of each timed run."""
    times = []
    for i in range(warmup + reps):
        if barrier:
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        t = comm.allreduce(time.perf_counter() - t0, op=_max())
        if i >= warmup:
            times.append(t)
    return times


def _max():
    from mpi4py import MPI

    return MPI.MAX


def bus_bandwidth(nbytes, seconds, ranks):
    """(algbw, busbw) in bytes/s as nccl-tests define them for all-reduce."""
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks if ranks > 1 else algbw


def machine():
    """What the figures were measured on."""
    import mpi4py
    import numpy
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "mpi4py": mpi4py.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform(), "load_avg": os.getloadavg()}
    try:
        from mpi4py import MPI

        info["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # before MPI_Init or without a library string
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    try:
        import horovod

        info["horovod"] = horovod.__version__
    except Exception:
        pass
    try:
        import h5py

        info["h5py"] = h5py.__version__
        info["hdf5"] = h5py.version.hdf5_version
    except Exception:
        pass
    return info


def write_result(world, path, kind, params, results):
    """Rank 0 writes ``{"benchmark", "ranks", "params", "machine", "results"}`` to ``path``."""
    if world.rank != 0:
        return
    doc = {"benchmark": kind, "ranks": world.size, "params": params, "machine": machine(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def rss_bytes():
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Highest resident set size above the level at entry (or above ``base``, bytes), sampled
    every ``interval`` s in a thread (ru_maxrss is a lifetime peak, useless for one operation
    among many)."""

    def __init__(self, interval=0.002, base=None):
        self.interval = interval
        self.peak_extra = 0
        self._fixed_base = base

    def __enter__(self):
        self._base = rss_bytes() if self._fixed_base is None else self._fixed_base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak_extra = max(self.peak_extra, rss_bytes() - self._base)
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_extra = max(self.peak_extra, rss_bytes() - self._base)
        return False


def drop_file_cache(path):
    """Evict ``path`` (a file or every file under a directory) from the page cache, so a
    following read comes from the disk. Only this file's pages: others' caches stay."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
