"""Checkpoint safety under a real mpirun (hpctrain issue 12): roll back and branches,
non-finite state refused, a failed `latest` write, a one-rank HDF5 error, a damaged direct write caught by the
verification, async overlap."""
import os
import re
import time

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


SCENARIOS = ["nan_refused", "nan_in_foreign_file", "rollback", "latest_write_fails", "fsync_fails_on_one_rank",
             "direct_write_damaged", "async_overlaps"]


def test_scenarios(tmp_path, capsys):
    result = mpirun(2, [SCRIPTS / "ckpt_safety.py", tmp_path, *SCENARIOS], timeout=TIMEOUT).check()
    for name in SCENARIOS:
        ranks_say(result, f"{name} OK", 2)
    for name in ("nan_refused", "latest_write_fails", "fsync_fails_on_one_rank", "direct_write_damaged"):
        ranks_say(result, f"{name} ERROR: ", 2)
    # a resumed run says so at the default level, on rank 0 only
    said = [line for line in result.stdout.splitlines() if line.startswith("hpctrain: resumed from")]
    assert f"hpctrain: resumed from {tmp_path}/rollback/ckpt-00000004.h5 at step 4 (epoch 0), written by 2 rank(s) " \
           "(mpio)" in said
    assert "moved to" in result.stderr and "abandoned" in result.stderr
    # `hpctrain ckpt list` shows the abandoned branches, and a NaN file as such
    from hpctrain.commands.ckpt import main

    capsys.readouterr()
    assert main(["list", str(tmp_path / "rollback")]) == 0
    out = capsys.readouterr().out
    assert out.count("ABANDONED branch abandoned/") == 2 and "went on from step 4" in out
    assert main(["list", str(tmp_path / "foreign")]) == 0
    out = capsys.readouterr().out
    assert "NaN" in out and "/model/fc2.weight: non-finite values" in out


def test_one_rank_hdf5_error_raises_everywhere_or_aborts(tmp_path):
    """Rank 1 cannot extend the file (RLIMIT_FSIZE, a real EFBIG inside HDF5's writes):
    every rank raises the same error, or the job aborts naming the file; never a hang."""
    start = time.monotonic()
    result = mpirun(2, [SCRIPTS / "ckpt_safety.py", tmp_path, "one_rank_cannot_extend"], timeout=TIMEOUT, fresh=True)
    assert time.monotonic() - start < TIMEOUT - 20, "the job waited until the harness's timeout"
    if result.returncode == 0:
        ranks_say(result, "one_rank_cannot_extend ERROR: ", 2)
        ranks_say(result, "one_rank_cannot_extend OK", 2)
    else:
        assert "did not finish in 10 s" in result.stderr and "aborting the job" in result.stderr, result.stderr[-3000:]
        assert re.search(r"hpctrain: error: rank \d on \S+: closing .*ckpt-00000002\.h5\.tmp-", result.stderr), result.stderr[-3000:]
        # Open MPI's own "MPI_ABORT was invoked" banner is not asserted: under a flood of
        # MPI-IO error lines its show_help relay can fail ("Data unpack would read past end
        # of buffer") and drop the banner although the abort happened.
    d = tmp_path / "one_rank"
    assert (d / "latest").read_text() == "ckpt-00000001.h5\n"
    assert sorted(n for n in os.listdir(d) if n.endswith(".h5")) == ["ckpt-00000001.h5"]
    from hpctrain.checkpoint import verify_checkpoint

    assert not verify_checkpoint(str(d / "ckpt-00000001.h5"))


def test_metadata_checksum_as_documented(tmp_path):
    """The recipe in docs/checkpoint-format.md, run with plain h5py on a file written by 2
    ranks, gives the stored metadata_crc32."""
    import subprocess
    import sys

    result = mpirun(2, [SCRIPTS / "ckpt_safety.py", tmp_path, "for_flips"], timeout=TIMEOUT).check()
    ranks_say(result, "for_flips OK", 2)
    doc = (ROOT / "docs" / "checkpoint-format.md").read_text()
    recipe = next(c for c in re.findall(r"```python\n(.*?)```", doc, re.S) if "metadata_crc32" in c)
    path = tmp_path / "flips" / "ckpt-00000002.h5"
    code = recipe.replace('"ckpt-00001200.h5"', repr(str(path))) + "\nprint('recipe ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert "recipe ok" in out.stdout, out.stderr
    # a version-2 file without its metadata checksum is damaged; a version-1 file (which never
    # had one) is read, with a warning that its attributes are unchecked
    import logging
    import shutil

    import h5py

    from hpctrain.checkpoint import verify_checkpoint

    stripped, old = tmp_path / "stripped.h5", tmp_path / "v1.h5"
    for target in (stripped, old):
        shutil.copy(path, target)
        with h5py.File(target, "r+") as f:
            del f.attrs["metadata_crc32"]
            if target == old:
                f.attrs["format_version"] = 1
    problems = verify_checkpoint(str(stripped))
    assert len(problems) == 1 and "metadata checksum (attribute metadata_crc32 of /) is missing" in problems[0]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hpctrain.checkpoint").addHandler(handler)
    try:
        assert verify_checkpoint(str(old)) == []
    finally:
        logging.getLogger("hpctrain.checkpoint").removeHandler(handler)
    assert any("version-1 checkpoint" in r.getMessage() and "not" in r.getMessage() for r in records)
