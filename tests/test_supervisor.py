"""``hpctrain launch`` without ranks: what the launchers print (Open MPI's text as captured
from mpirun 4.1, srun's as Slurm prints it), the diagnosis, the relaunch decisions (nodes left
out, --shrink, --min-ranks, the global batch), the failure records and the report's lines.
The real launches are in test_supervisor_mpi.py."""
import json
import os
import signal
import subprocess
import sys

import pytest

from hpctrain.config import resolve_global_batch
from hpctrain.errors import ConfigError
from hpctrain.commands import launch
from hpctrain.job import diagnosis, relaunch
from hpctrain.job.launchers import Attempt, Mpirun, Srun, StepEnder
from hpctrain.job.plan import LaunchPlan
from hpctrain.job.relaunch import Supervisor
from hpctrain.runtime import coordination
from hpctrain.runtime import slurm

OMPI_KILLED = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""
OMPI_EXIT = """--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[22338,1],1]
  Exit code:    2
--------------------------------------------------------------------------
"""
OMPI_ABORT = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD
with errorcode 4.
"""
SRUN = """srun: error: node02: task 5: Killed
srun: launch/slurm: _step_signal: Terminating StepId=12.0
srun: error: node01: tasks 0-2,4: Exited with exit code 1
"""


def test_launcher_events_name_rank_host_and_signal_or_status():
    assert diagnosis.launcher_events(OMPI_KILLED) == [
        {"rank": 1, "host": "vm", "signal": 9, "status": None, "source": "mpirun"}]
    assert diagnosis.launcher_events(OMPI_EXIT) == [
        {"rank": 1, "host": None, "signal": None, "status": 2, "source": "mpirun"}]
    assert diagnosis.launcher_events(OMPI_ABORT) == [
        {"rank": 3, "host": None, "signal": None, "status": 4, "source": "mpirun"}]
    events = diagnosis.launcher_events(SRUN)
    assert events[0] == {"rank": 5, "host": "node02", "signal": 9, "status": None, "source": "srun"}
    assert [(e["rank"], e["host"], e["status"]) for e in events[1:]] == [(r, "node01", 1) for r in (0, 1, 2, 4)]


def test_a_killed_rank_is_the_cause_before_the_others_records():
    records = [{"kind": "exception", "rank": 0, "host": "node01", "status": 1, "error": "RuntimeError", "timestamp": 2}]
    f = diagnosis.diagnose(1, records, diagnosis.launcher_events(SRUN))
    assert (f.cause, f.rank, f.host, f.signal, f.restartable, f.source) == ("signal", 5, "node02", 9, True, "srun")
    assert f.describe() == "rank 5 on node02 was killed by signal 9 (SIGKILL)"


def test_tasks_srun_killed_after_a_failure_are_not_the_cause():
    text = "srun: error: node01: task 1: Exited with exit code 1\nsrun: error: node02: task 0: Killed\n"
    assert [e["rank"] for e in diagnosis.launcher_events(text)] == [1, 0]
    records = [{"kind": "exception", "rank": 1, "host": "node01", "status": 1, "error": "KeyError", "timestamp": 1}]
    f = diagnosis.diagnose(1, records, diagnosis.launcher_events(text))
    assert (f.cause, f.rank, f.host, f.error, f.source) == ("exception", 1, "node01", "KeyError", "record")
    f = diagnosis.diagnose(1, [], diagnosis.launcher_events(text))
    assert (f.cause, f.rank, f.host, f.status, f.source) == ("failure", 1, "node01", 1, "srun")


# A node lost inside an allocation with --no-kill (its slurmd killed, or cut off): the ranks
# elsewhere hang in a collective until the watchdog ends them, then srun names the node.
SRUN_NODE_LOST = """srun: error: n1: task 0: Exited with exit code 4
srun: launch/slurm: _step_signal: Terminating StepId=1.0
srun: error: n2: task 1: Killed
srun: error: Node failure on n3
"""


def test_a_node_slurm_lost_is_the_cause_before_the_hang_it_caused():
    assert diagnosis.launcher_events(SRUN_NODE_LOST)[-1] == {
        "rank": None, "host": "n3", "signal": None, "status": None, "source": "srun", "node_failure": True}
    records = [{"kind": "hang", "rank": 0, "host": "n1", "status": 4, "step": 10, "error": "Hang", "timestamp": 1}]
    f = diagnosis.diagnose(1, records, diagnosis.launcher_events(SRUN_NODE_LOST))
    assert (f.cause, f.host, f.rank, f.restartable, f.source) == ("node_failure", "n3", None, True, "srun")
    assert f.describe() == "node n3 failed (Slurm lost contact with it)"


@pytest.mark.parametrize("status,cause,restartable", [(2, "bad_input", False), (5, "diverged", False),
                                                      (3, "stopped", False), (1, "exception", True)])
def test_the_first_own_record_decides(status, cause, restartable):
    records = [{"kind": "error", "rank": 1, "error": "RemoteError", "status": 2, "timestamp": 1},  # a consequence
               {"kind": "error" if status != 1 else "exception", "rank": 2, "host": "n2", "status": status,
                "error": "X", "timestamp": 3},
               {"kind": "exception", "rank": 0, "host": "n1", "status": 1, "error": "Y", "timestamp": 4}]
    f = diagnosis.diagnose(status, records, diagnosis.launcher_events(OMPI_EXIT))
    assert (f.cause, f.rank, f.host, f.status, f.restartable, f.source) == \
        (cause, 2, "n2", status, restartable, "record")


def test_hang_record_and_exit_status_fallbacks():
    f = diagnosis.diagnose(4, [{"kind": "hang", "rank": 0, "host": "n1", "status": 4, "step": 7, "error": "Hang"}])
    assert (f.cause, f.step, f.restartable) == ("hang", 7, True)
    assert f.describe() == "rank 0 on n1 hung in step 7 and the watchdog ended the job"
    f = diagnosis.diagnose(2, [], diagnosis.launcher_events(OMPI_EXIT), hosts=["a", "b"])
    assert (f.cause, f.rank, f.host, f.restartable) == ("bad_input", 1, "b", False)
    assert diagnosis.diagnose(137, []).signal == 9 and diagnosis.diagnose(-15, []).signal == 15
    assert diagnosis.diagnose(4, [], diagnosis.launcher_events(OMPI_ABORT)).cause == "hang"


def test_record_appends_one_json_line_when_the_variable_is_set(tmp_path):
    path = tmp_path / "failures.jsonl"
    coordination.record("exception", rank=3, host="n7", status=1, error="KeyError", message="boom", environ={})
    assert not path.exists()
    env = {"HPCTRAIN_FAILURE_FILE": str(path)}
    coordination.record("exception", rank=3, host="n7", status=1, error="KeyError", message="boom", environ=env)
    coordination.record("hang", rank=0, host="n1", status=4, step=9, environ=env)
    first, second = coordination.read_records(path)
    assert (first["kind"], first["rank"], first["host"], first["error"], first["message"]) == \
        ("exception", 3, "n7", "KeyError", "boom")
    assert (second["kind"], second["step"], second["status"]) == ("hang", 9, 4)
    assert coordination.read_records(path, offset=len(path.read_text().splitlines()[0]) + 1) == [second]


def test_abort_on_exception_records_a_configuration_error(tmp_path, monkeypatch):
    from hpctrain.runtime.coordination import abort_on_exception

    monkeypatch.setenv("HPCTRAIN_FAILURE_FILE", str(tmp_path / "f.jsonl"))
    with pytest.raises(SystemExit) as exit_:
        with abort_on_exception(None, where="n1"):
            raise ConfigError("train.lr = -1.0 must be > 0", hint="set train.lr to a positive value")
    assert exit_.value.code == 2
    (rec,) = coordination.read_records(tmp_path / "f.jsonl")
    assert (rec["kind"], rec["rank"], rec["host"], rec["status"], rec["error"]) == ("error", 0, "n1", 2, "ConfigError")


# ---------------------------------------------------------------- decisions
class Scripted(Supervisor):
    """A supervisor whose launches are scripted Attempts; the commands it built are kept."""

    def __init__(self, plan, attempts):
        super().__init__(plan, environ={})
        self.attempts, self.commands = list(attempts), []

    def launch(self, ranks, relaunch):
        self.commands.append(self.command(ranks, relaunch))
        return self.attempts.pop(0)


def plan(tmp_path, launcher, ranks, **kw):
    return LaunchPlan("job.toml", ["train.lr=0.1"], str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints"),
                launcher, ranks, python="py", **kw)


def start(hosts):
    return {"kind": "start", "hosts": hosts}


def killed(rank, host, steps=()):
    text = f"mpirun noticed that process rank {rank} with PID 0 on node {host} exited on signal 9 (Killed)."
    return Attempt(137, text, [], [start(HOSTS)] + [{"kind": "train", "step": s} for s in steps], 1.0)


HOSTS = ["n1", "n1", "n2", "n2", "n3", "n3"]


def test_srun_leaves_the_failed_node_out_and_resumes(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "ckpt-00000010.h5").write_bytes(b"")
    p = plan(tmp_path, Srun(["--cpu-bind=cores"]), 6, hosts={"n1": None, "n2": None, "n3": None}, global_batch=48)
    sup = Scripted(p, [killed(3, "n2", steps=range(1, 14)), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0
    first, second = sup.commands
    assert first[:5] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "6"] and "--exclude" not in " ".join(first)
    assert second[:8] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "4", "--exclude=n2", "-N", "2"]
    assert second[8:] == ["--overlap", "--cpu-bind=cores", "py", "-m", "hpctrain", "train", "job.toml", "train.lr=0.1",
                          f"run.run_dir={tmp_path / 'run'}", "checkpoint.resume=auto"]
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (rec["kind"], rec["cause"], rec["rank"], rec["host"], rec["ranks_before"], rec["ranks_after"]) == \
        ("restart", "signal", 3, "n2", 6, 4)
    assert (rec["failed_step"], rec["resume_step"], rec["steps_lost"], rec["excluded"]) == (13, 10, 3, ["n2"])
    assert rec["changes"] == ["global batch 48 kept: 12 per rank x 4 ranks x 1"]


def test_srun_relaunches_on_the_same_node_as_a_step_beside_others(tmp_path):
    """One node: the relaunch cannot leave it out; its step, as a warm spare set's (the same command, to be
    called for it), may share the allocation's CPUs (--overlap); the first launch's does not need to."""
    p = plan(tmp_path, Srun(), 2, hosts={"n1": None}, spares=1)
    text = "srun: error: n1: task 1: Killed"
    one_node = Attempt(137, text, [], [start(["n1", "n1"])] + [{"kind": "train", "step": s} for s in (1, 2)], 1.0)
    sup = Scripted(p, [one_node, Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0
    first, second = sup.commands
    assert first[:6] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "2", "py"]
    assert second[:6] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "2", "--overlap"]
    assert sup.command(2, True, spare=True) == second


def test_a_task_that_died_of_a_signal_has_its_steps_other_tasks_on_this_node_ended_at_once(capsys):
    """srun's words, as they come (a chunk may end anywhere): a task SIGKILLed, srun terminating the step: the
    step's processes on this node are SIGKILLed, once, and another step's are left. A status or SIGTERM (a
    stop's save, a job's end) leaves the step to Slurm; so does a spare set's step until it is called."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours, other = [subprocess.Popen(sleeper, env=dict(os.environ, SLURM_JOB_ID="42", SLURM_STEP_ID=step))
                   for step in ("13", "1")]
    try:
        ender = StepEnder()
        for chunk in [b"srun: error: vm: task 1: Kil", b"led\nsrun: launch/slurm: _step_signal: Terminating StepId=42.1",
                      b"3\n", b"srun: error: vm: task 0: Killed\nsrun: Force Terminated StepId=42.13\n"]:
            ender(chunk)
        assert ours.wait(timeout=30) == -signal.SIGKILL and other.poll() is None
        assert capsys.readouterr().err.count("task 1 of step 42.13 died of signal 9: the step's other tasks on "
                                              "this node are ended now") == 1
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
    for words in ["task 0: Exited with exit code 3", "task 0: Terminated", None]:
        left = StepEnder()
        left.active = words is not None
        left(f"srun: error: vm: {words or 'task 0: Killed'}\n"
             f"srun: launch/slurm: _step_signal: Terminating StepId=43.0\n".encode())
        assert left.step is None, words


