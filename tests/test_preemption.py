"""Signals become a flag; ranks agree on it at a step boundary; requeue helper.
Single-process logic first, then a real mpirun with the signal sent to mpirun or to one rank."""
import os
import re
import signal
import subprocess
import textwrap
import time

import pytest

from hpctrain.job import preemption
from hpctrain.runtime import slurm
from mpi_harness import PYTHON, ROOT, mpi_env


@pytest.fixture
def installed():
    preemption.reset()
    preemption.install()
    yield
    preemption.uninstall()
    preemption.reset()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_sets_the_flag_only(installed, sig):
    assert not preemption.stop_requested() and preemption.reason() is None
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary
    assert preemption.stop_requested()
    assert preemption.reason() == sig.name
    os.kill(os.getpid(), signal.SIGUSR1)  # a second signal keeps the first reason
    assert preemption.reason() == sig.name
    preemption.reset()
    assert not preemption.stop_requested()


def test_uninstall_restores_previous_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    preemption.install()
    preemption.install()  # twice: still one level to undo
    assert signal.getsignal(signal.SIGUSR1) is not before
    preemption.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_job_id_naming():
    assert slurm.job_id({}) is None
    assert slurm.job_id({"SLURM_JOB_ID": "12"}) == "12"
    # inside an array, the bare SLURM_JOB_ID is this task's own id; requeue the task by name
    env = {"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm.job_id(env) == "12_3"


def test_requeue_outside_slurm_says_so(capsys):
    assert preemption.requeue_if_possible(environ={"PATH": "/usr/bin"}) is None
    assert "not running under Slurm" in capsys.readouterr().err


def test_requeue_without_scontrol_is_an_error(tmp_path):
    env = {"SLURM_JOB_ID": "77", "PATH": str(tmp_path)}  # an empty PATH directory
    with pytest.raises(preemption.RequeueError) as info:
        preemption.requeue_if_possible(environ=env)
    text = str(info.value)
    assert "cannot requeue Slurm job 77" in text and "scontrol" in text and "HINT:" in text
    assert info.value.exit_code != 0


def test_requeue_command_exit_status_without_scontrol(tmp_path):
    env = dict(os.environ, SLURM_JOB_ID="77", PATH=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run([PYTHON, "-m", "hpctrain.job.preemption", "requeue"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "`scontrol` is not on PATH" in proc.stderr
    env.pop("SLURM_JOB_ID")
    proc = subprocess.run([PYTHON, "-m", "hpctrain.job.preemption", "requeue"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 1 and "not running under Slurm" in proc.stderr


# A training loop in miniature: the agreement the trainer makes at each step boundary.
LOOP = textwrap.dedent("""
    import os, sys, time
    from mpi4py import MPI
    from hpctrain.job import preemption
    from hpctrain.runtime.coordination import any_rank

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    preemption.install()
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    for step in range(600):
        comm.allreduce(step)          # stands for the gradient all-reduce
        time.sleep(0.05)
        if step == 5:
            print(f"rank {rank}: ready", flush=True)
        if any_rank(preemption.stop_requested(), comm):
            print(f"rank {rank}: stop at step {step} (own signal: {preemption.reason()})", flush=True)
            sys.exit(preemption.EXIT_PREEMPTED)
    print(f"rank {rank}: ran to the end", flush=True)
""")


def _start_loop(tmp_path, n):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    cmd = ["mpirun", "-n", str(n), "--timeout", "90", PYTHON, str(script)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=mpi_env(), cwd=ROOT)


def _wait_ready(proc, n):
    lines, pids, ready = [], {}, 0
    deadline = time.monotonic() + 60
    while ready < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        # lines of different ranks may run together: search, do not match
        pids.update({int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", line)})
        ready += line.count(": ready")
    assert ready == n, "".join(lines)
    return pids, lines


def _finish(proc, lines):
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the ranks did not stop after the signal:\n" + "".join(lines))
    return "".join(lines) + out


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_signal_to_one_rank_stops_all_at_the_same_step(tmp_path, n):
    proc = _start_loop(tmp_path, n)
    pids, lines = _wait_ready(proc, n)
    os.kill(pids[n - 1], signal.SIGUSR1)  # as Slurm may signal only some tasks
    out = _finish(proc, lines)
    assert proc.returncode == preemption.EXIT_PREEMPTED, out
    stops = re.findall(r"rank (\d+): stop at step (\d+) \(own signal: (\w+)\)", out)
    assert sorted(int(r) for r, _, _ in stops) == list(range(n)), out
    assert len({s for _, s, _ in stops}) == 1, f"ranks stopped at different steps:\n{out}"
    assert {r: why for r, _, why in stops}[str(n - 1)] == "SIGUSR1"
    assert "ran to the end" not in out


@pytest.mark.mpi
def test_signal_to_mpirun_reaches_the_ranks(tmp_path):
    proc = _start_loop(tmp_path, 2)
    _, lines = _wait_ready(proc, 2)
    proc.send_signal(signal.SIGUSR1)  # mpirun forwards SIGUSR1 to every rank
    out = _finish(proc, lines)
    assert proc.returncode == preemption.EXIT_PREEMPTED, out
    assert out.count("(own signal: SIGUSR1)") == 2, out


# ---------------------------------------------------------------- a warning during start-up

def test_install_again_keeps_a_signal_received_before():
    preemption.reset()
    try:
        preemption.install()  # as hpctrain.cli.main does, before the slow imports
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        preemption.install()  # as `hpctrain train` does, later
        assert preemption.stop_requested() and preemption.reason() == "SIGUSR1"
    finally:
        preemption.uninstall()
        preemption.reset()


def test_cli_installs_the_handler_before_importing_train(monkeypatch):
    from hpctrain import cli

    seen = {}

    class Command:
        @staticmethod
        def main(argv):
            return 0

    def import_module(name):
        seen[name] = signal.getsignal(signal.SIGUSR1)
        return Command

    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    try:
        assert cli.main(["train", "x.toml"]) == 0
        assert seen["hpctrain.commands.train"] is preemption._handler
    finally:
        preemption.uninstall()
        preemption.reset()
    # other commands keep the default handlers: a stop signal still ends them
    assert cli.main(["report", "x"]) == 0
    assert seen["hpctrain.commands.report"] == before


# Runs `-m hpctrain ...`, holding the import of the training module (where torch, mpi4py and
# MPI start: the slow part of start-up) until this process got a stop signal.
HOLD_START = textwrap.dedent("""
    import importlib.abc, runpy, sys, time

    class Hold(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hpctrain.commands.train":
                sys.meta_path.remove(self)
                from hpctrain.job import preemption
                print("holding start-up", flush=True)
                deadline = time.monotonic() + 60
                while not preemption.stop_requested() and time.monotonic() < deadline:
                    time.sleep(0.05)
            return None

    sys.meta_path.insert(0, Hold())
    sys.argv = sys.argv[2:]
    runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
""")


@pytest.mark.mpi
def test_a_warning_during_start_up_stops_after_one_step_with_a_checkpoint(tmp_path):
    """The signal arrives before torch and MPI are up: the rank keeps it as the stop flag
    (not SIGUSR1's default action, death with status 138), trains one step, saves, exits 3."""
    from hpctrain.config import load_config
    from hpctrain.data import generate

    data = tmp_path / "digits.h5"
    generate(load_config(ROOT / "examples" / "digits.toml", [f"data.path={data}"]).data,
             load_config(ROOT / "examples" / "digits.toml").model, seed=0)
    script = tmp_path / "hold_start.py"
    script.write_text(HOLD_START)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, str(script), "-m", "hpctrain", "train", "examples/digits.toml",
                             f"data.path={data}", f"run.run_dir={run_dir}", "comm.backend=mpi"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(), cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "holding start-up"
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == preemption.EXIT_PREEMPTED, out
    assert "stop requested: saving at step 1" in out, out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "ckpt-00000001.h5"
