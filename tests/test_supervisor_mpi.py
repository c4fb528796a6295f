"""``hpctrain launch`` under a real mpirun: one rank SIGKILLed (or raising) at a random step,
the supervisor relaunches (at the same size, or one rank fewer with ``--shrink``: 4 -> 3 and
2 -> 1), the run finishes, every step trained the same samples in the same order, and the
final parameters equal those of an uninterrupted run with the same global batch (1e-5).
Restarts exhausted and a configuration error end it with a clear message and no (further)
relaunch. The restart events are in metrics.jsonl and in ``hpctrain report``.

The failures are placed by tests/mpi/supervised_rank.py (run in place of python through
``--python``); the kill step is drawn at random and printed (pytest -s), or fixed with
SUPERVISED_TEST_SEED.
"""
import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from checkpoint_files import latest_step, tensors
from mpi_harness import PYTHON, ROOT, mpi_env, mpirun
from run_records import records as metrics

pytestmark = [pytest.mark.mpi]

STEPS = 12
GLOBAL_BATCH = 48  # divisible by 1, 2, 3 and 4 ranks: the same training on each
LAUNCH_TIMEOUT = 240
RNG = random.Random(int(os.environ.get("SUPERVISED_TEST_SEED") or random.SystemRandom().randrange(1 << 30)))


def overrides(run_dir, digits):
    return [f"run.run_dir={run_dir}", f"data.path={digits}", f"train.max_steps={STEPS}",
            f"train.global_batch_size={GLOBAL_BATCH}", "checkpoint.every_steps=3", "comm.backend=mpi",
            "monitor.log_every=1", "monitor.progress=log", "data.val=none"]


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    """The executable the supervisor runs as the ranks' Python."""
    path = tmp_path_factory.mktemp("bin") / "python"
    path.write_text(f'#!/bin/sh\nexec "{PYTHON}" "{ROOT}/tests/mpi/supervised_rank.py" "$@"\n')
    path.chmod(0o755)
    return path


def sample_order(order_dir):
    """{step: the global batch's samples in rank order}, from the last launch that ran each step."""
    lines = [json.loads(line) for p in Path(order_dir).glob("rank-*.jsonl") for line in p.read_text().splitlines()]
    by_step = {}
    for rec in lines:
        by_step.setdefault(rec["step"], {}).setdefault(rec["launch"], []).append(rec)
    order = {}
    for step, launches in by_step.items():
        last = max(launches.values(), key=lambda recs: max(r["time"] for r in recs))
        ranks = sorted(last, key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == list(range(ranks[0]["size"])), f"step {step}: ranks missing {ranks}"
        order[step] = [i for r in ranks for i in r["samples"]]
    return order


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits):
    """An uninterrupted run on 2 ranks: its sample order and final parameters."""
    base = tmp_path_factory.mktemp("reference")
    order_dir = base / "order"
    order_dir.mkdir()
    mpirun(2, ["tests/mpi/supervised_rank.py", "-m", "hpctrain", "train", "examples/digits.toml",
               *overrides(base / "run", digits)], timeout=LAUNCH_TIMEOUT,
           env={"SUPERVISED_ORDER": str(order_dir)}, check=True)
    return sample_order(order_dir), final_tensors(base / "run")


def final_tensors(run_dir):
    ckpt = Path(run_dir) / "checkpoints"
    name = (ckpt / "latest").read_text().strip()
    assert f"{STEPS:08d}" in name, f"latest is {name}, not the final step {STEPS}"
    return tensors(ckpt / name)


