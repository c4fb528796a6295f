"""Checkpoint I/O: hpctrain's collective HDF5 save/load vs torch.save/torch.load vs raw
numpy tofile, on the same state, in the same run; peak memory while saving; the training
stall of a synchronous vs an asynchronous save.

    mpirun -n 2 python benchmarks/checkpoint_io.py --gib 1.0 --dir /tmp/ckpt-bench

Prints one table (rank 0) and writes DIR/results.json. Times include fsync (of the file
and, for hpctrain, of the directory) but not a cold page cache: reads right after writes
are served from memory, as they would be on a node that just wrote. On a shared machine,
repeat and quote ratios rather than absolute numbers.
"""
import argparse
import json
import os
import shutil
import sys
import threading
import time

import numpy as np
import psutil
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpctrain.checkpoint import CheckpointManager, load_checkpoint  # noqa: E402
from hpctrain.config import CheckpointConfig  # noqa: E402
from hpctrain.state import Progress, TrainState  # noqa: E402
from hpctrain.world import init_world  # noqa: E402

MIB = 1 << 20


class Big(nn.Module):
    def __init__(self, gib, tensors=8):
        super().__init__()
        rows = int(gib * (1 << 30) / 4 / tensors / 4096)
        self.layers = nn.ParameterList([nn.Parameter(torch.empty(rows, 4096)) for _ in range(tensors)])
        for i, p in enumerate(self.layers):
            p.data.fill_(float(i) + 0.5)


class PeakRSS:
    """Samples this process's resident memory every few milliseconds."""

    def __init__(self):
        self.proc = psutil.Process()
        self.peak = self.base = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def delta(self):
        return self.peak - self.base


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def timed(fn, comm=None):
    if comm is not None:
        comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    if comm is not None:
        comm.Barrier()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/hpctrain-ckpt-bench")
    args = ap.parse_args()
    world = init_world(pin=False, check=False)
    comm, root = world.comm, world.is_root
    if root:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    comm.Barrier()

    model = Big(args.gib)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), Progress(step=1))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res = {"state_bytes": nbytes, "ranks": world.size}

    def cfg(**kw):
        return CheckpointConfig(keep_last=1, on_epoch_end=False, on_finish=False, **kw)

    # hpctrain, all ranks, verify on (the default) and off
    for verify in (True, False):
        mgr = CheckpointManager(os.path.join(args.dir, f"h5-verify{int(verify)}"), world, cfg(verify=verify))
        with PeakRSS() as mem:
            t, path = timed(lambda: mgr.save(state), comm)
        mgr.close()
        res[f"hpctrain_save_verify{int(verify)}_s"] = t
        res[f"hpctrain_save_verify{int(verify)}_peak_rss_delta"] = comm.allreduce(mem.delta, op=max_op())
    fresh = TrainState(Big(args.gib, 8), None, Progress())
    for p in fresh.model.parameters():
        p.data.zero_()  # so that the check below means something
    t, _ = timed(lambda: load_checkpoint(path, fresh, comm), comm)
    res["hpctrain_load_s"] = t
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), model.parameters()))
    del fresh

    # the training stall: synchronous vs asynchronous save
    state.progress.step = 2
    mgr = CheckpointManager(os.path.join(args.dir, "sync"), world, cfg())
    res["stall_sync_s"], _ = timed(lambda: mgr.save(state), comm)
    mgr.close()
    # stand-in training steps: small torch ops from Python, as a training loop makes them
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def steps(n=200):
        for _ in range(n):
            torch.mm(a, b).sum()

    res["steps_alone_s"], _ = timed(steps, comm)
    mgr = CheckpointManager(os.path.join(args.dir, "async"), world, cfg(async_save=True))
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res["stall_async_s"], _ = timed(lambda: mgr.save(state), comm)
        res["steps_during_async_s"], _ = timed(steps, comm)
        mgr.close()
        comm.Barrier()
        res["async_background_s"] = time.perf_counter() - t0 - res["stall_async_s"]
    res["async_peak_rss_delta"] = comm.allreduce(mem.delta, op=max_op())
    mgr = CheckpointManager(os.path.join(args.dir, "async2"), world, cfg(async_save=True, consistency="off"))
    res["stall_async_no_consistency_s"], _ = timed(lambda: mgr.save(state), comm)
    mgr.close()

    # one process: torch.save + fsync / torch.load; numpy tofile + fsync / fromfile
    if root:
        sd = model.state_dict()
        pt = os.path.join(args.dir, "state.pt")
        with PeakRSS() as mem:
            res["torch_save_s"], _ = timed(lambda: (torch.save(sd, pt), fsync_file(pt)))
        res["torch_save_peak_rss_delta"] = mem.delta
        res["torch_load_s"], _ = timed(lambda: torch.load(pt))
        raw = os.path.join(args.dir, "state.bin")

        def tofile():
            with open(raw, "wb") as f:
                for t in sd.values():
                    t.numpy().tofile(f)
                f.flush()
                os.fsync(f.fileno())

        res["numpy_tofile_s"], _ = timed(tofile)
        res["numpy_fromfile_s"], _ = timed(lambda: np.fromfile(raw, dtype=np.float32))
        res["hpctrain_file_bytes"] = os.path.getsize(path)
        gib = nbytes / (1 << 30)
        print(f"state: {gib:.2f} GiB in {len(sd)} tensors; hpctrain on {world.size} ranks, the rest on 1")
        rows = [("hpctrain save (verify on)", "hpctrain_save_verify1_s"),
                ("hpctrain save (verify off)", "hpctrain_save_verify0_s"),
                ("hpctrain load (verified)", "hpctrain_load_s"),
                ("torch.save + fsync", "torch_save_s"), ("torch.load", "torch_load_s"),
                ("numpy tofile + fsync", "numpy_tofile_s"), ("numpy fromfile", "numpy_fromfile_s"),
                ("stall: sync save", "stall_sync_s"), ("stall: async save", "stall_async_s"),
                ("stall: async, consistency off", "stall_async_no_consistency_s"),
                ("async save until durable", "async_background_s")]
        for label, key in rows:
            print(f"  {label:32} {res[key]:7.2f} s  {gib / res[key]:6.2f} GiB/s")
        print(f"  200 stand-in steps: {res['steps_alone_s']:.2f} s alone, "
              f"{res['steps_during_async_s']:.2f} s while the background save writes")
        for label, key in [("hpctrain save, verify on", "hpctrain_save_verify1_peak_rss_delta"),
                           ("hpctrain save, verify off", "hpctrain_save_verify0_peak_rss_delta"),
                           ("hpctrain async save", "async_peak_rss_delta"),
                           ("torch.save", "torch_save_peak_rss_delta")]:
            print(f"  peak RSS growth, {label:26} {res[key] / MIB:8.0f} MiB "
                  f"({res[key] / nbytes:.2f}x the state)")
        with open(os.path.join(args.dir, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
    comm.Barrier()
    if root:
        for name in os.listdir(args.dir):
            if name != "results.json":
                p = os.path.join(args.dir, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def max_op():
    from mpi4py import MPI

    return MPI.MAX


if __name__ == "__main__":
    main()
