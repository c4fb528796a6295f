"""``hpctrain examples`` run from a checkout (test_install.py runs the installed one): it names the
checkout's examples/ and slurm/, copies them, and refuses to copy over what is there."""
import subprocess

from mpi_harness import PYTHON, ROOT


def examples(*args, cwd):
    return subprocess.run([PYTHON, "-m", "hpctrain", "examples", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_examples_names_copies_and_refuses_to_overwrite(tmp_path):
    shown = examples(cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"examples:    {ROOT / 'examples'}", f"job scripts: {ROOT / 'slurm'}"]

    copied = examples("--copy", "mywork", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert "next: cd mywork && sbatch slurm/train.sbatch examples/digits.toml" in copied.stdout
    for part in ("examples/digits.toml", "slurm/train.sbatch", "slurm/resilient.sbatch"):
        assert (tmp_path / "mywork" / part).read_bytes() == (ROOT / part).read_bytes(), part
    assert not list((tmp_path / "mywork").rglob("__pycache__"))

    (tmp_path / "mywork" / "examples" / "digits.toml").write_text("# mine\n")
    again = examples("--copy", "mywork", cwd=tmp_path)
    assert again.returncode == 2
    assert "already exist(s); nothing was copied" in again.stderr and "HINT:" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr
    assert (tmp_path / "mywork" / "examples" / "digits.toml").read_text() == "# mine\n"