def launch(tmp_path, digits, wrapper, args, env=None, extra=(), spares=False):
    """``hpctrain launch ARGS --python WRAPPER examples/digits.toml ...``; (returncode, output). Without
    warm spares unless ``spares`` (each set is 2-4 more ranks starting beside the test's)."""
    order_dir = tmp_path / "order"
    order_dir.mkdir(exist_ok=True)
    cmd = [PYTHON, "-m", "hpctrain", "launch", *args, *([] if spares else ["--spares", "0"]), "--python", str(wrapper),
           "examples/digits.toml", *overrides(tmp_path / "run", digits), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(dict(env or {}, SUPERVISED_ORDER=str(order_dir))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {LAUNCH_TIMEOUT}s:\n{out[-6000:]}")
    print(out[-3000:])
    return proc.returncode, out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Watched:
    """A command started in its own session, its output gathered line by line as it comes (``lines``). Leaving
    the ``with`` block kills the session if the command still runs, and prints the output's end (``out``)."""

    def __init__(self, cmd, env=None):
        import threading

        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def until(self, done, what, poll=0.1):
        """Wait (at most half the launch timeout) for ``done()``, while the command runs."""
        import time

        deadline = time.monotonic() + LAUNCH_TIMEOUT / 2
        while not done():
            assert time.monotonic() < deadline and self.proc.poll() is None, \
                f"no {what}:\n{''.join(self.lines)[-6000:]}"
            time.sleep(poll)

    def wait_for(self, text, count=1):
        self.until(lambda: sum(text in line for line in self.lines) >= count, repr(text))

    def end(self):
        self.proc.wait(timeout=LAUNCH_TIMEOUT)
        self.reader.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.out = "".join(self.lines)
        print(self.out[-3000:])


def assert_same_training(tmp_path, reference):
    ref_order, ref_tensors = reference
    assert sample_order(tmp_path / "order") == ref_order, "a step trained other samples than the uninterrupted run"
    got = final_tensors(tmp_path / "run")
    assert sorted(got) == sorted(ref_tensors)
    for name, value in ref_tensors.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5, err_msg=name)


# 4 -> 3 with train.accumulation=3: 12 samples per rank are 3 micro-batches of 4, then 16 per rank
# are 4 of 4 (the accumulation is raised, and said); the reference runs 2 ranks x 24 x 1.
# "2-same" runs as a user's launch does, with a warm spare set: the kill waits until it is up.
@pytest.mark.parametrize("ranks,shrink,extra,said", [
    (2, False, [], "restart 1 of at most 3: 2 -> 2 rank(s) (same size)"),
    (4, True, ["train.accumulation=3"], "global batch 48 kept: 4 per rank x 3 ranks x 4 (train.accumulation 3 -> 4"),
    (2, True, [], "global batch 48 kept: 48 per rank x 1 ranks x 1")], ids=["2-same", "4-to-3", "2-to-1"])
def test_killed_rank_is_relaunched_and_training_is_the_same(tmp_path, digits, wrapper, reference, ranks, shrink,
                                                            extra, said):
    kill_step, kill_rank = RNG.randint(2, STEPS - 1), RNG.randrange(ranks)
    spares = not shrink
    print(f"SIGKILL of rank {kill_rank} at step {kill_step} of {ranks} ranks (shrink {shrink}, spares {spares})")
    code, out = launch(tmp_path, digits, wrapper, ["-n", str(ranks)] + (["--shrink"] if shrink else []),
                       env={"SUPERVISED_KILL_STEP": str(kill_step), "SUPERVISED_KILL_RANK": str(kill_rank),
                            "SUPERVISED_MARKER": str(tmp_path / "killed"),
                            "SUPERVISED_KILL_AFTER": str(tmp_path / "run" / ".spares" / "*.ready") if spares else ""},
                       extra=extra, spares=spares)
    assert code == 0, out[-6000:]
    assert (tmp_path / "killed").exists(), "the kill never happened"
    assert ("hpctrain launch: calling the warm spares 2 rank(s)" in out) == spares, out[-6000:]
    if spares and os.geteuid() == 0:  # a set waits at the lowest priority (where its ranks may raise it again)
        assert "spare niceness 19" in (tmp_path / "killed").read_text()
    # every step trains at the supervisor's priority, the called spares' steps too
    nice = {json.loads(line)["nice"] for p in (tmp_path / "order").glob("rank-*.jsonl")
            for line in p.read_text().splitlines()}
    assert nice == {os.getpriority(os.PRIO_PROCESS, 0)}, nice
    assert ("warm spares ready: 2 rank(s) holding" in out) == spares
    # the set started for a next relaunch is ended with the run: no rank, no file of it left
    assert not (tmp_path / "run" / ".spares").exists()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path / "run") in _cmdline(p)]
    after = ranks - 1 if shrink else ranks
    assert f"rank {kill_rank} on" in out and "killed by signal 9 (SIGKILL)" in out
    assert f"restart 1 of at most 3: {ranks} -> {after} rank(s)" in out and said in out
    assert "done after 1 restart(s)" in out
    (restart,) = metrics(tmp_path / "run", "restart")
    assert (restart["cause"], restart["rank"], restart["signal"], restart["source"]) == \
        ("signal", kill_rank, 9, "mpirun")
    assert (restart["ranks_before"], restart["ranks_after"]) == (ranks, after)
    # the kill came as step kill_step began: kill_step - 1 were done; checkpoints every 3 steps
    resume = (kill_step - 1) // 3 * 3
    assert (restart["failed_step"], restart["resume_step"], restart["steps_lost"]) == \
        (kill_step - 1, resume, kill_step - 1 - resume)
    assert_same_training(tmp_path, reference)

    report = subprocess.run([PYTHON, "-m", "hpctrain", "report", str(tmp_path / "run")], cwd=ROOT, text=True,
                            capture_output=True, timeout=120)
    assert report.returncode == 0, report.stderr
    # the report counts from the step the relaunch resumed: a node-local snapshot (on by default) may be newer
    resumed = [r["step"] for r in metrics(tmp_path / "run", "start")][-1]
    assert resume <= resumed <= kill_step - 1
    lost = kill_step - 1 - resumed
    assert (f"restarts: 1 ({lost} step(s) lost in all): step {kill_step - 1}: rank {kill_rank} on " in report.stdout
            and f"killed by signal 9 (SIGKILL); {ranks} -> {after} ranks, {lost} step(s) lost" in report.stdout), \
        report.stdout
    # the restart's cost, part by part, from the failed launch's last step to the relaunch's first
    cost = re.search(r"restart 1 cost ([\d.]+) s from the last step to the first after it \(([\d.]+) s between the "
                     r"logged steps around it\): (.*)", report.stdout)
    assert cost, report.stdout
    parts = {name: float(seconds) for name, seconds in (p.rsplit(" ", 1) for p in cost.group(3).split(", "))}
    # warm spares start up before they are needed: only what follows their call is part of the cost
    started = ["spares called"] if spares else ["ranks started", "imports", "mpi"]
    assert list(parts) == ["launcher gone", "decision", *started, "backend", "run_dir", "data", "model", "resume",
                           "backend start", "monitor", "first step"], parts
    assert all(v >= 0 for v in parts.values()) and (spares or parts["imports"] > 0), parts
    assert abs(sum(parts.values()) - float(cost.group(1))) < 0.05, parts  # the parts make up the whole
    assert float(cost.group(1)) <= float(cost.group(2)), cost.group(0)  # the steps trained around it left out


