"""`hpctrain doctor` against the real stack, and its failure paths in real environments
that lack a piece (a site-packages view without Horovod, PyPI's serial h5py wheel, which
`make setup` downloads once so that these tests reach no network)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_harness import ROOT, mpi_env, mpirun

PY = sys.executable


def run_doctor(*args, env=None, python_args=(), timeout=120):
    return subprocess.run([PY, *python_args, "-m", "hpctrain", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or mpi_env(), cwd=ROOT)


def test_help_does_not_import_heavy_modules():
    code = ("import sys, hpctrain.cli as c; c.build_parser().format_help();"
            "heavy = [m for m in ('torch', 'horovod', 'h5py', 'mpi4py') if m in sys.modules];"
            "assert not heavy, heavy")
    subprocess.run([PY, "-c", code], check=True, timeout=60, cwd=ROOT)
    out = subprocess.run([PY, "-m", "hpctrain", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "doctor" in out.stdout and "train" in out.stdout


def test_doctor_json_reports_the_parallel_stack():
    proc = run_doctor("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["h5py_parallel"] is True
    assert "MPI" in doc["horovod_build"]["controllers"]
    assert doc["launcher"] == "none" and doc["size"] == 1
    for key in ("python", "torch", "numpy", "mpi4py", "mpi_library", "h5py", "hdf5", "horovod"):
        assert doc["versions"][key], key
    assert "Open MPI" in doc["versions"]["mpi_library"]
    assert "\0" not in doc["versions"]["mpi_library"]  # Open MPI's version string ends in one


def test_doctor_names_the_checkpoint_file_system_and_what_a_save_uses(tmp_path):
    proc = run_doctor("--checkpoint-dir", "/dev/shm", env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "ckpt I/O" in x)
    assert "/dev/shm: tmpfs at /dev/shm" in line and "aligned on 1 MiB" in line and "hints: none" in line
    assert "\0" not in proc.stdout and "[ok  ] mpi4py" in proc.stdout
    # Hints, as a user sets them for a save, and which of them MPI-IO kept for a file it opened there (in a
    # process of its own: MPI is not started in the test process).
    code = ("import sys; from hpctrain.checkpoint.io.iosettings import io_settings_for; "
            "from hpctrain.commands.doctor import _hints_kept; "
            "io = io_settings_for(sys.argv[1], io_hints={'striping_unit': 4 << 20, 'romio_cb_write': 'enable'}); "
            "print(_hints_kept(sys.argv[1], io))")
    kept = subprocess.run([PY, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert kept.stdout.strip() == "romio_cb_write=enable, striping_unit=4194304", kept.stdout + kept.stderr
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_doctor_says_a_checkpoint_directory_is_missing_and_whether_it_can_be_made(tmp_path):
    (tmp_path / "file").write_text("")
    missing, under_file = tmp_path / "no" / "such" / "dir", tmp_path / "file" / "dir"
    for path, said, fix in [(missing, f"{missing} does not exist; it can be created ({tmp_path}, its nearest "
                                      f"existing parent, is writable)", f"mkdir -p {missing}"),
                            (under_file, f"{tmp_path / 'file'} is a file, not a directory", "the path of a directory")]:
        proc = run_doctor("--checkpoint-dir", str(path))
        lines = proc.stdout.splitlines()
        i = next(i for i, x in enumerate(lines) if "ckpt I/O" in x)
        assert lines[i].startswith("[warn] ckpt I/O") and said in lines[i], proc.stdout
        assert lines[i + 1].startswith("       fix: ") and fix in lines[i + 1], proc.stdout
        assert not path.exists()
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        proc = run_doctor("--checkpoint-dir", str(tmp_path / "ro" / "x"))
        assert "does not exist and cannot be created" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_doctor_under_mpirun_gathers_every_rank(n):
    result = mpirun(n, ["-m", "hpctrain", "doctor"], timeout=120).check()
    assert f"ranks ({n}):" in result.stdout
    for rank in range(n):
        assert f"rank {rank:>3} on" in result.stdout
    assert "mpirun, rank 0 of %d" % n in result.stdout
    assert result.stdout.count("hpctrain 0") == 1  # only rank 0 prints the report


@pytest.mark.mpi
def test_doctor_json_under_mpirun():
    result = mpirun(2, ["-m", "hpctrain", "doctor", "--json"], timeout=120).check()
    doc = json.loads(result.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["launcher"] == "mpirun"


def test_srun_without_pmix_gets_the_fix():
    # What each task of `srun -n 2 python ...` sees without --mpi=pmix: Slurm says 2
    # tasks, MPI a world of 1. (The same under a real srun is in the Slurm tests.)
    env = mpi_env({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                   "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    proc = run_doctor(env=env)
    assert proc.returncode == 1
    assert "[FAIL] launcher" in proc.stdout and "srun --mpi=pmix" in proc.stdout


def _site_view(tmp_path, exclude):
    """A site-packages made of links to this venv's, minus the packages in ``exclude``."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site"
    view.mkdir()
    for entry in site.iterdir():
        base = entry.name.split("-")[0].lower()
        if base in exclude or entry.suffix == ".pth":
            continue
        (view / entry.name).symlink_to(entry)
    return view


def _isolated_env(paths):
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [str(p) for p in paths])
    return env


def test_missing_horovod_names_the_fix(tmp_path):
    view = _site_view(tmp_path, {"horovod"})
    proc = run_doctor(env=_isolated_env([view]), python_args=("-S",))
    assert proc.returncode == 1, proc.stdout
    assert "[FAIL] horovod    not installed" in proc.stdout
    assert "make setup" in proc.stdout and "HPCTRAIN_BACKEND=mpi" in proc.stdout


def test_missing_horovod_is_fine_for_the_mpi_backend(tmp_path):
    view = _site_view(tmp_path, {"horovod"})
    env = _isolated_env([view])
    env["HPCTRAIN_BACKEND"] = "mpi"
    proc = run_doctor(env=env, python_args=("-S",))
    assert proc.returncode == 0, proc.stdout
    assert "[warn] horovod" in proc.stdout


def _wheel_cache():
    """scripts/setup.sh's wheel cache: $HPCTRAIN_CACHE, else $XDG_CACHE_HOME/hpctrain, else
    ~/.cache/hpctrain, then wheels/."""
    base = os.environ.get("HPCTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "hpctrain")
    return Path(base) / "wheels"


@pytest.fixture(scope="session")
def serial_h5py(tmp_path_factory):
    """A real h5py built without MPI: PyPI's wheel of this h5py's version, which `make setup`
    downloads once into its wheel cache. Installed from that file only: no index, no network."""
    from importlib.metadata import version

    folder = _wheel_cache() / f"h5py-serial-{version('h5py')}-py{sys.version_info[0]}{sys.version_info[1]}"
    wheels = sorted(folder.glob("h5py-*.whl"))
    if not wheels:
        pytest.fail(f"no serial h5py wheel in {folder}: run `make setup` (scripts/setup.sh downloads it once)")
    target = tmp_path_factory.mktemp("serial-h5py")
    # No pip configuration either: its index and find-links settings are not consulted.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check",
                    "--target", str(target), str(wheels[-1])], check=True, timeout=120, env=env)
    return target


def test_serial_h5py_names_the_fix(tmp_path, serial_h5py):
    view = _site_view(tmp_path, {"h5py"})
    proc = run_doctor(env=_isolated_env([view, serial_h5py]), python_args=("-S",))
    assert proc.returncode == 1, proc.stdout
    assert "SERIAL" in proc.stdout and "[FAIL] h5py" in proc.stdout
    assert "HDF5_MPI=ON" in proc.stdout
