"""hpctrain's MPI settings, set before MPI starts and read back from the running Open MPI."""
import json

import pytest

from hpctrain.runtime.world import YIELD_VARIABLE, mpi_defaults
from mpi_harness import mpirun

PROBE = "tests/mpi/mpi_settings_probe.py"


def _probe(env, *args):
    out = mpirun(2, [PROBE, *args], env=env, timeout=60, check=True).stdout
    ranks = json.loads([line for line in out.splitlines() if line.startswith("[")][-1])
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    return ranks


def test_yield_is_set_when_the_user_has_not():
    env = {}
    said = mpi_defaults(env, mpi_started=False)
    assert env == {YIELD_VARIABLE: "1"}
    assert "hpctrain's default" in said and YIELD_VARIABLE in said


def test_the_users_setting_wins():
    env = {YIELD_VARIABLE: "0"}
    assert mpi_defaults(env, mpi_started=False) == f"MPI waits: {YIELD_VARIABLE}=0 (as set)"
    assert env == {YIELD_VARIABLE: "0"}


def test_too_late_is_said_with_the_fix():
    env = {}
    said = mpi_defaults(env, mpi_started=True)
    assert env == {} and "export it in the job script" in said


@pytest.mark.mpi
def test_open_mpi_takes_hpctrains_default():
    for rank in _probe({YIELD_VARIABLE: None}):  # as a user's mpirun starts it: unset
        assert rank["yield_when_idle"] == 1, rank
        assert "hpctrain's default" in rank["said"]


@pytest.mark.mpi
def test_open_mpi_keeps_the_users_choice():
    for rank in _probe({YIELD_VARIABLE: "0"}):
        assert rank["yield_when_idle"] == 0, rank
        assert rank["said"] == f"MPI waits: {YIELD_VARIABLE}=0 (as set)"


@pytest.mark.mpi
def test_mpi_started_first_keeps_open_mpis_default_and_says_so():
    for rank in _probe({YIELD_VARIABLE: None}, "mpi-first"):
        assert rank["yield_when_idle"] == 0, rank  # Open MPI's default where not oversubscribed
        assert "MPI started before hpctrain" in rank["said"]


@pytest.mark.mpi
def test_every_communicator_is_ready_for_object_reductions_before_training():
    """Else the first ``comm.allreduce`` of a step sets one up holding the GIL: a deadlock with Horovod."""
    result = mpirun(4, ["tests/mpi/object_reductions_ready.py"], timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("READY") == 4, result.stdout
