"""Checkpoint I/O: hpctrain's collective HDF5 checkpoint against torch.save, DCP and raw writes.

    mpirun -n 2 python benchmarks/ckpt_io.py --state-mib 1100 --dir /tmp/ckpt-bench --out x.json

The state is an MLP and its AdamW moments (parameters x 3). Each repetition times, one
after the other on the same state:

* ``raw``: rank 0 writes every tensor with numpy ``tofile`` into one file, then fsync;
  reads them back with ``readinto`` (the bandwidth the disk gives one process);
* ``torch``: rank 0 ``torch.save`` + fsync; ``torch.load`` + ``load_state_dict``;
* ``torch_all``: the same file, loaded by every rank (a replicated resume with torch: each
  rank needs the whole state);
* ``hpctrain``: ``save_checkpoint`` on every rank (checksums, parallel HDF5 write, verify,
  fsync, rename) and ``load_checkpoint``; ``hpctrain_noverify`` skips the re-read;
  ``hpctrain_unaligned``: the layout of before the aligned one (``checkpoint.alignment = 1``);
  ``hpctrain_collective``: the aligned layout written in collective calls, as where the hints ask for
  collective buffering (``romio_cb_write=enable``, the default on Lustre and GPFS); ``hpctrain_direct``: with
  ``checkpoint.direct_io`` (each rank's parts written and re-read with O_DIRECT); ``hpctrain_buffered``: the
  parts written by HDF5's buffered writes, as before the shared mappings (the ranks take turns on the file's
  lock there);
* ``dcp``: ``torch.distributed.checkpoint.save``/``load`` over gloo on every rank;
* ``raw_shared`` and ``raw_per_rank`` (save only, not in the default list): every rank writes its share of
  the tensors with plain writes and fsyncs, into one shared file or into a file of its own (as DCP does):
  what the kernel and the disk give each layout.

Before the first load the file is dropped from the page cache (``posix_fadvise``), so
that load reads the disk (cold); a second load right after reads it from memory (warm, as
on a node that just wrote it). Peak memory: the highest resident set size above the level
before the save, on the worst rank. ``--stall``: training steps (mpi backend) with a
``CheckpointManager`` save in the middle, with and without ``async_save``, against the
same steps without a save; each manager saves once before the timed repetitions, as a
long run would have (an async save reuses the previous one's host buffers).
``--train-steps N``: the process first trains the state's model N steps (a rollback or a resume
after some work); ``--prefault-mib 0`` with one method and ``--reps 1`` per launch measures a
fresh process, as a relaunch is.
"""
import argparse
import dataclasses
import gc
import os
import shutil
import time

from common import MIB, PeakMemory, drop_file_cache, init, median, write_result

IN_FEATURES, CLASSES, DEPTH = 256, 16, 4


