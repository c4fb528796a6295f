"""Bad input under ``mpirun -n 2 hpctrain train``: a configuration that is not text, a data file that is
not HDF5, a run directory below a regular file each end the job with one message that names the problem
and the fix, exit 2, no traceback; a ``latest`` that points out of the checkpoint directory is ignored
with a warning that says why and which checkpoint was taken instead."""
import re

import pytest

from mpi_harness import hpctrain

pytestmark = pytest.mark.mpi

TIMEOUT = 120


def _fails_cleanly(result, *texts):
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output and "unhandled exception" not in result.output, result.output[-3000:]
    for text in texts:
        assert text in result.stderr, result.output[-3000:]
    assert "HINT:" in result.stderr, result.output[-3000:]


def test_a_configuration_that_is_not_text_is_named(tmp_path):
    config = tmp_path / "job.toml"
    config.write_bytes(b"\x00\xff\xfe")
    result = hpctrain(2, "train", config, timeout=TIMEOUT)
    _fails_cleanly(result, f"{config} is not a text file", "UTF-8")


def test_a_data_file_that_is_not_hdf5_is_named(tmp_path):
    data = tmp_path / "data.h5"
    data.write_text("x,y\n1,2\n")
    result = hpctrain(2, "train", "examples/digits.toml", f"data.path={data}", "comm.backend=mpi",
                      f"run.root={tmp_path}/runs", timeout=TIMEOUT)
    _fails_cleanly(result, f"data file {data} cannot be read as HDF5", "data.path takes an HDF5 file")


def test_a_run_directory_below_a_regular_file_is_named(tmp_path, digits):
    regular = tmp_path / "notes.txt"
    regular.write_text("a file, not a directory\n")
    result = hpctrain(2, "train", "examples/digits.toml", f"data.path={digits}", "comm.backend=mpi",
                      f"run.run_dir={regular}/run", timeout=TIMEOUT)
    _fails_cleanly(result, f"cannot create the run directory {regular}/run", "set run.run_dir")
    assert regular.read_text() == "a file, not a directory\n"


def _train(tmp_path, digits, run_dir, steps):
    return hpctrain(2, "train", "examples/digits.toml", f"data.path={digits}", "comm.backend=mpi",
                    f"run.run_dir={run_dir}", f"train.max_steps={steps}", "checkpoint.resume=auto",
                    timeout=TIMEOUT).check()


def test_a_latest_pointer_out_of_the_checkpoint_directory_is_ignored_with_a_word(tmp_path, digits):
    # no checkpoint beside it: the run says so and starts from step 0
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "checkpoints" / "latest").write_text("../../../../etc/passwd\n")
    result = _train(tmp_path, digits, empty, 3)
    assert re.search(r"latest names '\.\./\.\./\.\./\.\./etc/passwd', which is not a checkpoint file name of "
                     r"this directory \(ckpt-<step>\.h5\): ignored; there is no checkpoint there, so the run "
                     r"starts from step 0", result.stderr), result.output[-3000:]
    assert "resumed from" not in result.output

    # a good checkpoint beside it: the warning names the one taken, and the run resumes from it
    run = tmp_path / "run"
    _train(tmp_path, digits, run, 4)
    (run / "checkpoints" / "latest").write_text("../../../../etc/passwd\n")
    result = _train(tmp_path, digits, run, 6)
    assert "ignored; resuming from the newest checkpoint there, ckpt-00000004.h5" in result.stderr, \
        result.output[-3000:]
    assert "resumed from" in result.output and "ckpt-00000004.h5" in result.output, result.output[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "ckpt-00000006.h5"
