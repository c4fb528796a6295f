"""`make install PREFIX=...`: one installation for every user of a cluster, used through a real
Lmod module by another user than the one who installed it.

The fast tests check the pure parts (the record, its comparison with what is loaded, the
modulefiles' text). The slow ones install for real, from a copy of this checkout that is
deleted before anything runs, on top of a site module (``openmpi/4.1.4``, a real modulefile
that puts this machine's Open MPI on PATH), then, in a login shell of another user:
``module load hpctrain`` (which loads that MPI module again), ``hpctrain doctor``, a 2-rank
``mpirun`` training from an empty directory, an ``sbatch`` of the installed job script, and the
doctor's FAIL lines for a module unloaded and for another mpirun on PATH.
"""
import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hpctrain import __version__
from hpctrain.install.modulefiles import lua_modulefile, modulefile_paths, tcl_modulefile
from hpctrain.install.record import (InstallRecord, hdf5_problem, installation_of, parse_loaded_modules,
                                     read_record, record_path, stack_modules_of, stack_problems, write_record)
from mpi_harness import ROOT
from system_packages import install_debian

USER = "hpctrain-user"
INSTALL_TIMEOUT = 900
SHELL_TIMEOUT = 300
JOB_TIMEOUT = 300
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
SITE_MPI_MODULE = "openmpi/4.1.4"
QUICK = "train.max_steps=20 checkpoint.every_steps=10 monitor.log_every=10"


def make_record(**changes):
    fields = dict(prefix="/opt/hpctrain/0.1.0", version="0.1.0", module_version="0.1.0",
                  modulefiles="/opt/modulefiles", mpirun="/usr/bin/mpirun",
                  mpi_version_line="mpirun (Open MPI) 4.1.4", mpi_version="4.1.4", hdf5_version="1.10.8",
                  torch="2.13.0+cpu", python="3.11.2", loaded_modules=["gcc/12", "openmpi/4.1.4", "hdf5/1.10.8-mpi"],
                  stack_modules=["openmpi/4.1.4", "hdf5/1.10.8-mpi"])
    fields.update(changes)
    return InstallRecord(**fields)


# ---------------------------------------------------------------- pure logic


def test_record_round_trips_and_a_foreign_file_names_the_fix(tmp_path):
    record = make_record(prefix=str(tmp_path))
    write_record(record, record_path(tmp_path))
    assert read_record(record_path(tmp_path)) == record
    (tmp_path / "venv").mkdir()
    assert installation_of(tmp_path / "venv") == record  # found from the interpreter's prefix
    assert installation_of(tmp_path / "venv" / "other-venv") is None  # a venv with no record beside it
    record_path(tmp_path).write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="HINT: reinstall"):
        read_record(record_path(tmp_path))


def test_stack_modules_are_the_loaded_ones_named_for_mpi_or_hdf5():
    loaded = parse_loaded_modules("gcc/12:openmpi/4.1.4::hdf5/1.10.8-mpi:cmake/3.27:mvapich2/2.3:intel-mpi/2021")
    assert loaded == ["gcc/12", "openmpi/4.1.4", "hdf5/1.10.8-mpi", "cmake/3.27", "mvapich2/2.3", "intel-mpi/2021"]
    assert stack_modules_of(loaded) == ["openmpi/4.1.4", "hdf5/1.10.8-mpi", "mvapich2/2.3", "intel-mpi/2021"]
    assert parse_loaded_modules(None) == []


