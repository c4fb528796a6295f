"""The standby supervisor's pure logic (hpctrain.job.standby) and the rules it relies on: the tasks left
when the first node is lost, the job script's view it gives the supervisor, `hpctrain launch --exclude`,
and a run lock held on a node Slurm took out of the job. The real takeover (a 3-node Slurm cluster, n1
killed or cut off) is in test_slurm_multinode.py."""
import socket
import threading

import pytest

from hpctrain.commands import launch
from hpctrain.job import runlock, standby
from hpctrain.runtime import slurm


def test_tasks_per_node_reads_slurms_compressed_counts():
    assert slurm.tasks_per_node("2(x2),1", ["n1", "n2", "n3"]) == {"n1": 2, "n2": 2, "n3": 1}
    assert slurm.tasks_per_node("4", ["n1"]) == {"n1": 4}
    assert slurm.tasks_per_node("2(x3)", ["n1", "n2"]) is None  # does not match the hosts: unsure
    assert slurm.tasks_per_node("two", ["n1"]) is None


def test_remaining_ranks_leave_out_the_lost_nodes_tasks():
    assert standby.remaining_ranks(5, "2(x2),1", ["n1", "n2", "n3"], "n1") == 3
    assert standby.remaining_ranks(5, "2(x2),1", ["n1", "n2", "n3"], "n3") == 4
    assert standby.remaining_ranks(6, "?", ["n1", "n2", "n3"], "n1") == 4  # an equal share when unsure


def test_the_supervisor_sees_the_jobs_tasks_not_the_standbys_step():
    env = slurm.job_script_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
                                      "SLURM_STEP_NUM_TASKS": "1", "PATH": "/bin"}, 6)
    assert env == {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "6", "SLURM_NPROCS": "6", "PATH": "/bin"}