def test_restarts_exhausted_stop_with_the_count_and_the_cause(tmp_path, digits, wrapper):
    """A rank that raises at every launch: its own failure record names it; one restart, then stop."""
    code, out = launch(tmp_path, digits, wrapper, ["-n", "2", "--max-restarts", "1"],
                       env={"SUPERVISED_KILL_STEP": "2", "SUPERVISED_KILL_RANK": "1", "SUPERVISED_ACTION": "raise"})
    assert code == 1, out[-6000:]
    assert out.count("hpctrain launch: relaunching") == 1
    assert ("rank 1 on" in out and "failed: RuntimeError (exit status 1); giving up: 1 restart(s) done, "
            "--max-restarts 1: not restarting again" in out), out[-4000:]
    (restart,) = metrics(tmp_path / "run", "restart")
    assert (restart["cause"], restart["rank"], restart["error"], restart["source"]) == \
        ("exception", 1, "RuntimeError", "record")
    (stop,) = metrics(tmp_path / "run", "launch_stop")
    assert stop["reason"] == "exhausted" and stop["restarts"] == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "failures.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["error"]) for r in records] == [("exception", 1, "RuntimeError")] * 2


@pytest.mark.smoke
def test_configuration_error_is_not_restarted(tmp_path, digits, wrapper):
    code, out = launch(tmp_path, digits, wrapper, ["-n", "2"], extra=["train.lr=-1"])
    assert code == 2, out[-6000:]
    assert "train.lr = -1.0 must be > 0" in out
    assert "stopped on bad input: ConfigError (exit status 2): not restarted: a configuration or data error" in out
    assert "relaunching" not in out
    (stop,) = metrics(tmp_path / "run", "launch_stop")
    assert stop["reason"] == "bad_input" and stop["error"] == "ConfigError"


