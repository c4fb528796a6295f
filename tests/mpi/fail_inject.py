"""Run a Python command (``-m hpctrain train ...`` or a script) with a failure injected
on one rank, at a point counted in calls, so that tests can place it anywhere in a run:

    FAIL_RANK=1 FAIL_AT=backward:12 FAIL_ACTION=kill \\
        mpirun -n 2 python tests/mpi/fail_inject.py -m hpctrain train examples/digits.toml

FAIL_AT=<point>:<n>: the n-th call (1-based) on that rank of
    backward   torch.Tensor.backward (one per micro-batch: a point inside training)
    h5write    a write into an HDF5 dataset (h5py Dataset.__setitem__): a point inside
               a checkpoint write
    replace    os.replace (rank 0 renames checkpoints and ``latest`` into place)
FAIL_ACTION: kill (SIGKILL itself), raise (RuntimeError), sleep (hang for an hour).
FAIL_COUNT=1 (without FAIL_AT): count the calls of every point and print them at exit
("fail_inject: rank 0 calls backward=40 h5write=60 replace=18"), to place failures.
FAIL_LOG=PATH: append "rank R resumed STEP" to PATH after checkpoint resume (0: started
fresh), written and fsynced at once: a killed job may lose the last of its forwarded output.
Without any of these the command runs unchanged. The job scripts can run this file in place of
python: tests point HPCTRAIN_VENV at a directory whose bin/python execs it.
"""
import os
import runpy
import signal
import sys
import time

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _rank():
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _act(action, where):
    import threading

    print(f"fail_inject: rank {_rank()}: {action} at {where} (thread {threading.current_thread().name})",
          file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "sleep":
        time.sleep(3600)
    raise RuntimeError(f"injected failure at {where}")


COUNTS = {}


def _count_calls(owner, name, point, n, action):
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            _act(action, f"{point} call {n}")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)
    COUNTS[point] = calls
    return calls


def install(point, n, action):
    if point == "backward":
        import torch

        _count_calls(torch.Tensor, "backward", point, n, action)
    elif point == "h5write":
        import h5py

        # dset[...] = x: each rank's share of each tensor in a collective checkpoint write
        _count_calls(h5py.Dataset, "__setitem__", point, n, action)
    elif point == "replace":
        _count_calls(os, "replace", point, n, action)
    else:
        raise SystemExit(f"fail_inject: unknown point {point!r}")


def _record_resume(path):
    from hpctrain.checkpoint import CheckpointManager

    original = CheckpointManager.resume

    def resume(self, state):
        loaded = original(self, state)
        with open(path, "a") as f:
            f.write(f"rank {_rank()} resumed {state.progress.step if loaded else 0}\n")
            f.flush()
            os.fsync(f.fileno())
        return loaded

    CheckpointManager.resume = resume


def _report_counts():
    text = " ".join(f"{point}={calls[0]}" for point, calls in sorted(COUNTS.items()))
    print(f"fail_inject: rank {_rank()} calls {text}", file=sys.stderr, flush=True)


def main():
    spec = os.environ.get("FAIL_AT")
    if spec and _rank() == int(os.environ.get("FAIL_RANK", "0")):
        point, n = spec.split(":")
        install(point, int(n), os.environ.get("FAIL_ACTION", "kill"))
    elif os.environ.get("FAIL_COUNT") == "1":
        import atexit

        for point in ("backward", "h5write", "replace"):
            install(point, 0, "count")
        atexit.register(_report_counts)
    if os.environ.get("FAIL_LOG"):
        _record_resume(os.environ["FAIL_LOG"])
    run_target(sys.argv[1:])


def run_target(args):
    """Run ``args`` (``script.py ...`` or ``-m module ...``) in this process as its ``__main__``."""
    if args[:1] == ["-m"]:
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