def build_state(state_bytes, seed=0):
    """An MLP with AdamW state of about ``state_bytes`` (parameters, exp_avg, exp_avg_sq)."""
    import torch

    from hpctrain.config import ModelConfig
    from hpctrain.models import build_model
    from hpctrain.state import Progress, TrainState

    # DEPTH blocks of hidden^2 weights dominate: 3 copies x 4 bytes each.
    hidden = max(64, int((state_bytes / (12 * DEPTH)) ** 0.5) // 64 * 64)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(name="mlp", in_features=IN_FEATURES, hidden=hidden, depth=DEPTH,
                                    residual=True, layer_norm=True, num_classes=CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # creates the moments
    opt.zero_grad()
    return TrainState(model, opt, Progress(step=1, seed=seed)), hidden


def tensors_of(state):
    """Every tensor a checkpoint of ``state`` holds, in a fixed order."""
    out = list(state.model.state_dict().values())
    for s in state.optimizer.state.values():
        out += [v for v in s.values() if hasattr(v, "numel") and v.numel() > 1]
    return out


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- the methods

def raw_save(path, tensors):
    with open(path, "wb") as f:
        for t in tensors:
            t.detach().numpy().tofile(f)
        f.flush()
        os.fsync(f.fileno())


def raw_load(path, tensors):
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            view = memoryview(t.detach().numpy()).cast("B")
            got = 0
            while got < len(view):
                got += f.readinto(view[got:])


def share_of(tensors, rank, size):
    """``[(file offset, bytes as uint8)]`` of the tensors this rank writes, the tensors laid end to end: every
    ``size``-th one, so that the ranks' shares are about even, as hpctrain's plan makes them."""
    arrays, offset, layout = [t.detach().numpy().reshape(-1).view("uint8") for t in tensors], 0, []
    for a in arrays:
        layout.append((offset, a))
        offset += a.nbytes
    return [layout[i] for i in range(rank, len(layout), size)]


def raw_shared_save(path, tensors, comm):
    """Every rank ``pwrite``s its share into one shared file, then fsyncs it: a shared file's floor."""
    if comm.Get_rank() == 0:
        open(path, "wb").close()
    comm.Barrier()
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, a in share_of(tensors, comm.Get_rank(), comm.Get_size()):
            os.pwrite(fd, a, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_per_rank_save(path, tensors, comm):
    """Every rank writes its share into a file of its own, then fsyncs it: the floor of DCP's layout."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"rank{comm.Get_rank()}"), "wb") as f:
        for _, a in share_of(tensors, comm.Get_rank(), comm.Get_size()):
            f.write(a)
        f.flush()
        os.fsync(f.fileno())


def torch_save(path, state):
    import torch

    with open(path, "wb") as f:
        torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path, state):
    import torch

    sd = torch.load(path, weights_only=True)
    state.model.load_state_dict(sd["model"])
    state.optimizer.load_state_dict(sd["optimizer"])


def dcp_save(path, state):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(state.model, state.optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)


def dcp_load(path, state):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(state.model, state.optimizer)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(state.model, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def file_bytes(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)
    return os.path.getsize(path)


def remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


# ---------------------------------------------------------------- one method, timed

PREFAULT = {"bytes": 0}  # set by --prefault-mib


def prefault():
    """Touch and free ``PREFAULT["bytes"]`` of memory, so that the pages the next save or load
    takes (page cache, new tensors) are ones the machine has at hand. On the virtual machine
    here, memory freed for a few seconds goes back to the host, and touching it again costs
    about 1 s per GiB (docs/performance.md): without this, whichever method comes after a
    pause pays that, and a median of three tells more of the order than of the method."""
    if PREFAULT["bytes"]:
        import numpy as np

        np.ones(PREFAULT["bytes"], dtype=np.uint8)


def measure(world, name, path, save, load, collective):
    """Save then load once; the slowest rank's seconds and peak extra memory. ``collective``:
    every rank saves and loads (True), rank 0 only (False), or rank 0 saves and every rank
    loads (``"load"``)."""
    from mpi4py import MPI

    comm = world.comm
    active = collective is True or world.rank == 0
    loading = bool(collective) or world.rank == 0
    gc.collect()
    comm.Barrier()
    t_save = peak = t_load = t_warm = 0.0
    size = 0
    prefault()
    comm.Barrier()
    if active:
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            save()
            t_save = time.perf_counter() - t0
        peak = mem.peak_extra
    comm.Barrier()
    if world.rank == 0:
        size = file_bytes(path)
        drop_file_cache(path)
    prefault()
    comm.Barrier()
    if loading and load is not None:
        t0 = time.perf_counter()
        load()
        t_load = time.perf_counter() - t0
    prefault()
    comm.Barrier()
    if loading and load is not None:
        t0 = time.perf_counter()
        load()  # warm: the file is in the page cache now
        t_warm = time.perf_counter() - t0
    comm.Barrier()
    if world.rank == 0:
        remove(path)
    comm.Barrier()
    return {"method": name, "save_s": comm.allreduce(t_save, op=MPI.MAX),
            "load_s": comm.allreduce(t_load, op=MPI.MAX) if load is not None else None,
            "load_warm_s": comm.allreduce(t_warm, op=MPI.MAX) if load is not None else None,
            "peak_extra_bytes": comm.allreduce(peak, op=MPI.MAX), "file_bytes": comm.bcast(size, root=0)}


def process_cpu():
    """CPU seconds of every thread of this process so far (user + system)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def trainer(world, state, batch):
    """``(train, backend)``: ``train(n)`` runs ``n`` data-parallel training steps of ``state`` (mpi backend)."""
    import torch

    from hpctrain.backends import get_backend

    backend = get_backend("mpi", world)
    model, opt = state.model, backend.distributed_optimizer(state.optimizer, state.model)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(world.rank)
    x, y = torch.randn(batch, IN_FEATURES, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)

    def train(n):
        for _ in range(n):
            loss_fn(model(x), y).backward()
            backend.synchronize(opt)
            backend.step(opt)
            opt.zero_grad()
            state.progress.step += 1

    return train, backend


def stall(world, state, directory, steps, reps, batch):
    """Seconds that a checkpoint save adds to ``steps`` training steps, sync and async."""
    from mpi4py import MPI

    from hpctrain.checkpoint import CheckpointManager
    from hpctrain.config import CheckpointConfig

    comm = world.comm
    train, backend = trainer(world, state, batch)

    managers = {mode: CheckpointManager(os.path.join(directory, mode), world,
                                        CheckpointConfig(async_save=(mode == "async"), keep_last=1))
                for mode in ("sync", "async")}
    train(1)  # warm-up: buffers, optimizer
    for mgr in managers.values():  # steady state: a run's later saves, not its first
        mgr.save(state)
        mgr.wait()
    out = {mode: {"blocking_s": [], "steps_s": [], "wait_s": [], "total_s": [], "baseline_s": [],
                  "other_cpu_s": [], "baseline_cpu_s": [], "steps_cpu_s": [], "steps": [], "step_s": []}
           for mode in managers}
    for _ in range(reps):
        for mode, mgr in managers.items():
            comm.Barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            train(steps)
            base, base_cpu = time.perf_counter() - t0, time.thread_time() - c0
            prefault()
            comm.Barrier()
            cpu0, mine0 = process_cpu(), time.thread_time()
            t0 = time.perf_counter()
            mgr.save(state)
            t1, c1 = time.perf_counter(), time.thread_time()
            # Training goes on until the save is durable (at least ``steps`` steps), as in a
            # run whose saves are further apart than one takes.
            done = 0
            while True:
                train(1)
                done += 1
                if done >= steps and not comm.allreduce(int(mgr.saving), op=MPI.MAX):
                    break
            t2, steps_cpu = time.perf_counter(), time.thread_time() - c1
            mgr.wait()
            t3 = time.perf_counter()
            step = base / steps
            base_cpu, base = base_cpu * done / steps, base * done / steps  # for as many steps
            # CPU seconds spent outside the training thread meanwhile: an async save's
            # background write, checksums and verification (and the fsync threads of both).
            other_cpu = (process_cpu() - cpu0) - (time.thread_time() - mine0)
            r = out[mode]
            for key, value in (("baseline_s", base), ("blocking_s", t1 - t0), ("steps_s", t2 - t1),
                               ("wait_s", t3 - t2), ("total_s", t3 - t0), ("other_cpu_s", other_cpu),
                               ("baseline_cpu_s", base_cpu), ("steps_cpu_s", steps_cpu), ("steps", done),
                               ("step_s", step)):
                r[key].append(comm.allreduce(value, op=MPI.MAX))
    result = {}
    for mode, r in out.items():
        m = {k: median(v) for k, v in r.items()}
        # The time training lost: the save's own blocking, slower steps while it ran in
        # the background, and waiting for it to end; against as many steps without a save.
        stalls = [t - b for t, b in zip(r["total_s"], r["baseline_s"])]
        m["stall_s"] = median(stalls)
        m["stall_samples_s"] = stalls
        result[mode] = m
    for mgr in managers.values():
        mgr.close()
    backend.close()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=1100, help="checkpointed bytes (MiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: under /tmp)")
    parser.add_argument("--methods", nargs="*",
                        default=["raw", "torch", "torch_all", "hpctrain", "hpctrain_noverify", "hpctrain_unaligned",
                                 "hpctrain_collective", "hpctrain_direct", "hpctrain_buffered", "dcp"])
    parser.add_argument("--stall", action="store_true", help="also measure the training stall")
    parser.add_argument("--stall-steps", type=int, default=3)
    parser.add_argument("--stall-reps", type=int, default=2)
    parser.add_argument("--stall-batch", type=int, default=8)
    parser.add_argument("--prefault-mib", type=float, default=None,
                        help="memory to touch and free before each save and load (default: the state's "
                             "size; 0: none)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="training steps of the state's model before anything is measured (a resume or "
                             "rollback in a process that trained first); 0: none, as in a fresh process")
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    PREFAULT["bytes"] = int((args.state_mib if args.prefault_mib is None else args.prefault_mib) * MIB)

    import tempfile

    world = init(threads=1)
    comm = world.comm
    directory = None
    if world.rank == 0:
        directory = args.dir or tempfile.mkdtemp(prefix="hpctrain-ckpt-bench-")
    directory = comm.bcast(directory, root=0)
    if world.rank == 0:
        os.makedirs(directory, exist_ok=True)
    comm.Barrier()
    state, hidden = build_state(int(args.state_mib * MIB))
    if args.train_steps:
        train, backend = trainer(world, state, args.train_batch)
        train(args.train_steps)
        backend.close()
    tensors = tensors_of(state)
    state_bytes = nbytes(tensors)

    from hpctrain.checkpoint import load_checkpoint, save_checkpoint
    from hpctrain.checkpoint.io.iosettings import IOSettings, io_settings_for
    from hpctrain.runtime.coordination import on_root

    # What a training process has imported before its first save (the checkpoint manager imports h5py when it
    # is made; a DCP user imports DCP at the top), so that no method's first repetition times an import.
    import h5py  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    def io_with(**changes):  # rank 0 chooses the settings for every rank, as a save does
        return on_root(lambda: dataclasses.replace(io_settings_for(directory), **changes), comm)

    collective_io = io_with(hints={"romio_cb_write": "enable"}) if "hpctrain_collective" in args.methods else None
    direct_io = io_with(direct=True) if "hpctrain_direct" in args.methods else None
    buffered_io = io_with(mapped=False) if "hpctrain_buffered" in args.methods else None

    dcp_error = None
    if "dcp" in args.methods:
        try:
            from train_step import init_ddp

            init_ddp(world)
        except Exception as exc:  # recorded in the results: DCP needs a process group
            dcp_error = f"{type(exc).__name__}: {exc}"

    def path(name):
        return os.path.join(directory, {"raw": "raw.bin", "torch": "state.pt", "torch_all": "state-all.pt",
                                        "dcp": "dcp", "raw_shared": "shared.bin",
                                        "raw_per_rank": "per-rank"}.get(name, f"{name}.h5"))

    methods = {
        "raw": (lambda: raw_save(path("raw"), tensors), lambda: raw_load(path("raw"), tensors), False),
        "torch": (lambda: torch_save(path("torch"), state), lambda: torch_load(path("torch"), state), False),
        "torch_all": (lambda: torch_save(path("torch_all"), state), lambda: torch_load(path("torch_all"), state),
                      "load"),
        "hpctrain": (lambda: save_checkpoint(path("hpctrain"), state, comm),
                     lambda: load_checkpoint(path("hpctrain"), state, comm), True),
        "hpctrain_noverify": (lambda: save_checkpoint(path("hpctrain_noverify"), state, comm, verify=False),
                              None, True),
        # The layout of before the aligned one (checkpoint.alignment = 1): the aligned save must not be slower.
        "hpctrain_unaligned": (lambda: save_checkpoint(path("hpctrain_unaligned"), state, comm, io=IOSettings()),
                               lambda: load_checkpoint(path("hpctrain_unaligned"), state, comm), True),
        "hpctrain_collective": (
            lambda: save_checkpoint(path("hpctrain_collective"), state, comm, io=collective_io),
            lambda: load_checkpoint(path("hpctrain_collective"), state, comm), True),
        "hpctrain_direct": (lambda: save_checkpoint(path("hpctrain_direct"), state, comm, io=direct_io),
                            lambda: load_checkpoint(path("hpctrain_direct"), state, comm), True),
        # The writes of before the shared mappings: HDF5's buffered writes, which the ranks take in turns.
        "hpctrain_buffered": (lambda: save_checkpoint(path("hpctrain_buffered"), state, comm, io=buffered_io),
                              lambda: load_checkpoint(path("hpctrain_buffered"), state, comm), True),
        "dcp": (lambda: dcp_save(path("dcp"), state), lambda: dcp_load(path("dcp"), state), True),
        "raw_shared": (lambda: raw_shared_save(path("raw_shared"), tensors, comm), None, True),
        "raw_per_rank": (lambda: raw_per_rank_save(path("raw_per_rank"), tensors, comm), None, True),
    }
    chosen = [m for m in args.methods if not (m == "dcp" and dcp_error)]
    runs = {m: [] for m in chosen}
    for rep in range(args.reps):  # interleaved: the disk's mood changes over minutes
        # Each repetition starts with the next method: the first of a round pays for what the machine did
        # between rounds (here 0.1-0.2 s more on a save of 250 MiB, whichever method was first).
        first = rep % len(chosen) if chosen else 0
        for name in chosen[first:] + chosen[:first]:
            save, load, collective = methods[name]
            try:
                runs[name].append(measure(world, name, path(name), save, load, collective))
            except Exception as exc:
                if name != "dcp":
                    raise
                dcp_error = f"{type(exc).__name__}: {exc}"
                comm.Barrier()
        if dcp_error and "dcp" in runs:
            del runs["dcp"]
            chosen.remove("dcp")
    rows = []
    for name, rs in runs.items():
        row = {"method": name, "reps": len(rs), "state_bytes": state_bytes,
               "save_s": median([r["save_s"] for r in rs]), "file_bytes": rs[0]["file_bytes"],
               "peak_extra_bytes": max(r["peak_extra_bytes"] for r in rs),
               "save_samples_s": [r["save_s"] for r in rs]}
        loads = [r["load_s"] for r in rs if r["load_s"] is not None]
        row["load_s"] = median(loads) if loads else None
        warm = [r["load_warm_s"] for r in rs if r["load_warm_s"] is not None]
        row["load_warm_s"] = median(warm) if warm else None
        row["load_samples_s"] = loads
        row["save_gbs"] = state_bytes / row["save_s"] / 1e9
        row["load_gbs"] = state_bytes / row["load_s"] / 1e9 if row["load_s"] else None
        row["peak_extra_fraction"] = row["peak_extra_bytes"] / state_bytes
        rows.append(row)
        if world.rank == 0:
            print(f"ckpt_io {name}: save {row['save_s']:.2f} s, load {row['load_s'] or 0:.2f} s "
                  f"(warm {row['load_warm_s'] or 0:.2f} s), "
                  f"peak extra {row['peak_extra_fraction']:.0%} of {state_bytes / MIB:.0f} MiB", flush=True)
    result = {"state_bytes": state_bytes, "prefault_bytes": PREFAULT["bytes"], "hidden": hidden, "tensors": len(tensors), "methods": rows,
              "dcp_error": dcp_error, "directory": directory}
    if args.stall:
        result["stall"] = stall(world, state, os.path.join(directory, "stall"), args.stall_steps,
                                args.stall_reps, args.stall_batch)
        result["stall"]["steps"] = args.stall_steps
        if world.rank == 0:
            for mode in ("sync", "async"):
                s = result["stall"][mode]
                print(f"ckpt_io stall {mode}: {s['stall_s']:.2f} s over {s['steps']:.0f} steps of "
                      f"{s['step_s']:.2f} s (blocking {s['blocking_s']:.2f} s)", flush=True)
    comm.Barrier()
    if world.rank == 0 and not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    write_result(world, args.out, "ckpt_io", {k: v for k, v in vars(args).items() if k != "out"}, result)
    if "dcp" in args.methods and not dcp_error:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
