"""A failure on one rank ends the whole job quickly, with the rank and host named: an
exception (coordination.abort_on_exception) and a hang (hpctrain.job.watchdog), under a real
mpirun; the watchdog's own logic in a single process."""
import socket
import subprocess
import textwrap
import time

import pytest

from mpi_harness import PYTHON, ROOT, mpi_env, mpirun

HOST = socket.gethostname()


@pytest.mark.mpi
@pytest.mark.parametrize("n,failing", [(2, 1), (4, 0), (4, 3)])
def test_exception_on_one_rank_ends_every_rank(n, failing):
    start = time.monotonic()
    result = mpirun(n, ["tests/mpi/fail_raise.py", str(failing)], timeout=120, fresh=True)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.output
    assert f"unhandled exception on rank {failing} ({HOST}); aborting all {n} ranks" in result.stderr
    assert f"ValueError: injected failure on rank {failing}" in result.stderr
    assert "allreduce passed" not in result.stdout
    assert result.stdout.count("started") == n
    # startup of n Python ranks on 2 shared cores is most of this; a hang would take 120 s
    assert elapsed < 45, f"took {elapsed:.1f}s"


@pytest.mark.mpi
@pytest.mark.parametrize("n,hanging", [(2, 1), (4, 2)])
def test_watchdog_ends_a_hung_job_with_stacks(n, hanging):
    start = time.monotonic()
    result = mpirun(n, ["tests/mpi/fail_hang.py", str(hanging), "3"], timeout=120, fresh=True)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.output
    err = result.stderr
    assert f"hpctrain: watchdog: rank {hanging} on {HOST}: step 2 still running after 3 s" in err
    # faulthandler's dump of every thread: the watchdog thread and the hung main thread
    assert "(most recent call first)" in err
    assert "in slow_io_that_never_returns" in err and "fail_hang.py" in err
    assert "finished" not in result.stdout
    assert elapsed < 60, f"took {elapsed:.1f}s"


def _run_python(code, timeout=60, env=None):
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=mpi_env(env))


def test_watchdog_single_process_exits_with_its_status():
    proc = _run_python("""
        import time
        from hpctrain.job.watchdog import Watchdog
        w = Watchdog(timeout=0.5, where="rank 0 on testhost", grace=0)
        with w.step(7):
            time.sleep(30)
    """)
    assert proc.returncode == 4, proc.stderr
    assert "hpctrain: watchdog: rank 0 on testhost: step 7 still running after 0.5 s" in proc.stderr
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr


def test_watchdog_quiet_when_steps_are_fast_and_between_steps():
    proc = _run_python("""
        import time
        from hpctrain.job.watchdog import Watchdog
        with Watchdog(timeout=0.4, grace=0) as w:
            for step in range(10):
                with w.step(step):
                    time.sleep(0.05)
                time.sleep(0.1)          # between steps: not watched
            time.sleep(1.0)              # disarmed: must not fire
            w.beat("heartbeat")          # beat re-arms ...
            time.sleep(0.2)
            w.beat("heartbeat")          # ... and restarts the clock
            time.sleep(0.2)
            w.disarm()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_watchdog_timeout_from_environment_and_off_by_default(monkeypatch):
    proc = _run_python("""
        from hpctrain.job.watchdog import Watchdog
        print(Watchdog().timeout, Watchdog().enabled)
    """, env={"HPCTRAIN_WATCHDOG_TIMEOUT": "12.5"})
    assert proc.stdout.split() == ["12.5", "True"], proc.stderr
    from hpctrain.job.watchdog import Watchdog

    monkeypatch.delenv("HPCTRAIN_WATCHDOG_TIMEOUT", raising=False)
    assert Watchdog().timeout == 0 and not Watchdog().enabled
    with pytest.raises(ValueError, match="must be >= 0"):
        Watchdog(timeout=-1)


def test_watchdog_per_section_timeout():
    proc = _run_python("""
        import time
        from hpctrain.job.watchdog import Watchdog
        w = Watchdog(timeout=0.3, where="rank 0 on h", grace=0)
        with w.step("checkpoint", timeout=3):
            time.sleep(0.6)              # longer than a step may take, shorter than a checkpoint
        print("ok", flush=True)
        with w.step("checkpoint", timeout=0.3):
            time.sleep(30)
    """)
    assert proc.stdout.strip() == "ok" and proc.returncode == 4, proc.stderr
    assert "checkpoint still running after 0.3 s" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("mode,failing,status,says", [
    ("exit3", 1, 3, "called sys.exit(3) alone"),
    ("exit0", 0, None, "called sys.exit(0) alone"),
    ("interrupt", 1, None, "KeyboardInterrupt"),
    ("base", 0, None, "Cancelled: injected on rank 0"),
])
def test_exit_or_base_exception_on_one_rank_ends_every_rank(mode, failing, status, says):
    # sys.exit, KeyboardInterrupt or any BaseException on one rank used to let that rank end
    # normally while the others waited in the allreduce forever.
    start = time.monotonic()
    result = mpirun(2, ["tests/mpi/exit_one_rank.py", str(failing), mode], timeout=60, fresh=True)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.output
    if status is not None:
        assert result.returncode == status, result.output
    assert f"rank {failing} ({HOST})" in result.stderr and "aborting all 2 ranks" in result.stderr, result.stderr
    assert says in result.stderr
    assert result.stdout.count("started") == 2 and "allreduce passed" not in result.stdout
    assert elapsed < 45, f"took {elapsed:.1f}s"


@pytest.mark.mpi
@pytest.mark.parametrize("mode,status", [("everywhere", 4), ("collective", 2)])
def test_exit_taken_by_every_rank_alike_ends_the_ranks_normally(mode, status):
    result = mpirun(2, ["tests/mpi/exit_one_rank.py", "0", mode], timeout=60, fresh=True)
    assert result.returncode == status, result.output
    assert "aborting" not in result.stderr and "MPI_ABORT" not in result.output
    assert result.stdout.count("started") == 2
    if mode == "collective":  # the same error on every rank, said once
        assert result.stderr.count("hpctrain: error: bad value") == 1, result.stderr