def test_stack_problems_name_the_module_to_load_or_reinstall():
    record = make_record()
    same = stack_problems(record, "/usr/bin/mpirun", "mpirun (Open MPI) 4.1.4", record.loaded_modules)
    assert same == []
    (other,) = stack_problems(record, "/opt/ompi5/bin/mpirun", "mpirun (Open MPI) 5.0.3", record.loaded_modules)
    assert "'mpirun (Open MPI) 5.0.3' (/opt/ompi5/bin/mpirun)" in other.text and other.required
    assert "'mpirun (Open MPI) 4.1.4' (/usr/bin/mpirun)" in other.text
    assert other.fix.startswith("module load openmpi/4.1.4 hdf5/1.10.8-mpi")
    assert "make install PREFIX=/opt/hpctrain/0.1.0" in other.fix
    unloaded, missing = stack_problems(record, None, None, ["gcc/12"])
    assert unloaded.fix.startswith("module load openmpi/4.1.4 hdf5/1.10.8-mpi") and "no mpirun on PATH" in missing.text
    no_modules = make_record(stack_modules=[], loaded_modules=[])
    (other,) = stack_problems(no_modules, "/opt/x/mpirun", "mpirun (Open MPI) 5.0.3", [])
    assert other.fix.startswith("put /usr/bin first on PATH")
    (twin,) = stack_problems(no_modules, "/opt/copy/bin/mpirun", "mpirun (Open MPI) 4.1.4", [])
    assert not twin.required  # the same version elsewhere: a warning, not a failure
    assert hdf5_problem(record, "1.10.8") is None
    assert "built against HDF5 1.10.8" in hdf5_problem(record, "1.12.2").text


def test_modulefiles_load_the_stack_modules_and_set_the_home():
    record = make_record()
    lua, tcl = lua_modulefile(record), tcl_modulefile(record)
    assert 'depends_on("openmpi/4.1.4")' in lua and 'depends_on("hdf5/1.10.8-mpi")' in lua
    assert 'local prefix = "/opt/hpctrain/0.1.0"' in lua and 'setenv("HPCTRAIN_HOME", prefix)' in lua
    assert 'prepend_path("PATH", pathJoin(prefix, "bin"))' in lua
    assert tcl.startswith("#%Module")
    assert "if { ![is-loaded {openmpi/4.1.4}] } { module load {openmpi/4.1.4} }" in tcl
    assert "setenv HPCTRAIN_HOME $prefix" in tcl and "prepend-path PATH $prefix/bin" in tcl
    assert modulefile_paths(record) == (Path("/opt/modulefiles/hpctrain/0.1.0.lua"),
                                        Path("/opt/modulefiles/hpctrain/0.1.0"))
    bare = lua_modulefile(make_record(stack_modules=[]))
    assert "depends_on" not in bare and "keep that mpirun (/usr/bin/mpirun) first on PATH" in bare
    with pytest.raises(ValueError, match="HINT: install into a PREFIX"):
        tcl_modulefile(make_record(prefix="/opt/{odd}"))


# ---------------------------------------------------------------- a real installation


def _root_or_skip():
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates a second user and installs lmod with apt-get when missing")


@pytest.fixture(scope="module")
def lmod():
    if not LMOD_INIT.exists():
        _root_or_skip()
        install_debian("lmod")
    return LMOD_INIT


@pytest.fixture(scope="module")
def other_user():
    _root_or_skip()
    created = subprocess.run(["id", USER], capture_output=True).returncode != 0
    if created:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True, timeout=60)
    yield pwd.getpwnam(USER)
    if created:
        subprocess.run(["userdel", "-r", USER], capture_output=True, timeout=60)


def _shared_python():
    """A Python every user may run (the installation's venv links to it); pyenv's under /root is not."""
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate and subprocess.run(["runuser", "-u", USER, "--", candidate, "-c", "import venv, ensurepip"],
                                        capture_output=True, timeout=60).returncode == 0:
            return candidate
    pytest.skip(f"no python3 that {USER} may run, with venv and ensurepip")


def _copy_of_checkout(target):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)


