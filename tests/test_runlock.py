"""The run lock cannot be taken twice: real processes racing for one stale lock (exactly one
wins, every round), a takeover that cannot replace a lock made after the stale one was
released, and the checkpoint directory locked with the run directory, also between two real
`hpctrain train` runs that share one checkpoint.directory."""
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from hpctrain.job import runlock
from mpi_harness import PYTHON, ROOT, hpctrain, mpi_env

HOST = socket.gethostname()
ROUNDS = 100


def _racer(run_dir, barrier, results, done):
    barrier.wait(timeout=30)
    try:
        runlock.acquire(run_dir, environ={})
        results.put(("won", os.getpid(), ""))
    except runlock.RunDirBusy as exc:
        results.put(("busy", os.getpid(), str(exc)))
    except BaseException as exc:  # reported, so that the test names it
        results.put(("error", os.getpid(), repr(exc)))
    done.wait(timeout=60)  # the winner stays alive while the others judge its lock


def test_racers_for_one_stale_lock_exactly_one_wins(tmp_path, monkeypatch):
    # No grace for a live holder of this host: the losers answer at once (the grace itself
    # is tested in test_slurm_runlock.py).
    monkeypatch.setattr(runlock, "SETTLE_SECONDS", 0.0)
    ctx = multiprocessing.get_context("fork")
    run_dir = str(tmp_path / "run")
    lock = os.path.join(run_dir, runlock.LOCK_NAME)
    winners = []
    for round_ in range(ROUNDS):
        # Round 0 races to create the lock; every later round races for the lock that the
        # previous round's winner, now exited, left behind: a stale lock.
        n = 2 + round_ % 3
        barrier, results, done = ctx.Barrier(n), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_racer, args=(run_dir, barrier, results, done)) for _ in range(n)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=60) for _ in range(n)]
        done.set()
        for p in procs:
            p.join(timeout=30)
        won = [pid for what, pid, _ in outcomes if what == "won"]
        assert [o for o in outcomes if o[0] == "error"] == [], outcomes
        assert len(won) == 1, f"round {round_}: {len(won)} of {n} racers won: {outcomes}"
        assert json.loads(open(lock).read())["pid"] == won[0]
        for what, pid, text in outcomes:
            if what == "busy":
                assert f"is in use by pid {won[0]} on {HOST}" in text, text
        winners.append(won[0])
    assert len(set(winners)) == ROUNDS
    # The claims of the taken-over locks are kept (see runlock), the temp records are not.
    leftovers = [n for n in os.listdir(run_dir) if runlock.NEW_MARK in n]
    assert leftovers == []


