"""The non-finite policy's decision table (pure); the behaviour under mpirun is in test_nonfinite_mpi.py."""
import pytest

from hpctrain.config import LoopConfig
from hpctrain.training.nonfinite import choose_action


def section(policy, skips=3, rollbacks=2):
    t = LoopConfig()
    t.on_nonfinite, t.max_nonfinite_skips, t.max_rollbacks = policy, skips, rollbacks
    return t


@pytest.mark.parametrize("policy, skips, rollbacks, can_roll_back, action", [
    ("auto", 1, 0, True, "skip"),
    ("auto", 3, 0, True, "skip"),        # up to max_nonfinite_skips in a row
    ("auto", 4, 0, True, "rollback"),    # then back to the newest checkpoint
    ("auto", 4, 2, True, "stop"),        # rollbacks used up
    ("auto", 4, 0, False, "stop"),       # nothing to roll back to
    ("skip", 3, 0, True, "skip"),
    ("skip", 4, 0, True, "stop"),        # skip never rolls back
    ("rollback", 1, 0, True, "rollback"),
    ("rollback", 1, 2, True, "stop"),
    ("stop", 1, 0, True, "stop"),
])
def test_choose_action(policy, skips, rollbacks, can_roll_back, action):
    assert choose_action(section(policy), skips, rollbacks, can_roll_back) == action
