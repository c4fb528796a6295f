"""Bad input on the command line, in one process: one line that says what is wrong and what to do, a
non-zero exit, no traceback."""
import subprocess
import sys

import pytest

from mpi_harness import ROOT


def hpctrain(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("to, fmt, said, fix", [
    ("no/such/dir/x.pt", (), "the directory {tmp}/no/such/dir does not exist", "mkdir -p {tmp}/no/such/dir"),
    ("no/such/dir/x.safetensors", (), "the directory {tmp}/no/such/dir does not exist", "mkdir -p"),
    ("no/such/dir/x", ("--format", "hf"), "the directory {tmp}/no/such/dir does not exist", "mkdir -p"),
    ("afile/x.pt", (), "{tmp}/afile is a file, not a directory", "give --to a path in a directory"),
    ("adir", ("--format", "torch"), "it is a directory", "--format hf to write a directory"),
    ("afile", ("--format", "hf"), "--format hf writes a directory", "give --to a new or existing directory"),
])
def test_ckpt_export_to_a_path_it_cannot_write_says_so_in_one_line(tmp_path, to, fmt, said, fix):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    # The output is checked before the checkpoint is read: none is needed to get there.
    proc = hpctrain("ckpt", "export", tmp_path / "ckpt-00000001.h5", "--to", tmp_path / to, *fmt)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"hpctrain ckpt: error: cannot write {tmp_path / to}: "), line
    assert said.format(tmp=tmp_path) in line and fix.format(tmp=tmp_path) in line, line