def test_hang_ended_by_the_watchdog_is_relaunched(tmp_path, digits, wrapper, reference):
    # The timeout guards every phase, saves too: 10 s ended a save whose fsync waited behind another test's
    # gigabyte of writes (a second, unplanned restart); 30 s leaves a busy disk room and still ends the hang.
    code, out = launch(tmp_path, digits, wrapper, ["-n", "2"], extra=["train.step_timeout=30"],
                       env={"SUPERVISED_KILL_STEP": "5", "SUPERVISED_KILL_RANK": "1", "SUPERVISED_ACTION": "hang",
                            "SUPERVISED_MARKER": str(tmp_path / "hung")})
    assert code == 0, out[-6000:]
    assert "hung in step 5 and the watchdog ended the job; restart 1 of at most 3: 2 -> 2 rank(s)" in out
    (restart,) = metrics(tmp_path / "run", "restart")
    assert (restart["cause"], restart["status"], restart["step"], restart["source"]) == ("hang", 4, 5, "record")
    assert (restart["failed_step"], restart["resume_step"], restart["steps_lost"]) == (4, 3, 1)
    assert_same_training(tmp_path, reference)


def test_a_launch_stuck_in_start_up_is_ended_and_relaunched(tmp_path, digits, wrapper, reference):
    """Rank 1 of the first launch never reaches MPI (rank 0 waits in MPI's start-up for it): no watchdog runs
    yet, so the supervisor ends the launch after --start-timeout and relaunches; the run is the uninterrupted one.
    20 s: the ranks' start-up on a loaded machine stays well inside it (a second restart would fail the test)."""
    code, out = launch(tmp_path, digits, wrapper, ["-n", "2", "--start-timeout", "20"],
                       env={"SUPERVISED_START_HANG": str(tmp_path / "hung"), "SUPERVISED_KILL_RANK": "1"})
    assert code == 0, out[-6000:]
    assert (tmp_path / "hung").read_text() == "rank 1 hangs in start-up\n"
    assert "the ranks did not get through start-up (imports, MPI) in 20 s: the launch was ended; restart 1 of at " \
           "most 3: 2 -> 2 rank(s)" in out, out[-6000:]
    (restart,) = metrics(tmp_path / "run", "restart")
    assert (restart["cause"], restart["source"], restart["resume_step"]) == ("stalled", "supervisor", 0), restart
    assert restart["launch_seconds"] >= 20, restart
    assert "done after 1 restart(s)" in out
    assert_same_training(tmp_path, reference)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_goes_to_the_ranks_and_is_passed_on_not_restarted(tmp_path, digits, wrapper, sig):
    """SIGUSR1 (Slurm's warning signal to the batch script) or SIGTERM (scancel, a job's end) to the
    supervisor: the ranks save the step they stopped at, nothing trained is lost (no periodic save
    would have caught it), no node-local snapshot is left in node memory, and the supervisor exits 3
    without relaunching, so that a job script can requeue."""
    import time

    order_dir = tmp_path / "order"
    order_dir.mkdir()
    (tmp_path / "local").mkdir()
    cmd = [PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--python", str(wrapper), "examples/digits.toml",
           *overrides(tmp_path / "run", digits), "train.max_steps=0", "checkpoint.every_steps=0",
           "checkpoint.on_epoch_end=false", "checkpoint.local=true", "checkpoint.local_every_steps=2",
           f"checkpoint.local_dir={tmp_path / 'local'}"]
    env = mpi_env({"SUPERVISED_ORDER": str(order_dir), "SUPERVISED_STEP_SLEEP": "0.2"})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not list(order_dir.glob("rank-*.jsonl")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(out[-3000:])
    assert proc.returncode == 3, out[-6000:]
    assert (f"stopped by signal {int(sig)} (passed on to the ranks as a request to save and stop): not "
            f"restarted; exit status 3") in out
    assert "relaunching" not in out
    step = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert step > 0 and latest_step(tmp_path / "run")[0] == step, out[-3000:]
    # the node-local snapshots go with the stop: the HDF5 file of the same step holds what they held
    assert not [p for p in (tmp_path / "local").rglob("*") if p.is_file()], out[-3000:]
    # and so do the warm spares, started or starting: no rank of them is left
    assert not [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path / "run") in _cmdline(p)]


