"""``hpctrain doctor``: can this machine run a parallel hpctrain job? If not, how to fix it.

    hpctrain doctor                 # one process (login node)
    mpirun -n 2 hpctrain doctor     # each rank reports; rank 0 prints them all
    hpctrain doctor --json          # machine-readable

Exit status 0 only when the stack can run a parallel job; each missing piece is a line that names the fix.
From a site installation (``make install``, ``module load hpctrain``) it first compares the MPI on PATH and
the loaded modules with those the installation was built against (:mod:`hpctrain.install.record`); when they
differ it says so and loads neither mpi4py, h5py nor Horovod, which would fail inside MPI start-up.
Versions come from package metadata where possible; torch and Horovod are imported only to check that their
compiled parts really load (Horovod in :func:`hpctrain.backends.horovod_backend.build_info`, the one module
that imports it)."""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata

from .. import __version__, settings
from ..install.record import hdf5_problem, installation_of, parse_loaded_modules, stack_problems
from ..runtime.world import launch_info, launch_problems, node_name

SETUP_HINT = "run `make setup` in the hpctrain checkout"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    fix: str = ""
    required: bool = True

    def line(self):
        mark = "ok  " if self.ok else ("FAIL" if self.required else "warn")
        text = f"[{mark}] {self.name:<10} {self.detail}"
        if not self.ok and self.fix:
            text += f"\n       fix: {self.fix}"
        return text


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_python():
    return Check("python", sys.version_info >= (3, 9), f"{platform.python_version()} ({sys.executable})",
                 "use Python >= 3.9 (module load python/3.11)")


def check_numpy():
    v = _version("numpy")
    return Check("numpy", v is not None, v or "not installed", SETUP_HINT)


def check_torch():
    v = _version("torch")
    if v is None:
        return Check("torch", False, "not installed", f"{SETUP_HINT} (installs torch==2.13.0), or pip install torch"), {}
    try:
        import torch
    except Exception as exc:  # a broken install must not crash the doctor
        return Check("torch", False, f"{v}, import failed: {exc}", "reinstall torch in this environment"), {}
    cuda = {"available": torch.cuda.is_available(), "devices": [], "cuda_version": torch.version.cuda}
    if cuda["available"]:
        cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    where = f"CUDA {torch.version.cuda}, {len(cuda['devices'])} GPU(s)" if cuda["available"] else "CPU"
    return Check("torch", True, f"{torch.__version__} ({where}, {torch.get_num_threads()} threads)"), cuda


def check_mpi():
    """mpi4py and the MPI library under it. Returns (check, comm or None, library text)."""
    v = _version("mpi4py")
    if v is None:
        return Check("mpi4py", False, "not installed",
                     f"{SETUP_HINT}; on a cluster: module load openmpi, then pip install --no-binary=mpi4py mpi4py"), None, ""
    try:
        from mpi4py import MPI
    except Exception as exc:
        return Check("mpi4py", False, f"{v}, MPI failed to load: {exc}",
                     "load the MPI module mpi4py was built against (module load openmpi), or rebuild: "
                     "pip install --force-reinstall --no-binary=mpi4py mpi4py"), None, ""
    # Open MPI's version string ends in a NUL byte, which would reach the terminal and the JSON.
    lib = (MPI.Get_library_version().replace("\0", "").strip().splitlines() or [""])[0].rstrip()
    return Check("mpi4py", True, f"{v}, {lib}"), MPI.COMM_WORLD, lib


def check_mpirun():
    path = shutil.which("mpirun") or shutil.which("mpiexec")
    return Check("mpirun", path is not None, path or "not on PATH",
                 "module load openmpi (or: apt-get install openmpi-bin)")


def check_h5py(record=None):
    v = _version("h5py")
    if v is None:
        return Check("h5py", False, "not installed", f"{SETUP_HINT} (builds h5py against parallel HDF5)")
    try:
        import h5py
    except Exception as exc:
        return Check("h5py", False, f"{v}, import failed: {exc}", "load the HDF5 module h5py was built against")
    parallel = bool(h5py.get_config().mpi)
    detail = f"{h5py.__version__}, HDF5 {h5py.version.hdf5_version}, {'parallel (mpio)' if parallel else 'SERIAL'}"
    problem = hdf5_problem(record, h5py.version.hdf5_version) if record is not None and parallel else None
    if problem is not None:
        return Check("h5py", False, f"{detail}: {problem.text}", problem.fix)
    return Check("h5py", parallel, detail,
                 "h5py was built without MPI: rebuild it against parallel HDF5 with "
                 "`CC=mpicc HDF5_MPI=ON pip install --no-binary=h5py --no-build-isolation h5py` "
                 f"(module load hdf5/parallel first), or {SETUP_HINT}")


