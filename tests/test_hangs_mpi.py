"""A rank hung outside the training step (evaluation, the final wait for a background checkpoint
save, the stop agreement, resume) ends the job through the watchdog: exit status 4 within the
timeout, the message naming the rank, the host and the phase (tests/mpi/hang_phase.py)."""
import re
import socket
import tempfile
import time

import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi

HOST = socket.gethostname()


@pytest.mark.parametrize("phase, label", [
    ("evaluation", "evaluation at step 4"),
    ("background-save", "final wait for a background checkpoint save"),
    ("stop", "stop agreement after step 3"),
    ("resume", "resume from a checkpoint"),
])
def test_a_rank_hung_in_a_phase_ends_the_job_naming_rank_host_and_phase(phase, label):
    out = tempfile.mkdtemp(prefix="hpctrain-hang-")
    start = time.monotonic()
    result = mpirun(2, ["tests/mpi/hang_phase.py", out, phase, "6"], timeout=90, fresh=True)
    elapsed = time.monotonic() - start
    assert result.returncode == 4, result.output[-4000:]
    assert "rank 1: stuck in" in result.stdout, result.output[-4000:]
    said = re.search(rf"hpctrain: watchdog: rank [01] on {re.escape(HOST)}: {re.escape(label)} still running "
                     rf"after 6 s", result.stderr)
    assert said, result.stderr[-4000:]
    assert "finished" not in result.stdout
    assert elapsed < 60, f"took {elapsed:.1f}s"