def _pids(run_dir, spare):
    """Ranks of the run in ``run_dir`` (not mpirun, not the supervisor): those of a warm spare set or not."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        cmd = _cmdline(pid)
        if f"run.run_dir={run_dir}" not in cmd or " train " not in cmd or " launch " in cmd or "mpirun" in cmd:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                is_spare = b"HPCTRAIN_SPARE_CALL=" in f.read()
        except OSError:
            continue
        if is_spare == spare:
            found.append(int(pid))
    return found


def test_a_spare_set_over_its_memory_bound_is_ended_and_the_relaunch_starts_cold(tmp_path, digits, wrapper,
                                                                                   reference):
    """--spares-memory 1 (MiB): the first line says the bound; the set, once up, holds more, is ended and said
    so, and no other is started; a training rank killed after that is relaunched cold, training as if uninterrupted."""
    code, out = launch(tmp_path, digits, wrapper, ["-n", "2", "--spares-memory", "1"], spares=True,
                       env={"SUPERVISED_KILL_STEP": "5", "SUPERVISED_KILL_RANK": "1",
                            "SUPERVISED_MARKER": str(tmp_path / "killed"),
                            # a set was started (the folder is made first, kept until the end): up or not, the
                            # relaunch weighs it; its ready file can come and go between two looks of the rank
                            "SUPERVISED_KILL_AFTER": str(tmp_path / "run" / ".spares")})
    assert code == 0, out[-6000:]
    first = next(line for line in out.splitlines() if line.startswith("hpctrain launch: run directory"))
    assert first.endswith("said once up, at most 1 MiB (--spares-memory); --spares 0: none)"), first
    assert re.search(r"warm spares: 2 rank\(s\) holding \d+ MiB resident, more than --spares-memory 1 MiB: ended, "
                     r"and no more sets \(relaunches start cold\)", out), out[-6000:]
    assert out.count("holding") == 1 and "warm spares ready" not in out and "calling the warm spares" not in out
    assert "relaunching 2 rank(s)" in out and "done after 1 restart(s)" in out
    assert [s["spare"] for s in metrics(tmp_path / "run", "start")] == [False, False]
    assert not (tmp_path / "run" / ".spares").exists() and not _pids(tmp_path / "run", True)
    assert_same_training(tmp_path, reference)


def test_a_spare_set_that_ends_early_is_replaced_and_the_next_is_called(tmp_path, digits, wrapper):
    """A warm spare rank killed while its set waits: the supervisor says so and starts another set, never
    calling the broken one. A training rank killed next: the new set is called (its restart cost counts from
    the call), resumes from the newest checkpoint, and SIGUSR1 then saves and ends it, with every spare gone."""
    import time

    run = tmp_path / "run"
    cmd = [PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--python", str(wrapper), "examples/digits.toml",
           *overrides(run, digits), "train.max_steps=0", "train.epochs=1000"]  # ended by the SIGUSR1 below:
    # a loaded machine brings the spare sets up slowly, and a run of the example's epochs could end first
    with Watched(cmd, {"SUPERVISED_STEP_SLEEP": "0.05"}) as launch:
        launch.wait_for("warm spares ready: 2 rank(s)")
        os.kill(_pids(run, spare=True)[0], signal.SIGKILL)
        launch.wait_for("warm spares: the set ended before it was needed")
        launch.wait_for("warm spares ready: 2 rank(s)", count=2)
        os.kill(_pids(run, spare=False)[0], signal.SIGKILL)
        launch.wait_for("hpctrain launch: calling the warm spares 2 rank(s)")
        launch.wait_for("hpctrain: resumed from")
        launch.wait_for("loss", count=sum("loss" in line for line in launch.lines) + 1)  # a step after the resume
        launch.proc.send_signal(signal.SIGUSR1)
        launch.end()
    out = launch.out
    assert launch.proc.returncode == 3, out[-6000:]
    assert out.count("calling the warm spares") == 1 and "relaunching" not in out
    step = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert latest_step(run)[0] == step
    (restart,) = metrics(run, "restart")
    # the newest checkpoint, of the last logged step or of the one after it (a step's checkpoint is written before
    # its log line, so a kill between the two leaves a checkpoint one step past the last logged step)
    assert restart["resume_step"] <= restart["failed_step"] + 1 and restart["resume_step"] < step
    starts = metrics(run, "start")
    assert [s["spare"] for s in starts] == [False, True]
    assert not (run / ".spares").exists()
    gone = time.monotonic() + 10  # SIGKILLed by the supervisor's end: the kernel may take a moment to end them
    while (_pids(run, True) or _pids(run, False)) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not _pids(run, True) and not _pids(run, False)


def _children(pid):
    found = []
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append((int(entry), int(fields[16])))  # (pid, niceness)
    return found


def _called(pid):
    """Whether the warm spare rank ``pid`` was called (its call file exists)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        call = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)[b"HPCTRAIN_SPARE_CALL"]
    return os.path.exists(call)


