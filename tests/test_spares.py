"""Warm spare ranks (hpctrain.job.spares), the pure parts and one process: when a launch counts as
training, the supervisor check a waiting spare makes, and a spare set's output held back until it is
called. The spares under a real mpirun: tests/test_supervisor_mpi.py."""
import json
import os
import subprocess
import sys
import time

from hpctrain.job import spares
from hpctrain.job.launchers import Launch, kill_processes_with


def test_a_launch_trains_once_a_start_record_follows_the_launch(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "start", "step": 0}) + "\n")  # the launch before this one
    started = spares.training_started(str(metrics))
    assert not started()
    with open(metrics, "a") as f:
        f.write(json.dumps({"kind": "restart"}) + "\n" + '{"kind": "sta')  # a line still being written
    assert not started()
    with open(metrics, "a") as f:
        f.write('rt", "step": 6}\n')
    assert started() and started()
    assert spares.training_started(str(tmp_path / "none.jsonl"))() is False


def test_a_rank_that_is_not_a_spare_goes_on_and_a_spare_sees_its_supervisor_gone(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_SPARE_CALL", raising=False)
    assert spares.wait_until_called(world=None) is False  # not a spare: nothing to wait for, no MPI touched
    import socket

    host = socket.gethostname()
    assert not spares._owner_gone(f"{host}:{os.getpid()}")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert spares._owner_gone(f"{host}:{ended.pid}")
    assert not spares._owner_gone(f"another-host:{ended.pid}")  # cannot be checked from here: not gone
    assert not spares._owner_gone(None)


def test_a_spare_sets_output_is_held_back_until_it_is_called(capfd):
    launch = Launch([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                    dict(os.environ), quiet=True)
    try:
        for _ in range(100):
            if launch.tees[0].held:
                break
            time.sleep(0.05)
        assert "up" not in capfd.readouterr().out
        launch.pass_on()
        assert "up" in capfd.readouterr().out
    finally:
        launch.child.kill()
        launch.child.wait()
        launch.finish()


def test_ending_a_set_kills_the_ranks_of_its_call_and_no_other(tmp_path):
    """What a set's stop does after its mpirun ended: ranks mpirun was still starting live on otherwise."""
    def started(call):
        env = dict(os.environ, HPCTRAIN_SPARE_CALL=call)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)

    mine, other = started(str(tmp_path / "call-1-2")), started(str(tmp_path / "call-1-20"))
    try:
        kill_processes_with(f"HPCTRAIN_SPARE_CALL={tmp_path / 'call-1-2'}")
        assert mine.wait(timeout=30) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_a_set_that_does_not_fit_the_relaunch_is_ended_beside_it_and_gone_at_the_close(tmp_path):
    """The relaunch on other ranks (a node left out) starts cold at once: the set is ended beside it, not
    before it (a set with a rank on a lost node may take its launcher's grace to end), and surely by close()."""
    said = []
    slow_to_end = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(3), exit(0))); " \
                  "time.sleep(60)"
    keeper = spares.Spares(1, str(tmp_path / "run"), dict(os.environ),
                           lambda ranks: [sys.executable, "-c", slow_to_end, str(ranks)], said.append)
    keeper.keep_ready(2, lambda: True)
    for _ in range(200):
        if keeper.current is not None:
            break
        time.sleep(0.05)
    the_set = keeper.current
    assert the_set is not None and the_set.alive
    time.sleep(0.5)  # its SIGTERM handler installed
    assert keeper.take(1) is None
    assert said == ["warm spares not used (the relaunch runs on other ranks or nodes): starting the relaunch cold"]
    assert the_set.alive  # still ending (its handler takes 3 s) while the relaunch goes on
    keeper.close()
    assert not the_set.alive and not (tmp_path / "run" / ".spares").exists()
