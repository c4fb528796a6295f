"""The standby supervisor's pure logic (hpctrain.job.standby) and the rules it relies on: the tasks left
when the first node is lost, the job script's view it gives the supervisor, `hpctrain launch --exclude`,
and a run lock held on a node Slurm took out of the job. The real takeover (a 3-node Slurm cluster, n1
killed or cut off) is in test_slurm_multinode.py."""
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
                "ranks": 2, "timestamp": 31.0},
               {"kind": "job_end", "by": "standby", "host": "n2", "status": 0, "stood_still_s": 41.7,
                "timestamp": 60.0}]
    text = format_summary(summarize(records))
    assert ("first node lost: Slurm took n1 (job script, supervisor) out of the job after step 9; the standby on "
            "n2 relaunched 2 rank(s)") in text
    assert "the standby on n2 ended the job: status 0, training stood still 41.7 s" in text