def test_the_default_launch_forks_every_rank_from_its_warm_pool(tmp_path, digits):
    """No --python, no option: the warm pool comes up before the first launch and the first line says what it
    holds; the ranks, the warm spares and the relaunches are forked from it. A forked training rank killed, then
    the process mpirun started for a rank (its stand-in) killed: each is a rank's death to the supervisor, which
    calls the spares, forked again; SIGUSR1 saves and ends the run, and the pool and every rank are gone."""
    import time

    run = tmp_path / "run"
    cmd = [PYTHON, "-m", "hpctrain", "launch", "-n", "2", "examples/digits.toml", *overrides(run, digits),
           "train.max_steps=0", "train.epochs=100000", "train.step_timeout=60"]
    with Watched(cmd) as launch:
        launch.wait_for("warm pool up in")
        (pool,) = [pid for pid, _ in _children(launch.proc.pid) if "--warm-pool-serve" in _cmdline(pid)]
        launch.wait_for("warm spares ready: 2 rank(s)")
        training = [pid for pid, nice in _children(pool) if nice == 0]  # the spares wait at the lowest priority
        assert len(training) == 2 and len(_children(pool)) == 4, _children(pool)
        os.kill(training[0], signal.SIGKILL)
        launch.wait_for("hpctrain launch: calling the warm spares 2 rank(s)")
        launch.wait_for("hpctrain: resumed from")
        launch.wait_for("warm spares ready: 2 rank(s)", count=2)
        stand_in = next(pid for pid in _pids(run, spare=True) if _called(pid))  # of the set called
        assert _children(stand_in) == [], "a stand-in's rank is the pool's child, not its own"
        os.kill(stand_in, signal.SIGKILL)
        launch.wait_for("hpctrain launch: calling the warm spares 2 rank(s)", count=2)
        launch.wait_for("hpctrain: resumed from", count=2)
        launch.wait_for("loss", count=sum("loss" in line for line in launch.lines) + 1)  # a step after the resume
        launch.proc.send_signal(signal.SIGUSR1)
        launch.end()
    out = launch.out
    assert launch.proc.returncode == 3, out[-6000:]
    assert re.search(r"warm pool up in [\d.]+ s, \d+ MiB resident: this host's ranks are forked from it", out)
    assert "relaunching" not in out and "warm pool not used" not in out
    restarts = metrics(run, "restart")
    assert [r["signal"] for r in restarts] == [9, 9], restarts
    starts = metrics(run, "start")
    assert [(s["spare"], s["forked"]) for s in starts] == [(False, True), (True, True), (True, True)], starts
    step = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert latest_step(run)[0] == step
    gone = time.monotonic() + 10
    while _children(pool) or os.path.exists(f"/proc/{pool}") and time.monotonic() < gone:
        time.sleep(0.1)
    assert not _children(pool) and not os.path.exists(f"/proc/{pool}")
    assert not _pids(run, True) and not _pids(run, False)