def test_launch_exclude_needs_srun_and_nodes_left(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launch.main(["-n", "2", "--exclude", "n1", "examples/digits.toml", f"run.run_dir={tmp_path}"]) == 2
    assert "--exclude n1: leaving nodes out needs srun in an allocation of several nodes" in capsys.readouterr().err


@pytest.mark.parametrize("taken_out, verdict", [(True, "Slurm took n1 out of job 9"), (False, None)])
def test_a_lock_on_a_node_slurm_took_out_of_the_job_is_stale(monkeypatch, taken_out, verdict):
    monkeypatch.setattr(slurm, "left_allocation", lambda node, job: taken_out and node == "n1")
    monkeypatch.setattr(slurm, "step_active", lambda step: True)  # the old step may still be listed
    holder = {"slurm_job": "9", "slurm_step": "9.1", "slurm_restart": 0, "slurm_node": "n1", "host": "n1",
              "pid": 123}
    me = {"slurm_job": "9", "slurm_step": "9.2", "slurm_restart": 0, "slurm_node": "n2", "host": "n2"}
    assert runlock.stale_reason(holder, me) == verdict


def test_report_says_the_first_node_was_lost_and_how_long_training_stood_still():
    from hpctrain.monitoring.report import format_summary, summarize

    records = [{"kind": "start", "timestamp": 0.0, "hosts": ["n1", "n2", "n3"]},
               {"kind": "train", "step": 9, "steps": 9, "loss": 1.0, "timestamp": 1.0},
               {"kind": "takeover", "host": "n2", "lost": "n1", "last_step": 9, "seconds_since_last_step": 30.0,
                "ranks": 2, "timestamp": 31.0},  # as an older standby wrote it: Slurm's view alone
               {"kind": "takeover", "host": "n3", "lost": "n2", "noticed": "n2 stopped answering (10 s without its "
                "slurmd)", "last_step": 20, "seconds_since_last_step": 11.0, "ranks": 1, "timestamp": 50.0},
               {"kind": "job_end", "by": "standby", "host": "n2", "status": 0, "stood_still_s": 41.7,
                "timestamp": 60.0}]
    text = format_summary(summarize(records))
    assert ("first node lost (n1: job script, supervisor): Slurm took n1 out of the job, after step 9; the standby "
            "on n2 relaunched 2 rank(s)") in text
    assert ("first node lost (n2: job script, supervisor): n2 stopped answering (10 s without its slurmd), after "
            "step 20; the standby on n3 relaunched 1 rank(s)") in text
    assert "the standby on n2 ended the job: status 0, training stood still 41.7 s" in text


@pytest.mark.parametrize("lost, verdict", [("n1", "this job's standby found n1 lost"), ("n3", None), ("", None)])
def test_a_lock_on_a_node_the_standby_found_lost_is_stale(monkeypatch, lost, verdict):
    monkeypatch.setattr(slurm, "left_allocation", lambda node, job: False)  # Slurm has not noticed yet
    monkeypatch.setattr(slurm, "step_active", lambda step: True)
    monkeypatch.setenv("HPCTRAIN_LOST_NODES", lost)
    holder = {"slurm_job": "9", "slurm_step": "9.1", "slurm_restart": 0, "slurm_node": "n1", "host": "n1",
              "pid": 123}
    me = {"slurm_job": "9", "slurm_step": "9.2", "slurm_restart": 0, "slurm_node": "n2", "host": "n2"}
    assert runlock.stale_reason(holder, me) == verdict
    other_job = dict(holder, slurm_job="8")  # another job's lock is never this standby's to judge
    monkeypatch.setattr(slurm, "job_active", lambda job: True)
    assert runlock.stale_reason(other_job, me) is None


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def test_the_standby_takes_over_once_the_batch_host_stops_answering(monkeypatch, capsys):
    """A real TCP listener stands for the batch host's slurmd: answered, then closed (the node died)."""
    monkeypatch.setattr(slurm, "job_nodes", lambda job: ["n1", "n2"])  # Slurm still lists the node
    server = _listener()
    address = server.getsockname()

    def die_after_the_first_knock():
        conn, _ = server.accept()
        conn.close()
        server.close()

    threading.Thread(target=die_after_the_first_knock, daemon=True).start()
    how = standby.wait_for_loss("n1", "9", poll=0.05, address=address, grace=0.3, heartbeat=0.05)
    assert how.startswith("n1 stopped answering") and "without its slurmd" in how
    assert f"n1's slurmd at 127.0.0.1:{address[1]} answers" in capsys.readouterr().out


def test_a_standby_that_slurm_does_not_answer_either_does_not_take_over(monkeypatch):
    """The batch host silent and Slurm unsure (squeue failing): this node may be the one cut off, so no takeover
    until Slurm answers again (here: after 15 questions), and then the silence counts."""
    server = _listener()
    address = server.getsockname()
    asked = []

    def job_nodes(job):
        asked.append(job)
        if len(asked) == 2:
            server.close()  # heard once, then silent
        return ["n1", "n2"] if len(asked) == 1 or len(asked) > 15 else None

    monkeypatch.setattr(slurm, "job_nodes", job_nodes)
    monkeypatch.setattr(slurm, "job_active", lambda job: True)
    how = standby.wait_for_loss("n1", "9", poll=0.01, address=address, grace=0.05, heartbeat=0.01)
    assert how.startswith("n1 stopped answering") and len(asked) > 15


def test_a_slurmd_never_reached_leaves_the_standby_to_slurm(monkeypatch, capsys):
    server = _listener()
    address = server.getsockname()
    server.close()  # nothing listens there: never answered (a firewall), so silence proves nothing
    looks = []
    monkeypatch.setattr(slurm, "job_nodes",
                        lambda job: looks.append(job) or (["n1", "n2"] if len(looks) < 8 else ["n2"]))
    how = standby.wait_for_loss("n1", "9", poll=0.01, address=address, grace=0.05, heartbeat=0.02)
    assert how == "Slurm took n1 out of job 9"
    assert "cannot reach n1's slurmd" in capsys.readouterr().out


def test_the_standby_ends_with_the_job(monkeypatch):
    monkeypatch.setattr(slurm, "job_nodes", lambda job: None)
    monkeypatch.setattr(slurm, "job_active", lambda job: False)
    assert standby.wait_for_loss("n1", "9", poll=0.01, address=None) is None