def check_horovod(required, cuda):
    """Horovod's version and build. Missing Horovod is fatal only for the horovod backend."""
    v = _version("horovod")
    alt = "or choose the plain MPI backend: HPCTRAIN_BACKEND=mpi (config: comm.backend = \"mpi\")"
    if v is None:
        return Check("horovod", False, "not installed",
                     f"{SETUP_HINT} (builds Horovod 0.28.1 with PyTorch and MPI), {alt}", required), {}
    from ..backends.horovod_backend import build_info

    try:
        build = build_info()
    except Exception as exc:
        return Check("horovod", False, f"{v}, PyTorch extension failed to load: {exc}",
                     f"rebuild Horovod against this torch: {SETUP_HINT}, {alt}", required), {}
    detail = (f"{v}, frameworks: PyTorch; controllers: {', '.join(build['controllers']) or 'none'}; "
              f"tensor ops: {', '.join(build['tensor_operations']) or 'none'}")
    if "MPI" not in build["controllers"]:
        return Check("horovod", False, detail, f"Horovod was built without MPI: {SETUP_HINT}", required), build
    if cuda.get("available") and not build["nccl"]:
        return Check("horovod", False, detail + " (no NCCL, but GPUs are present)",
                     "rebuild with HOROVOD_GPU_OPERATIONS=NCCL: rm -rf ~/.cache/hpctrain/wheels/horovod-* && make setup",
                     required=False), build
    return Check("horovod", True, detail), build


def check_launch(comm):
    info = launch_info()
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    problems = launch_problems(info, rank, size)
    job = f", Slurm job {info.slurm_job_id}" if info.slurm_job_id else ""
    detail = f"{info.launcher}, rank {rank} of {size}{job}"
    if problems:
        text, _, hint = problems[0].partition("\nHINT: ")
        return Check("launcher", False, f"{detail}: {text}", hint), info, rank, size
    return Check("launcher", True, detail), info, rank, size


def check_installation():
    """Whether this runs from a site installation (its record), and the line that says so."""
    try:
        record = installation_of()
    except ValueError as exc:
        text, _, hint = str(exc).partition("\nHINT: ")
        return None, Check("install", False, text, hint)
    if record is None:
        return None, Check("install", True, f"{sys.prefix} (an environment of its own, e.g. a checkout's .venv; "
                                            "no site installation record)")
    return record, Check("install", True, f"site installation hpctrain {record.version} in {record.prefix} "
                                          f"(module {record.module}), built against {record.built_against()}")


def _mpirun_version_line(path):
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({path} --version failed: {exc})"
    return ((proc.stdout or proc.stderr).strip().splitlines() or [""])[0]


def check_stack(record):
    """The MPI on PATH and the loaded modules against those ``record`` was built with."""
    path = shutil.which("mpirun")
    loaded = parse_loaded_modules(settings.loaded_modules())
    problems = stack_problems(record, path, _mpirun_version_line(path) if path else None, loaded)
    if not problems:
        return Check("stack", True, f"MPI and modules as at install time ({record.mpi_version_line}, {path})")
    required = [p for p in problems if p.required]
    detail = "; ".join(p.text for p in problems)
    if required:
        detail += " (mpi4py, h5py and Horovod not loaded: they would fail inside MPI start-up)"
    return Check("stack", False, detail, (required or problems)[0].fix, required=bool(required))


def check_checkpoint_io(directory, mpi_ok):
    """The file system of the checkpoint directory and what a save there uses: alignment and MPI-IO hints
    (as hpctrain chooses them, and as MPI-IO reports them back for a file opened there)."""
    from ..checkpoint.io.iosettings import io_settings_for

    directory = os.path.abspath(directory)
    problem = _unwritable(directory)
    if problem:
        return Check("ckpt I/O", False, problem[0], problem[1], required=False)
    io = io_settings_for(directory)
    detail = f"{directory}: {io.describe().split(': ', 1)[1]}"
    if mpi_ok and io.hints and os.path.isdir(directory) and os.access(directory, os.W_OK):
        detail += f"; MPI-IO keeps: {_hints_kept(directory, io)}"
    return Check("ckpt I/O", bool(io.filesystem), detail, "run `hpctrain doctor --checkpoint-dir DIR` on a compute "
                 "node, where /proc/self/mountinfo names the file system", required=False)


def _unwritable(directory):
    """(what is wrong, the fix) when checkpoints cannot be written to ``directory`` as it is now, else None."""
    parent = directory
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory", "pass --checkpoint-dir the path of a directory"
    writable = os.access(parent, os.W_OK | os.X_OK)
    if parent == directory:
        return None if writable else (f"{directory} is not writable by this user",
                                      "pass --checkpoint-dir a directory you can write to, or change its permissions")
    if writable:
        return (f"{directory} does not exist; it can be created ({parent}, its nearest existing parent, is "
                f"writable)", f"mkdir -p {directory} (a save creates it too), or pass an existing directory")
    return (f"{directory} does not exist and cannot be created: {parent}, its nearest existing parent, is not "
            "writable", f"pass --checkpoint-dir a directory you can write to, or have {directory} created")


