"""Checkpoint safety under a real mpirun (hpctrain issue 12): roll back and branches,
non-finite state refused, metadata checksum, failed `latest`, one-rank HDF5 errors."""
import pytest

from assertions import ranks_say
from mpi_harness import ROOT, mpirun

pytestmark = pytest.mark.mpi

SCRIPTS = ROOT / "tests" / "mpi"
TIMEOUT = 150


def test_load_latest_skips_damaged_and_ignores_resume_setting(tmp_path):
    result = mpirun(2, [SCRIPTS / "ckpt_safety.py", tmp_path, "load_latest"], timeout=TIMEOUT).check()
    ranks_say(result, "load_latest OK loaded ckpt-00000001.h5", 2)
    assert "skipping checkpoint" in result.stderr