def test_a_stale_judgement_cannot_replace_a_lock_made_after_release(tmp_path, monkeypatch):
    # Holding T is released by its owner; a new job C then takes the free lock. A process that
    # read T just before the release and judged it stale (its owner has exited meanwhile) must
    # not replace C's lock: the release claimed T, so the takeover of T is refused.
    run_dir = str(tmp_path)
    first = subprocess.run([PYTHON, "-c", "import sys, json; from hpctrain.job import runlock; "
                            "p = runlock.acquire(sys.argv[1], environ={}); print(open(p).read(), flush=True); "
                            "runlock.release(p)", run_dir], capture_output=True, text=True, timeout=60,
                           env=mpi_env(), check=True)
    stale = json.loads(first.stdout)  # owner exited and released: its claim is on disk
    assert os.path.exists(os.path.join(run_dir, runlock.LOCK_NAME + runlock.CLAIM_MARK + stale["token"]))
    holder = subprocess.Popen([PYTHON, "-c", "import sys, time; from hpctrain.job import runlock; "
                               "runlock.acquire(sys.argv[1], environ={}); print('held', flush=True); time.sleep(60)",
                               run_dir], stdout=subprocess.PIPE, text=True, env=mpi_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        real_read, calls = runlock._read, []

        def read_then_stale(path):
            calls.append(path)
            if len(calls) == 1:  # what this process saw a moment before the release
                return stale, stale["token"]
            return real_read(path)

        monkeypatch.setattr(runlock, "_read", read_then_stale)
        monkeypatch.setattr(runlock, "SETTLE_SECONDS", 0.0)
        with pytest.raises(runlock.RunDirBusy, match=f"in use by pid {holder.pid} on {HOST}"):
            runlock.acquire(run_dir, environ={})
        assert json.loads(open(os.path.join(run_dir, runlock.LOCK_NAME)).read())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_checkpoint_directory_is_locked_with_the_run_directory(tmp_path):
    ckpt = tmp_path / "shared-ckpt"
    path = runlock.acquire(str(tmp_path / "a"), checkpoint_dir=str(ckpt))
    record = json.loads((ckpt / runlock.LOCK_NAME).read_text())
    assert record == json.loads(open(path).read())  # the same holder
    assert record["run_dir"] == str(tmp_path / "a")
    # a second run of this process with another run directory, the same checkpoint directory
    code = ("import sys; from hpctrain.job import runlock; "
            "runlock.acquire(sys.argv[1], environ={}, checkpoint_dir=sys.argv[2])")
    proc = subprocess.run([PYTHON, "-c", code, str(tmp_path / "b"), str(ckpt)], capture_output=True,
                          text=True, timeout=60, env=mpi_env())
    assert proc.returncode != 0
    assert (f"checkpoint directory {ckpt} is in use by pid {os.getpid()} on {HOST}" in proc.stderr
            and f"for run directory {tmp_path / 'a'}" in proc.stderr), proc.stderr
    assert "HINT: give this run its own checkpoint.directory" in proc.stderr
    assert not (tmp_path / "b" / runlock.LOCK_NAME).exists()  # what it took first, it let go
    runlock.release(str(tmp_path / "a"))
    assert not (ckpt / runlock.LOCK_NAME).exists() and not os.path.exists(path)


HOLDER = textwrap.dedent("""
    # mpirun -n 1: a real training run that saves into a shared checkpoint directory and
    # pauses after step 4 (checkpoints written) until GO exists.
    import os, sys, time
    sys.path.insert(0, os.path.join(sys.argv[4], "tests", "mpi"))
    from train_tiny import synthetic
    from hpctrain import Trainer, load_config

    run_dir, ckpt, go = sys.argv[1:4]

    class Pause:
        def on_step(self, state, metrics, phase_times):
            if state.progress.step == 4:
                open(go + ".paused", "w").close()
                for _ in range(600):
                    if os.path.exists(go):
                        return
                    time.sleep(0.1)

    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=2",
                             "model.num_classes=4", "train.batch_size=8", "train.epochs=1",
                             "train.max_steps=6", "comm.backend=mpi", f"run.run_dir={run_dir}",
                             f"checkpoint.directory={ckpt}", "checkpoint.every_steps=2"])
    Trainer(cfg, train_data=synthetic(256, 1), val_data=synthetic(64, 2), callbacks=[Pause()]).fit()
    print("first run done", flush=True)
""")


def _snapshot(directory):
    return {name: (os.stat(os.path.join(directory, name)).st_mtime_ns,
                   open(os.path.join(directory, name), "rb").read())
            for name in sorted(os.listdir(directory))}


@pytest.mark.mpi
def test_two_runs_sharing_a_checkpoint_directory_second_refused(tmp_path):
    run_a, run_b, ckpt, go = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt", tmp_path / "go"
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    first = subprocess.Popen(["mpirun", "-n", "1", "--timeout", "150", PYTHON, str(script), str(run_a),
                              str(ckpt), str(go), str(ROOT)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=ROOT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(str(go) + ".paused"):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate(timeout=30)
            time.sleep(0.2)
        holder = json.loads((ckpt / runlock.LOCK_NAME).read_text())
        before = _snapshot(ckpt)
        assert "latest" in before and "ckpt-00000004.h5" in before, sorted(before)
        # the second run: its own run directory, the same checkpoint.directory, resume=auto
        second = hpctrain(2, "train", "examples/digits.toml", f"run.run_dir={run_b}",
                          f"checkpoint.directory={ckpt}", f"data.path={tmp_path}/digits.h5",
                          "comm.backend=mpi", timeout=120)
        assert second.returncode == 2, second.output
        assert (f"checkpoint directory {ckpt} is in use by pid {holder['pid']} on {HOST}"
                in second.stderr), second.stderr
        assert f"for run directory {run_a}" in second.stderr
        assert "HINT: give this run its own checkpoint.directory" in second.stderr
        assert _snapshot(ckpt) == before  # nothing written, nothing removed, `latest` untouched
        assert not (run_b / "config.toml").exists() and not (run_b / runlock.LOCK_NAME).exists()
        go.touch()
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0 and "first run done" in out, out + err
        # release(run_dir) at the end of the first run freed both of its locks
        assert not (ckpt / runlock.LOCK_NAME).exists() and not (run_a / runlock.LOCK_NAME).exists()
        assert (ckpt / "latest").read_text().strip() == "ckpt-00000006.h5"
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