def _hints_kept(directory, io):
    """The hints of ``io`` that MPI-IO reports for a probe file it opened in ``directory`` (then removed)."""
    from mpi4py import MPI

    probe = os.path.join(directory, f".hpctrain-doctor-{os.getpid()}")
    info = io.mpi_info()
    try:
        f = MPI.File.Open(MPI.COMM_SELF, probe, MPI.MODE_CREATE | MPI.MODE_WRONLY | MPI.MODE_DELETE_ON_CLOSE, info)
        try:
            got = f.Get_info()
            kept = {k: got.Get(k) for k in io.hints if got.Get(k) is not None}
            got.Free()
        finally:
            f.Close()
    except MPI.Exception as exc:
        return f"could not open a file there ({exc.Get_error_string()})"
    finally:
        info.Free()
    return ", ".join(f"{k}={v}" for k, v in sorted(kept.items())) or "none of them"


def run_checks(checkpoint_dir="."):
    """Run every check in this process; returns a dict (JSON-ready) and the checks."""
    record, install_check = check_installation()
    checks = [install_check, check_python(), check_numpy()]
    torch_check, cuda = check_torch()
    checks.append(torch_check)
    stack_check = check_stack(record) if record is not None else None
    comm, mpi_lib, hvd_build = None, "", {}
    if stack_check is not None:
        checks.append(stack_check)
    if stack_check is None or stack_check.ok or not stack_check.required:
        mpi_check, comm, mpi_lib = check_mpi()
        checks += [mpi_check, check_mpirun(), check_h5py(record), check_checkpoint_io(checkpoint_dir, comm is not None)]
        horovod_required = (settings.get("BACKEND") or "horovod") == "horovod"
        hvd_check, hvd_build = check_horovod(horovod_required, cuda)
        checks.append(hvd_check)
    else:
        checks.append(check_mpirun())
    launch_check, info, rank, size = check_launch(comm)
    checks.append(launch_check)
    # From the h5py the checks imported: importing it here, after a stack check failed, would start MPI.
    h5py = sys.modules.get("h5py")
    report = {
        "hpctrain": __version__, "host": node_name(), "rank": rank, "size": size, "launcher": info.launcher,
        "slurm_job_id": info.slurm_job_id,
        "versions": {"python": platform.python_version(), "torch": _version("torch"), "numpy": _version("numpy"),
                     "mpi4py": _version("mpi4py"), "mpi_library": mpi_lib, "h5py": _version("h5py"),
                     "hdf5": h5py.version.hdf5_version if h5py is not None else None,
                     "horovod": _version("horovod")},
        "h5py_parallel": bool(h5py.get_config().mpi) if h5py is not None else False,
        "horovod_build": hvd_build,
        "cuda": cuda,
        "installation": asdict(record) if record is not None else None,
        "checks": [asdict(c) for c in checks],
        "ok": all(c.ok or not c.required for c in checks),
    }
    return report, checks, comm


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hpctrain doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document (all ranks) on rank 0")
    parser.add_argument("--checkpoint-dir", default=".", metavar="DIR",
                        help="where checkpoints will go: its file system, alignment and MPI-IO hints (default: .)")
    args = parser.parse_args(argv)

    report, checks, comm = run_checks(args.checkpoint_dir)
    if comm is not None and comm.Get_size() > 1:
        from ..runtime.coordination import on_root

        reports = comm.gather(report, root=0)  # None except on rank 0
        # Rank 0 decides from every rank's report; all ranks exit with its verdict.
        ok = on_root(lambda: all(r["ok"] for r in reports), comm)
    else:
        reports, ok = [report], report["ok"]
    if report["rank"] == 0:
        print(json.dumps(_json_doc(report, reports, ok), indent=2) if args.json
              else _text(report, checks, reports, ok))
    return 0 if ok else 1


def _failed(r):
    return [c for c in r["checks"] if not c["ok"] and c["required"]]


def _json_doc(report, reports, ok):
    ranks = [{"rank": r["rank"], "host": r["host"], "launcher": r["launcher"], "ok": r["ok"],
              "failed": [c["name"] for c in _failed(r)]} for r in reports]
    return dict(report, ok=ok, ranks=ranks)


def _text(report, checks, reports, ok):
    lines = [f"hpctrain {__version__} doctor on {report['host']}"]
    lines += [c.line() for c in checks]
    if len(reports) > 1:
        lines.append(f"ranks ({len(reports)}):")
        for r in reports:
            bad = _failed(r)
            lines.append(f"  rank {r['rank']:>3} on {r['host']}: {r['launcher']}, "
                         + ("ok" if not bad else "FAIL: " + ", ".join(c["name"] for c in bad)))
            if r["rank"] != 0:  # rank 0's own fixes are listed above
                lines += [f"       fix ({c['name']}): {c['fix']}" for c in bad]
    lines.append("ready for a parallel job" if ok else "NOT ready: fix the lines marked FAIL above")
    return "\n".join(lines)
