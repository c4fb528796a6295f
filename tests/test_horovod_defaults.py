"""hpctrain's Horovod settings: set where the user has not, and said (pure logic)."""
from hpctrain.backends.horovod_backend import CYCLE_MS, horovod_defaults


def test_cycle_time_is_set_when_the_user_has_not():
    env = {}
    said = horovod_defaults(env)
    assert env["HOROVOD_CYCLE_TIME"] == f"{CYCLE_MS:g}"
    assert said.startswith(f"cycle {CYCLE_MS:g} ms (hpctrain's default") and "HOROVOD_CYCLE_TIME" in said


def test_the_users_cycle_time_wins():
    env = {"HOROVOD_CYCLE_TIME": "5"}
    assert horovod_defaults(env) == "cycle 5 ms (HOROVOD_CYCLE_TIME)"
    assert env == {"HOROVOD_CYCLE_TIME": "5"}