def test_srun_leaves_a_lost_node_out_although_the_ranks_hung(tmp_path):
    records = [{"kind": "hang", "rank": 0, "host": "n1", "status": 4, "step": 10, "error": "Hang", "timestamp": 1}]
    p = plan(tmp_path, Srun(), 3, hosts={"n1": None, "n2": None, "n3": None})
    lost = Attempt(1, SRUN_NODE_LOST, records, [start(["n1", "n2", "n3"])], 1.0)
    sup = Scripted(p, [lost, Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0
    assert sup.commands[1][:8] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "2", "--exclude=n3", "-N", "2"]
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (rec["cause"], rec["host"], rec["excluded"], rec["ranks_after"]) == ("node_failure", "n3", ["n3"], 2)


def test_unresponsive_nodes_from_sinfo():
    text = "n1 mix\nn2 mix*\nn3 idle\nn4 down*\nn5 drng\nn6 alloc\n"
    assert slurm.unresponsive_nodes(text, ["n6", "n5", "n4", "n3", "n2", "n1"]) == ["n5", "n4", "n2"]
    assert slurm.unresponsive_nodes("", ["n1"]) == []
    assert slurm.node_states(text)["n4"] == "down*"


def test_a_hang_with_a_node_slurm_says_is_not_responding_leaves_that_node_out(tmp_path, monkeypatch):
    # a network partition: every rank hung alike, srun names no node, Slurm's node state does
    asked = []
    monkeypatch.setattr(slurm, "sinfo", lambda nodes: asked.append(nodes) or "n1 mix\nn2 mix*\nn3 mix\n")
    down = iter(["mix*", "mix*", "down*"])  # flagged first, marked down two polls later
    monkeypatch.setattr(slurm, "node_state", lambda node: next(down))
    monkeypatch.setattr(slurm, "left_allocation", lambda node, job: False)
    monkeypatch.setattr(relaunch.time, "sleep", lambda s: None)
    records = [{"kind": "hang", "rank": 1, "host": "n2", "status": 4, "step": 10, "error": "Hang", "timestamp": 1}]
    text = ("MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\nwith errorcode 4.\n"
            "srun: error: n1: task 0: Killed\nsrun: error: n3: task 2: Exited with exit code 4\n"
            "srun: error: Timed out waiting for job step to complete\n")
    p = plan(tmp_path, Srun(), 3, hosts={"n1": None, "n2": None, "n3": None})
    sup = Scripted(p, [Attempt(4, text, records, [start(["n1", "n2", "n3"])], 1.0), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0 and asked == [["n1", "n2", "n3"]] and list(down) == []  # waited for "down"
    assert sup.commands[1][:8] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "2", "--exclude=n2", "-N", "2"]
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (rec["cause"], rec["host"], rec["source"], rec["failed_step"]) == ("node_failure", "n2", "slurm", 9)


def test_a_node_that_answers_slurm_again_is_not_waited_for_or_left_out(tmp_path, monkeypatch):
    # a rank's crash while Slurm briefly flagged a loaded node: once it answers again, the relaunch keeps it
    monkeypatch.setattr(slurm, "sinfo", lambda nodes: "n1 mix*\nn2 mix\nn3 mix\n")
    states = iter(["mix*", "mix"])
    monkeypatch.setattr(slurm, "node_state", lambda node: next(states))
    monkeypatch.setattr(slurm, "left_allocation", lambda node, job: False)
    monkeypatch.setattr(relaunch.time, "sleep", lambda s: None)
    text = "srun: error: n2: task 1: Segmentation fault\nsrun: error: n3: task 2: Killed\n"
    p = plan(tmp_path, Srun(), 3, hosts={"n1": None, "n2": None, "n3": None})
    sup = Scripted(p, [Attempt(1, text, [], [start(["n1", "n2", "n3"])], 1.0), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0 and list(states) == []
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rec["cause"] != "node_failure" and rec["host"] == "n2", rec
    assert "--exclude=n1" not in " ".join(sup.commands[1]), sup.commands[1]


def test_a_hang_with_every_node_responding_relaunches_on_the_same_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(relaunch, "NODE_CHECK_SECONDS", 0)
    monkeypatch.setattr(slurm, "sinfo", lambda nodes: "")
    records = [{"kind": "hang", "rank": 1, "host": "n2", "status": 4, "step": 10, "error": "Hang", "timestamp": 1}]
    p = plan(tmp_path, Srun(), 3, hosts={"n1": None, "n2": None, "n3": None})
    sup = Scripted(p, [Attempt(4, "", records, [start(["n1", "n2", "n3"])], 1.0), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0 and sup.commands[1][:5] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", "3"]
    assert "--exclude" not in " ".join(sup.commands[1])


def test_mpirun_on_several_hosts_gets_a_host_list_without_the_failed_one(tmp_path):
    sup = Scripted(plan(tmp_path, Mpirun(["--bind-to", "none"]), 6), [killed(5, "n3"), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0
    assert sup.commands[0][:3] == ["mpirun", "-n", "6"] and "--host" not in sup.commands[0]
    assert sup.commands[1][:7] == ["mpirun", "-n", "4", "--host", "n1:2,n2:2", "-x", "HPCTRAIN_FAILURE_FILE"]


def test_one_node_relaunches_at_the_same_size_unless_shrink(tmp_path):
    one = lambda: Attempt(137, OMPI_KILLED, [], [start(["vm"] * 4)], 1.0)  # noqa: E731
    same = Scripted(plan(tmp_path, Mpirun(), 4), [one(), Attempt(0, "", [], [], 1.0)])
    assert same.run() == 0 and same.commands[1][:3] == ["mpirun", "-n", "4"]
    shrunk = Scripted(plan(tmp_path, Mpirun(), 4, shrink=True), [one(), Attempt(0, "", [], [], 1.0)])
    assert shrunk.run() == 0 and shrunk.commands[1][:3] == ["mpirun", "-n", "3"]


def test_shrink_keeps_the_global_batch_on_the_largest_count_that_divides_it(tmp_path, capsys):
    one = lambda: Attempt(137, OMPI_KILLED, [], [start(["vm"] * 4)], 1.0)  # noqa: E731
    sup = Scripted(plan(tmp_path, Mpirun(), 4, shrink=True, global_batch=64), [one(), Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0 and sup.commands[1][:3] == ["mpirun", "-n", "2"]
    assert "train.global_batch_size = 64 does not divide over 3: 2 rank(s)" in capsys.readouterr().err
    sup = Scripted(plan(tmp_path, Mpirun(), 4, shrink=True, global_batch=64, min_ranks=3), [one()])
    assert sup.run() == 1
    err = capsys.readouterr().err
    assert "giving up: cannot keep the global batch on 3 rank(s): train.global_batch_size = 64 is not divisible" in err
    assert "HINT: use a multiple of 3" in err


def test_min_ranks_and_max_restarts_stop_with_why(tmp_path, capsys):
    one = lambda: Attempt(137, OMPI_KILLED, [], [start(["vm"] * 2)], 1.0)  # noqa: E731
    assert Scripted(plan(tmp_path, Mpirun(), 2, shrink=True, min_ranks=2), [one()]).run() == 1
    assert "giving up: 1 rank(s) would remain, fewer than --min-ranks 2" in capsys.readouterr().err
    sup = Scripted(plan(tmp_path, Mpirun(), 2, max_restarts=2), [one(), one(), one()])
    assert sup.run() == 1 and len(sup.commands) == 3
    assert "giving up: 2 restart(s) done, --max-restarts 2: not restarting again" in capsys.readouterr().err


def test_stop_on_request_is_passed_on_and_divergence_is_not_restarted(tmp_path, capsys):
    stopped = Attempt(3, "", [], [], 1.0)
    assert Scripted(plan(tmp_path, Mpirun(), 2), [stopped]).run() == 3
    assert "not restarted: stopped on request after saving (exit status 3)" in capsys.readouterr().err
    diverged = Attempt(5, "", [{"kind": "error", "rank": 0, "status": 5, "error": "NonFiniteError"}], [], 1.0)
    assert Scripted(plan(tmp_path, Mpirun(), 2), [diverged]).run() == 5
    assert "not restarted: training diverged" in capsys.readouterr().err


def test_a_stop_that_comes_after_a_failed_launch_ends_for_a_requeue(tmp_path, capsys):
    """SIGTERM or SIGUSR1 that reaches the supervisor once a launch has failed (its ranks gone: nothing to pass it
    on to) stops before the relaunch with exit status 3, as one sent while deciding; not with the launch's 1."""
    class StoppedAfter(Scripted):
        def launch(self, ranks, relaunch):
            attempt = super().launch(ranks, relaunch)
            self._forward(signal.SIGUSR1, None)  # no launcher running: it reaches no rank
            return attempt

    sup = StoppedAfter(plan(tmp_path, Mpirun(), 2), [killed(1, "vm", steps=[5])])
    assert sup.run() == 3 and len(sup.commands) == 1
    err = capsys.readouterr().err
    assert "stopped by signal 10 before relaunching: not restarted; exit status 3" in err, err


def test_main_refuses_bad_arguments_before_starting(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):  # as the suite's launches have them
        monkeypatch.setenv(name, "1")
    assert launch.main(["examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "-n RANKS was not given" in err and "not started" in err
    assert launch.main(["-n", "2", "examples/digits.toml", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err
    assert launch.main(["-n", "4", "examples/digits.toml", "train.global_batch_size=30"]) == 2
    assert "train.global_batch_size = 30 is not divisible" in capsys.readouterr().err
    assert launch.main(["-n", "0", "examples/digits.toml"]) == 2
    assert "-n 0: the ranks to start must be at least 1" in capsys.readouterr().err
    for bad in ("2", "-1"):
        assert launch.main(["-n", "2", "--spares", bad, "examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert f"--spares {bad}: the sets of warm spare ranks kept must be 0 or 1" in err and "not started" in err
    assert launch.main(["-n", "2", "--start-timeout", "-5", "examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "--start-timeout -5.0: seconds must be >= 0 (0: no limit)" in err and "not started" in err
    assert launch.main(["-n", "2", "--spares-memory", "-1", "examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "--spares-memory -1.0: MiB must be >= 0 (0: not bounded)" in err and "not started" in err
    if os.geteuid() == 0:  # Open MPI's refusal, said before a launch that would only repeat it
        monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", raising=False)
        assert launch.main(["-n", "2", "examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert "running as root" in err and "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in err
        assert launch.main(["-n", "4", "--mpirun-args=--allow-run-as-root", "examples/digits.toml",
                            "train.global_batch_size=30"]) == 2  # allowed: the next check speaks
        assert "train.global_batch_size = 30 is not divisible" in capsys.readouterr().err
        for name in ("PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM"):  # Open MPI 5's launcher
            monkeypatch.setenv(name, "1")
        assert launch.main(["-n", "4", "examples/digits.toml", "train.global_batch_size=30"]) == 2
        assert "train.global_batch_size = 30 is not divisible" in capsys.readouterr().err
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launch.main(["-n", "2", "examples/digits.toml"]) == 2
    assert "mpirun is not on PATH" in capsys.readouterr().err


def test_resolve_global_batch_raises_the_accumulation_only_when_needed():
    assert resolve_global_batch(48, 4, 1) == (12, 1, None)
    batch, accumulation, note = resolve_global_batch(48, 3, 3)
    assert (batch, accumulation) == (4, 4) and note.startswith("train.accumulation 3 -> 4")
    with pytest.raises(ConfigError, match="HINT: use a multiple of 3"):
        resolve_global_batch(64, 3, 1)


def test_report_lists_restarts_and_the_stop():
    from hpctrain.monitoring.report import format_summary, summarize

    records = [{"kind": "start", "timestamp": 0.0, "hosts": ["n1", "n2"]},
               {"kind": "train", "step": 5, "steps": 5, "loss": 1.0, "timestamp": 1.0},
               {"kind": "restart", "restart": 1, "cause": "signal", "rank": 1, "host": "n2", "ranks_before": 2,
                "ranks_after": 1, "failed_step": 5, "resume_step": 4, "steps_lost": 1, "timestamp": 2.0,
                "description": "rank 1 on n2 was killed by signal 9 (SIGKILL)"},
               {"kind": "launch_stop", "reason": "exhausted", "why": "1 restart(s) done, --max-restarts 1",
                "description": "rank 0 on n1 failed: KeyError (exit status 1)", "timestamp": 3.0}]
    text = format_summary(summarize(records))
    assert ("restarts: 1 (1 step(s) lost in all): step 5: rank 1 on n2 was killed by signal 9 (SIGKILL); "
            "2 -> 1 ranks, 1 step(s) lost") in text
    assert "not restarted: rank 0 on n1 failed: KeyError (exit status 1): 1 restart(s) done, --max-restarts 1" in text
    from hpctrain.monitoring.report import plot_loss

    labels = [line.get_label() for line in plot_loss(records).axes[0].get_lines()]
    assert "failure, relaunched (hpctrain launch)" in labels


def test_a_hang_on_several_nodes_is_relaunched_on_the_same_nodes(tmp_path):
    hang = Attempt(4, "", [{"kind": "hang", "rank": 2, "host": "n2", "status": 4, "step": 3, "timestamp": 1}],
                   [start(HOSTS)], 1.0)
    sup = Scripted(plan(tmp_path, Mpirun(), 6), [hang, Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0 and sup.commands[1][:3] == ["mpirun", "-n", "6"] and "--host" not in sup.commands[1]


def test_linear_lr_scaling_is_named_when_the_rank_count_changes(tmp_path, capsys):
    one = Attempt(137, OMPI_KILLED, [], [start(["vm"] * 2)], 1.0)
    sup = Scripted(plan(tmp_path, Mpirun(), 2, shrink=True, global_batch=48, lr_scaling="linear"),
                   [one, Attempt(0, "", [], [], 1.0)])
    assert sup.run() == 0
    assert 'train.lr_scaling = "linear": the learning rate is train.lr x 1 now, not x 2' in capsys.readouterr().err


def test_validate_says_what_it_changed_to_keep_the_global_batch():
    from hpctrain.config import load_config, validate

    cfg = load_config(None, ["data.path=x.h5", "train.global_batch_size=48", "train.accumulation=5"], environ={})
    resolved = validate(cfg, world_size=3)
    assert (resolved.train.batch_size, resolved.train.accumulation) == (2, 8)
    assert resolved.notes == ("train.accumulation 5 -> 8: the global batch 48 over 3 ranks is 16 per rank, which 5 "
                              "micro-batches do not divide",)
    assert "note" not in resolved.to_toml()  # said, not configured
    plain = load_config(None, ["data.path=x.h5", "train.global_batch_size=48", "train.accumulation=3"], environ={})
    assert not hasattr(validate(plain, world_size=4), "notes")


def test_restart_costs_lay_the_time_from_failure_to_the_next_step_out_in_parts():
    from hpctrain.monitoring.report import format_summary, restart_costs, summarize

    records = [{"kind": "start", "timestamp": 0.0, "hosts": ["n1"]},
               {"kind": "train", "step": 5, "steps": 5, "loss": 1.0, "timestamp": 10.0},
               {"kind": "restart", "restart": 1, "cause": "signal", "rank": 0, "host": "n1", "ranks_before": 2,
                "ranks_after": 2, "failed_step": 5, "resume_step": 3, "steps_lost": 2, "description": "killed",
                "launch_ended": 11.0, "timestamp": 11.5},
               {"kind": "start", "timestamp": 15.0, "hosts": ["n1"], "process_started": 11.75,
                "startup": {"imports": 2.0, "mpi": 0.5, "resume": 0.25}},
               {"kind": "train", "step": 4, "steps": 1, "loss": 1.0, "timestamp": 15.5}]
    (cost,) = restart_costs(records)
    assert cost == {"restart": 1, "total": 5.5, "logged": 5.5, "parts": {
        "launcher gone": 1.0, "decision": 0.5, "ranks started": 0.25, "imports": 2.0, "mpi": 0.5, "resume": 0.25,
        "monitor": 0.5, "first step": 0.5}}
    assert ("restart 1 cost 5.50 s from the last step to the first after it (5.50 s between the logged steps "
            "around it): launcher gone 1.00, decision 0.50, ranks started 0.25, imports 2.00, mpi 0.50, resume 0.25, "
            "monitor 0.50, first step 0.50") in format_summary(summarize(records))


def test_restart_costs_leave_out_the_steps_trained_between_the_logged_ones():
    """Steps are logged every 20: a survivor kept step 27 (7 steps after the last logged one, at 0.1 s a step),
    the relaunch resumed from 27 and logged step 40 (12 steps after the first one after the restart, at 0.05 s):
    those are training, not the restart's cost, which is the rest."""
    from hpctrain.monitoring.report import restart_costs

    records = [{"kind": "train", "step": 20, "steps": 20, "step_time": 0.1, "timestamp": 10.0},
               {"kind": "restart", "restart": 1, "failed_step": 20, "resume_step": 27, "kept_step": 27,
                "launch_ended": 11.0, "timestamp": 11.25},
               {"kind": "start", "timestamp": 11.75, "step": 27, "process_started": 11.5, "startup": {"resume": 0.125},
                "spare": True},
               {"kind": "train", "step": 40, "steps": 13, "step_time": 0.05, "timestamp": 12.5}]
    (cost,) = restart_costs(records)
    assert cost["logged"] == 2.5
    assert cost["total"] == pytest.approx(2.5 - 7 * 0.1 - 12 * 0.05)  # from step 27's end (10.7 s) to 28's (11.9 s)
    assert cost["parts"] == pytest.approx({"launcher gone": 0.3, "decision": 0.25, "spares called": 0.25, "resume": 0.125,
                             "monitor": 0.125, "first step": 0.15})
    assert sum(cost["parts"].values()) == pytest.approx(cost["total"])
    # without a survivor the last step before the failure is not known: the last logged one is taken
    del records[1]["kept_step"]
    assert restart_costs(records)[0]["total"] == pytest.approx(2.5 - 12 * 0.05)


def test_startup_parts_follow_each_other_from_the_process_start(monkeypatch):
    from hpctrain.runtime import startup

    clock = iter([100.0, 101.5, 103.0, 104.0])
    monkeypatch.setattr(startup, "_since", None)
    monkeypatch.setattr(startup, "process_started", lambda: 99.0)
    monkeypatch.setattr(startup, "_clock", lambda: next(clock))
    startup.mark("imports")
    startup.mark("mpi")
    assert startup.take() == {"imports": 1.0, "mpi": 1.5}  # from the process start, then from "imports"
    assert startup.take() == {}  # cleared: a second fit in this process reports its own parts


def test_mpirun_ends_the_other_ranks_of_a_failed_launch_without_a_grace(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_odls_base_sigkill_timeout", raising=False)
    cmd = Mpirun().command(2, None, ["python", "x.py"])
    assert cmd[cmd.index("--mca") + 1:cmd.index("--mca") + 3] == ["odls_base_sigkill_timeout", "0"]
    own = Mpirun(["--mca", "odls_base_sigkill_timeout", "3"]).command(2, None, ["python", "x.py"])
    assert own.count("odls_base_sigkill_timeout") == 1 and own[own.index("odls_base_sigkill_timeout") + 1] == "3"
    monkeypatch.setenv("OMPI_MCA_odls_base_sigkill_timeout", "2")
    assert "odls_base_sigkill_timeout" not in Mpirun().command(2, None, ["python", "x.py"])


def test_a_file_counts_as_written_once_its_inode_size_or_time_changes(tmp_path):
    """How the supervisor sees the ranks through start-up (rank 0 rewrites config.toml), on any node's clock."""
    from hpctrain.job.launchers import changed

    path = tmp_path / "config.toml"
    written = changed(path)
    assert not written()  # not there yet
    path.write_text("a")
    assert written()
    written = changed(path)
    assert not written()
    os.utime(path, ns=(1, 1))  # an older time than before still counts: another node's clock
    assert written()
    stalled = diagnosis.stalled(600)
    assert (stalled.cause, stalled.restartable, stalled.source) == ("stalled", True, "supervisor")
    assert stalled.describe() == "the ranks did not get through start-up (imports, MPI) in 600 s: the launch was ended"