@pytest.fixture(scope="module")
def site(lmod, other_user):
    """``make install`` into a prefix under /tmp (readable by every user), run by root from a copy of
    the checkout with the site module openmpi/4.1.4 loaded; the copy is deleted before the tests run."""
    python = _shared_python()
    base = Path(tempfile.mkdtemp(prefix="hpctrain-site-", dir="/tmp"))
    base.chmod(0o755)
    site_modules = base / "site-modules"
    (site_modules / "openmpi").mkdir(parents=True)
    mpirun = shutil.which("mpirun")
    (site_modules / "openmpi" / "4.1.4.lua").write_text(
        f'whatis("Open MPI 4.1.4 of this machine")\nprepend_path("PATH", "{os.path.dirname(mpirun)}")\n'
        f'setenv("MPI_HOME", "{os.path.dirname(os.path.dirname(mpirun))}")\n')
    source = base / "checkout"
    _copy_of_checkout(source)
    prefix = base / "hpctrain" / __version__
    script = (f". {lmod}\nmodule use {site_modules}\nmodule load {SITE_MPI_MODULE}\n"
              f"make -C {source} install PREFIX={prefix} PYTHON={python}\n")
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))})
    seconds = time.monotonic() - started
    assert proc.returncode == 0, f"make install failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    shutil.rmtree(source)
    print(f"\nmake install took {seconds:.0f} s")
    yield {"prefix": prefix, "modulefiles": prefix / "modulefiles", "site_modules": site_modules,
           "base": base, "install_seconds": seconds, "install_output": proc.stdout, "checkout": source}
    shutil.rmtree(base, ignore_errors=True)


def as_user(site, body, timeout=SHELL_TIMEOUT, name="work"):
    """Run ``body`` in a fresh login shell of the other user, in an empty directory of its own,
    after ``module use`` of the site's modules and of the installation's modulefiles."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=site["base"]))
    user = pwd.getpwnam(USER)
    os.chown(work, user.pw_uid, user.pw_gid)
    script = work / "session.sh"
    script.write_text(
        "set -eo pipefail\n"
        # Loopback only: no probing of other interfaces on a test machine (tests/mpi_harness.py).
        "export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo\n"
        "export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=true\n"
        f"cd {work}\nmodule use {site['site_modules']}\nmodule use {site['modulefiles']}\n{body}\n")
    script.chmod(0o644)
    try:
        proc = subprocess.run(["runuser", "-l", USER, "-c", f"source {script}"], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the session of {USER} did not finish in {timeout}s:\n{exc.stdout}\n{exc.stderr}")
    return proc, work


def _checkpoint(run_dir):
    checkpoints = Path(run_dir) / "checkpoints"
    return checkpoints / (checkpoints / "latest").read_text().strip()


@pytest.mark.slow
def test_installation_needs_no_checkout(site):
    prefix = site["prefix"]
    assert not site["checkout"].exists()
    out = site["install_output"]
    assert f"module use {site['modulefiles']} && module load hpctrain/{__version__}" in out
    record = read_record(record_path(prefix))
    assert record.stack_modules == [SITE_MPI_MODULE] and record.mpirun == shutil.which("mpirun")
    assert record.mpi_version_line.startswith("mpirun (Open MPI) 4.1") and record.hdf5_version
    assert record.torch.startswith("2.13.0")
    site_packages = list((prefix / "venv" / "lib").glob("python3*/site-packages"))[0]
    assert (site_packages / "hpctrain" / "cli.py").is_file()  # a normal install, not an editable one
    leftovers = subprocess.run(["grep", "-rlI", "--exclude-dir=torch", str(site["checkout"]), str(prefix)],
                               capture_output=True, text=True, timeout=300).stdout
    assert leftovers == "", f"files of the installation that name the deleted checkout:\n{leftovers}"
    for part in ("examples/digits.toml", "slurm/train.sbatch", "slurm/README.md"):
        assert (prefix / "share" / "hpctrain" / part).is_file(), part


@pytest.mark.slow
@pytest.mark.mpi
def test_module_load_then_doctor_and_two_rank_training_from_an_empty_directory(site):
    proc, work = as_user(site, f"""
module load hpctrain
module list 2>&1
echo "HOME=$HPCTRAIN_HOME HPCTRAIN=$(command -v hpctrain)"
hpctrain doctor
hpctrain examples
hpctrain examples --copy mywork
mkdir run && cd run
mpirun -n 2 --oversubscribe --timeout 240 hpctrain train "$HPCTRAIN_HOME/share/hpctrain/examples/digits.toml" {QUICK}
""")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    prefix = site["prefix"]
    assert SITE_MPI_MODULE in out  # loaded again by the hpctrain module (depends_on)
    assert f"HOME={prefix} HPCTRAIN={prefix}/bin/hpctrain" in out
    assert f"site installation hpctrain {__version__} in {prefix}" in out and "[ok  ] stack" in out
    assert "ready for a parallel job" in out and "FAIL" not in out
    assert f"examples:    {prefix}/share/hpctrain/examples" in out
    assert (work / "mywork" / "examples" / "digits.toml").is_file()
    assert (work / "mywork" / "slurm" / "train.sbatch").is_file()
    (run_dir,) = set(re.findall(r"run directory: (\S+)", out))
    assert run_dir.startswith(str(work / "run")), run_dir
    assert _checkpoint(run_dir).name == "ckpt-00000020.h5"
    assert Path(run_dir).stat().st_uid == pwd.getpwnam(USER).pw_uid


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_of_the_installed_job_script_with_its_default_config(site, slurm_cluster):
    proc, work = as_user(site, f"""
