"""Rank-0 coordination and failure handling under a real mpirun."""
import socket

import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_on_root_and_all_or_none(n):
    result = mpirun(n, ["tests/mpi/coordination_roles.py"], timeout=120).check()
    for rank in range(n):
        assert f"rank {rank}: coordination ok" in result.stdout


@pytest.mark.parametrize("n,failing", [(2, 1), (4, 2)])
def test_exception_on_one_rank_aborts_the_job(n, failing):
    result = mpirun(n, ["tests/mpi/abort_on_error.py", str(failing)], timeout=120, fresh=True)
    assert result.returncode != 0
    assert f"unhandled exception on rank {failing} ({socket.gethostname()})" in result.stderr
    assert "RuntimeError: injected failure" in result.stderr
    assert "barrier passed" not in result.stdout