def test_a_failed_ranks_survivor_keeps_the_state_of_its_last_step(tmp_path, digits):
    """The default launch (warm pool), no snapshot or checkpoint file during the run: a training rank SIGKILLed
    mid-run, the survivor writes the state of the last step it finished, the relaunch resumes from that step (the
    last logged one, or the one after it) and ends with the parameters of an uninterrupted run, bit for bit."""
    import time

    steps = 600
    config = ["examples/digits.toml", f"data.path={digits}", f"train.max_steps={steps}", "train.epochs=100000",
              "train.global_batch_size=48", "checkpoint.every_steps=100000", "checkpoint.on_epoch_end=false",
              "checkpoint.local_every_steps=100000", "monitor.log_every=1", "monitor.progress=log", "data.val=none"]
    base = tmp_path / "reference"
    mpirun(2, ["-m", "hpctrain", "train", *config, f"run.run_dir={base}"], timeout=LAUNCH_TIMEOUT, check=True)
    reference = tensors(Path(base) / "checkpoints" / (Path(base) / "checkpoints" / "latest").read_text().strip())

    run = tmp_path / "run"
    with Watched([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--spares", "0", *config,
                  f"run.run_dir={run}"]) as launch:
        launch.until(lambda: (run / "metrics.jsonl").exists() and any(r["step"] >= 150 for r in metrics(run, "train")),
                     "step 150", poll=0.02)
        (pool,) = [pid for pid, _ in _children(launch.proc.pid) if "--warm-pool-serve" in _cmdline(pid)]
        ranks = [pid for pid, _ in _children(pool)]
        assert len(ranks) == 2, ranks
        os.kill(RNG.choice(ranks), signal.SIGKILL)
        time.sleep(0.5)  # what was logged before the kill: the survivor, waiting for the dead rank, logs no more
        logged = max(r["step"] for r in metrics(run, "train"))
        launch.end()
    out = launch.out
    assert launch.proc.returncode == 0, out[-6000:]
    assert "a failed rank costs the step in flight: a rank that survives it writes the state" in out
    kept = re.search(r"hpctrain launch: rank (\d), a survivor, wrote the state of step (\d+) to the node-local level",
                     out)
    assert kept, out[-6000:]
    step = int(kept.group(2))
    assert logged <= step <= logged + 1, (logged, step)
    assert f"recovered step {step} from the node-local checkpoints" in out
    assert f"resuming from step {step} (a survivor's state)" in out
    (restart,) = metrics(run, "restart")
    assert (restart["kept_step"], restart["resume_step"]) == (step, step), restart
    assert [s["step"] for s in metrics(run, "start")] == [0, step]
    got = tensors(Path(run) / "checkpoints" / (Path(run) / "checkpoints" / "latest").read_text().strip())
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
