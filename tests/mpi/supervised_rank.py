"""What ``hpctrain launch`` starts on each rank in the supervisor tests: ``python -m hpctrain
train ...`` with a failure placed by step, and every rank's samples of every step written down.

    SUPERVISED_KILL_STEP=7 SUPERVISED_KILL_RANK=1 SUPERVISED_MARKER=/tmp/killed \\
        hpctrain launch -n 2 --python WRAPPER examples/digits.toml

(``WRAPPER``: an executable that runs ``python tests/mpi/supervised_rank.py "$@"``.)

SUPERVISED_KILL_STEP=N: the rank SUPERVISED_KILL_RANK (default 0) SIGKILLs itself as step N
    begins; only once when SUPERVISED_MARKER names a file (created just before the kill, so a
    relaunch runs through), at every launch without it. SUPERVISED_ACTION=raise: raise a
    RuntimeError there instead (the rank's own failure record, then the abort); =hang: sleep
    for an hour (the watchdog ends the job).
SUPERVISED_KILL_AFTER=GLOB: before that failure, wait (up to 120 s) for a file matching GLOB to
    exist (e.g. the warm spares' ready file; the marker then also says the niceness of the set's rank 0).
SUPERVISED_STEP_SLEEP=S: sleep S seconds in every step (a run long enough to signal).
SUPERVISED_START_HANG=MARKER: rank SUPERVISED_KILL_RANK creates MARKER and sleeps for an hour before
    anything else, MPI included (the other ranks wait in MPI's start-up for it), when MARKER does not exist.
SUPERVISED_ORDER=DIR: each rank appends ``{"launch", "time", "step", "rank", "size",
    "samples", "nice"}`` lines to DIR/rank-R-PID.jsonl, one per step it trains (``launch``: the
    launcher's pid, the same for every rank of one launch).
Test hooks only: nothing here is part of hpctrain.
"""
import json
import os
import signal
import sys
import time

from fail_inject import run_target  # the target script, run in this process


def _append(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _wait_for(pattern, timeout=120):
    import glob

    deadline = time.monotonic() + timeout
    while pattern and not glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.1)


def _spare_niceness(pattern):
    """The niceness of the rank 0 of the warm spare set whose ready file matches ``pattern`` (it names its pid)."""
    import glob

    for ready in glob.glob(pattern or ""):
        try:
            with open(ready) as f:
                pid = json.load(f)["pid"]
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat(5)
        except (OSError, ValueError, KeyError):
            pass
    return None


def install():
    from hpctrain.training import trainer

    kill_step = int(os.environ.get("SUPERVISED_KILL_STEP") or 0)
    kill_rank = int(os.environ.get("SUPERVISED_KILL_RANK") or 0)
    marker = os.environ.get("SUPERVISED_MARKER")
    order_dir = os.environ.get("SUPERVISED_ORDER")
    step_sleep = float(os.environ.get("SUPERVISED_STEP_SLEEP") or 0)
    original = trainer._train_step

    def _train_step(run, micro_batches):
        step = run.state.progress.step + 1
        if kill_step and step == kill_step and run.world.rank == kill_rank:
            if not marker or not os.path.exists(marker):
                _wait_for(os.environ.get("SUPERVISED_KILL_AFTER"))
                if marker:
                    _append(marker, f"rank {run.world.rank} killed at step {step}; spare niceness "
                                    f"{_spare_niceness(os.environ.get('SUPERVISED_KILL_AFTER'))}\n")
                action = os.environ.get("SUPERVISED_ACTION", "kill")
                if action == "raise":
                    raise RuntimeError(f"injected failure at step {step}")
                if action == "hang":
                    print(f"supervised_rank: rank {run.world.rank}: hangs at step {step}", file=sys.stderr, flush=True)
                    time.sleep(3600)
                print(f"supervised_rank: rank {run.world.rank}: SIGKILL at step {step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if order_dir:
            samples = [int(i) for mb in micro_batches for i in mb]
            _append(os.path.join(order_dir, f"rank-{run.world.rank}-{os.getpid()}.jsonl"),
                    json.dumps({"launch": os.getppid(), "time": time.time(), "step": step, "rank": run.world.rank,
                                "size": run.world.size, "samples": samples,
                                "nice": os.getpriority(os.PRIO_PROCESS, 0)}) + "\n")
        if step_sleep:
            time.sleep(step_sleep)
        return original(run, micro_batches)

    trainer._train_step = _train_step


def _hang_in_start_up():
    marker = os.environ.get("SUPERVISED_START_HANG")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK") or "0"
    if marker and not os.path.exists(marker) and rank == (os.environ.get("SUPERVISED_KILL_RANK") or "0"):
        _append(marker, f"rank {rank} hangs in start-up\n")
        print(f"supervised_rank: rank {rank}: hangs before MPI starts", file=sys.stderr, flush=True)
        time.sleep(3600)


def main():
    _hang_in_start_up()
    install()
    run_target(sys.argv[1:])


if __name__ == "__main__":
    main()
