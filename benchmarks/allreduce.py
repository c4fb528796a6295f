"""All-reduce bandwidth: hpctrain's gradient synchronisation against one fused Allreduce.

    mpirun -n 2 python benchmarks/allreduce.py --backend mpi --out bench-results/x/allreduce-mpi-2.json

For each total size, ``--tensors`` gradient tensors of equal size are averaged over ranks
through ``backend.synchronize(optimizer)``, the call the trainer makes after the backward
pass (Horovod then all-reduces every gradient whose hook has not fired, i.e. all of them,
fused by its background thread; the mpi backend copies them into fused buffers). The
baseline, timed in the same process and interleaved with it, is one mpi4py ``Allreduce``
of a single float32 buffer of the same bytes. Horovod's launch also times one tensor of all
the bytes (``horovod_one_tensor``) and one of 4 bytes (``horovod_floor``: what any Horovod
all-reduce costs, whatever its size).

Bandwidth as nccl-tests define it: algbw = bytes / time, busbw = algbw * 2(n-1)/n, with
the bytes that travel: half of them under fp16 compression.
"""
import argparse

from common import KIB, MIB, bus_bandwidth, init, median, timed, write_result

SIZES = [256 * KIB * 4 ** i for i in range(6)]  # 256 KiB .. 256 MiB


def reps_for(nbytes, scale):
    """More repetitions for small sizes, where one run is short and noisy."""
    reps = 20 if nbytes <= 4 * MIB else 10 if nbytes <= 16 * MIB else 5
    return max(2, int(reps * scale))


def make_gradients(nbytes, tensors, tag):
    """A module holding ``tensors`` float32 parameters of ``nbytes`` in all, with gradients."""
    import torch

    numel = nbytes // 4
    module = torch.nn.Module()
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n, generator=gen)
        # Distinct names per size: Horovod caches responses by tensor name.
        module.register_parameter(f"{tag}_{i}", p)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("mpi", "horovod"), required=True)
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="total bytes")
    parser.add_argument("--tensors", type=int, default=16, help="gradient tensors per size")
    parser.add_argument("--reps-scale", type=float, default=1.0)
    parser.add_argument("--horovod-cycle-ms", type=float, default=None,
                        help="HOROVOD_CYCLE_TIME for this launch (Horovod's default: 1 ms): how long its "
                             "background thread waits between rounds of collecting ready tensors")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.horovod_cycle_ms is not None:
        import os

        os.environ["HOROVOD_CYCLE_TIME"] = str(args.horovod_cycle_ms)  # read when Horovod starts, below

    import numpy as np
    import torch

    from hpctrain.backends import get_backend

    world = init()  # first: hpctrain's MPI settings apply only before MPI starts
    from mpi4py import MPI

    comm = world.comm
    backends = {c: get_backend(args.backend, world, compression=c) for c in ("none", "fp16")}
    rows = []
    for nbytes in args.sizes:
        reps = reps_for(nbytes, args.reps_scale)
        fused = np.ones(nbytes // 4, dtype=np.float32)
        paths = {"fused_allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)}
        for compression, backend in backends.items():
            module = make_gradients(nbytes, args.tensors, f"s{nbytes}{compression}")
            opt = backend.distributed_optimizer(torch.optim.SGD(module.parameters(), lr=0.0), module)
            paths[f"{args.backend}_{compression}"] = (lambda b=backend, o=opt: b.synchronize(o))
        if args.backend == "horovod":
            # What the 16 tensors cost is made of: Horovod's cost per call whatever the size (its
            # background thread's cycle, the negotiation among ranks, the hand-offs between
            # threads), seen on one 4-byte tensor; and one tensor already holding all the bytes.
            hvd = backends["none"].hvd
            one, tiny = torch.ones(nbytes // 4), torch.ones(1)
            paths["horovod_one_tensor"] = lambda: hvd.allreduce_(one, op=hvd.Average, name=f"one{nbytes}")
            paths["horovod_floor"] = lambda: hvd.allreduce_(tiny, op=hvd.Average, name=f"floor{nbytes}")
        times = {name: [] for name in paths}
        # Interleaved, so that a burst of load from elsewhere hits every path alike.
        for name, fn in paths.items():
            timed(comm, fn, reps=0, warmup=2)
        for _ in range(reps):
            for name, fn in paths.items():
                times[name] += timed(comm, fn, reps=1, warmup=0)
        base = median(times["fused_allreduce"])
        for name, ts in times.items():
            t = median(ts)
            wire = 4 if name == "horovod_floor" else nbytes // 2 if name.endswith("fp16") else nbytes
            algbw, busbw = bus_bandwidth(wire, t, world.size)
            rows.append({"path": name, "bytes": nbytes, "wire_bytes": wire, "tensors": args.tensors,
                         "reps": reps, "median_s": t, "min_s": min(ts), "algbw_gbs": algbw / 1e9,
                         "busbw_gbs": busbw / 1e9, "ratio_to_fused": t / base})
        if world.rank == 0:
            line = "  ".join(f"{r['path']} {1e3 * r['median_s']:.2f} ms" for r in rows[-len(paths):])
            print(f"allreduce {world.size} ranks {nbytes / MIB:g} MiB: {line}", flush=True)
    write_result(world, args.out, "allreduce", {"backend": args.backend, "tensors": args.tensors,
                                                 "sizes": args.sizes, "horovod_cycle_ms": args.horovod_cycle_ms}, rows)
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
