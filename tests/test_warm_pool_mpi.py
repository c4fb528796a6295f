"""The warm pool (hpctrain.job.warmpool) with real processes: a rank of ``python -m hpctrain train`` offered a pool
is forked from it (its start record says so) and trains; the process started for it stands in for it: a stop
signal sent to it reaches the rank, which saves and ends with its exit status; killed, it takes the rank with
it; the rank killed, it ends of the same signal. A rank whose import-time settings differ from the pool's, or
that is offered a pool that is not there, starts cold (saying why where the pool refused it). MPI starts in
each rank as a singleton here; under mpirun: test_supervisor_mpi.py."""
import os
import signal
import subprocess
import time

import pytest

from mpi_harness import PYTHON, ROOT, mpi_env
from run_records import records

pytestmark = [pytest.mark.mpi]

TIMEOUT = 120


@pytest.fixture(scope="module")
def pool():
    from hpctrain.job import warmpool

    said = []
    p = warmpool.Pool(PYTHON, mpi_env(), said.append)
    p.start()
    try:
        assert p.wait_up(), said
        assert "resident" in said[0], said
        yield p
    finally:
        p.close()
    assert p.child.poll() is not None


def start(pool_env, run_dir, digits, *extra, env=None):
    cmd = [PYTHON, "-m", "hpctrain", "train", "examples/digits.toml", f"run.run_dir={run_dir}", f"data.path={digits}",
           "comm.backend=mpi", "monitor.log_every=1", "monitor.progress=log", "data.val=none", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(dict(pool_env, **(env or {}))), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc):
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"did not end in {TIMEOUT} s:\n{out[-4000:]}")
    return proc.returncode, out


def wait_training(proc, run_dir, steps=3):
    deadline = time.monotonic() + TIMEOUT
    while not [r for r in records(run_dir, "train") if r.get("step", 0) >= steps]:
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)[1][-4000:]
        time.sleep(0.05)


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_rank_is_forked_from_the_pool_and_its_stand_in_passes_signals_and_endings_on(pool, tmp_path, digits):
    # trains to its end, forked: the start record says so
    code, out = finish(start(pool.env(), tmp_path / "a", digits, "train.max_steps=4"))
    assert code == 0, out[-4000:]
    (first,) = records(tmp_path / "a", "start")
    assert first["forked"] is True, first
    assert "warm pool not used" not in out

    # SIGTERM to the process mpirun would have started: the rank saves the step it is at, and both end with 3
    run = tmp_path / "b"
    proc = start(pool.env(), run, digits, "train.max_steps=1000000", "checkpoint.on_epoch_end=false")
    wait_training(proc, run)
    (rank,) = children(pool.child.pid)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    saved = [line for line in out.splitlines() if "stop requested: saving at step" in line]
    assert code == 3 and saved, out[-4000:]
    step = int(saved[0].split("saving at step ")[1].split()[0])
    assert (run / "checkpoints" / f"ckpt-{step:08d}.h5").exists(), sorted(os.listdir(run / "checkpoints"))
    assert not alive(rank)

    # the stand-in killed (as mpirun kills a failed launch's ranks): the pool kills the rank
    run = tmp_path / "c"
    proc = start(pool.env(), run, digits, "train.max_steps=1000000")
    wait_training(proc, run)
    (rank,) = children(pool.child.pid)
    proc.kill()
    finish(proc)
    deadline = time.monotonic() + 10
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(rank), "the forked rank outlived the process that stood in for it"

    # the rank killed: its stand-in ends of the same signal, as the launcher must see it
    run = tmp_path / "d"
    proc = start(pool.env(), run, digits, "train.max_steps=1000000")
    wait_training(proc, run)
    (rank,) = children(pool.child.pid)
    os.kill(rank, signal.SIGKILL)
    code, out = finish(proc)
    assert code == -signal.SIGKILL, (code, out[-4000:])


def test_a_rank_the_pool_cannot_take_starts_cold(pool, tmp_path, digits):
    # other import-time settings than the pool's: refused, said, and the rank runs as it would have
    code, out = finish(start(pool.env(), tmp_path / "a", digits, "train.max_steps=2", env={"PYTHONHASHSEED": "7"}))
    assert code == 0, out[-4000:]
    assert "hpctrain: warm pool not used (PYTHONHASHSEED differ(s) from the pool's, and take effect at import): " \
           "starting cold" in out, out[-4000:]
    (first,) = records(tmp_path / "a", "start")
    assert first["forked"] is False, first
    # a pool that is not there (ended, never started): cold, and nothing to say
    gone = {k: v.replace(pool.name, pool.name + "-gone") for k, v in pool.env().items()}
    code, out = finish(start(gone, tmp_path / "b", digits, "train.max_steps=2"))
    assert code == 0 and "warm pool" not in out, out[-4000:]
    assert records(tmp_path / "b", "start")[0]["forked"] is False
    # a bad configuration from a forked rank: the same error and exit status as from a cold one
    bad = [PYTHON, "-m", "hpctrain", "train", "no/such.toml"]
    cold = subprocess.run(bad, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=TIMEOUT)
    warm = subprocess.run(bad, cwd=ROOT, env=mpi_env(pool.env()), capture_output=True, text=True, timeout=TIMEOUT)
    assert cold.returncode == warm.returncode == 2 and warm.stderr == cold.stderr, (cold, warm)