module load hpctrain
export SLURM_CONF={slurm_cluster.conf}
sbatch --parsable --output="$PWD/%x-%j.out" "$HPCTRAIN_HOME/share/hpctrain/slurm/train.sbatch" {QUICK}
""", name="job")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.strip().splitlines()[-1].split(";")[0]
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    (output,) = work.glob(f"*-{job}.out")
    out = output.read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    assert record["UserId"].startswith(USER)
    assert f"config {site['prefix']}/share/hpctrain/examples/digits.toml" in out
    assert "2 ranks (srun)" in out and "done at step 20" in out
    run_dir = work / "runs" / f"{record['JobName']}-{job}"
    assert _checkpoint(run_dir).name == "ckpt-00000020.h5"


@pytest.mark.slow
def test_doctor_fails_with_the_fix_when_the_mpi_is_not_the_one_built_against(site):
    proc, work = as_user(site, f"""
module load hpctrain
mkdir fake
cat > fake/mpirun <<'FAKE'
#!/bin/sh
printf 'mpirun (Open MPI) 5.0.3\\n\\nReport bugs to https://www.open-mpi.org/community/help/\\n'
FAKE
chmod +x fake/mpirun
echo '--- other mpirun'
PATH=$PWD/fake:$PATH hpctrain doctor && echo "exit 0" || echo "exit $?"
echo '--- module unloaded'
module unload {SITE_MPI_MODULE}
hpctrain doctor --json > doctor.json && echo "exit 0" || echo "exit $?"
""", name="mismatch")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    other, unloaded = out.split("--- other mpirun")[1].split("--- module unloaded")
    assert "[FAIL] stack" in other and "exit 1" in other
    assert "mpirun on PATH is 'mpirun (Open MPI) 5.0.3'" in other
    assert f"fix: module load {SITE_MPI_MODULE} (or module load hpctrain/{__version__}, which loads them)" in other
    assert "[ok  ] mpi4py" not in other and "Traceback" not in out and "MPI_Init" not in out
    assert "exit 1" in unloaded
    doc = json.loads((work / "doctor.json").read_text())
    (stack,) = [c for c in doc["checks"] if c["name"] == "stack"]
    assert not doc["ok"] and not stack["ok"] and f"built with the module(s) {SITE_MPI_MODULE}" in stack["detail"]
    assert stack["fix"].startswith(f"module load {SITE_MPI_MODULE}")
    assert doc["installation"]["prefix"] == str(site["prefix"])


@pytest.mark.slow
def test_the_tcl_modulefile_loads_the_same_way(site):
    """Lmod takes the .lua file where both lie; with the Tcl one alone it reads that (as Environment Modules would)."""
    tcl_only = site["base"] / "tcl-modulefiles"
    (tcl_only / "hpctrain").mkdir(parents=True)
    shutil.copy(site["modulefiles"] / "hpctrain" / __version__, tcl_only / "hpctrain" / __version__)
    os.chmod(tcl_only, 0o755)
    proc, _ = as_user(site, f"""
module unuse {site['modulefiles']}
module use {tcl_only}
module load hpctrain
module list 2>&1
echo "HOME=$HPCTRAIN_HOME HPCTRAIN=$(command -v hpctrain)"
hpctrain doctor
""", name="tcl")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert SITE_MPI_MODULE in out and "ready for a parallel job" in out
    assert f"HOME={site['prefix']} HPCTRAIN={site['prefix']}/bin/hpctrain" in out
