"""Assertions shared by the tests that run scripts under mpirun."""


def ranks_say(result, text, n):
    """Each of ranks 0 .. n-1 printed the line ``RANK <rank> <text>...``."""
    for rank in range(n):
        assert f"RANK {rank} {text}" in result.stdout, (
            f"rank {rank} did not print {text!r}\n--- stdout\n{result.stdout[-4000:]}"
            f"\n--- stderr\n{result.stderr[-4000:]}")
