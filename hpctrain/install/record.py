"""The record of a site installation: which MPI, HDF5, torch and modules it was built against,
in ``PREFIX/share/hpctrain/install.json``, and its comparison with what is loaded now.

The environment lives in ``PREFIX/venv``, so an interpreter whose ``sys.prefix`` is that venv
belongs to the installation whose record is ``sys.prefix/../share/hpctrain/install.json``; a
checkout's ``.venv`` has none beside it.

>>> record = installation_of()                                          # doctest: +SKIP
>>> [p.text for p in stack_problems(record, "/usr/bin/mpirun", "mpirun (Open MPI) 4.1.4", [])]  # doctest: +SKIP
[]
"""
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..runtime.fsutil import write_text

RECORD_FORMAT = 1
# Names of loaded modules taken to provide the MPI or the HDF5 the packages are compiled against.
STACK_MODULE_PATTERN = re.compile(r"mpi|mvapich|hdf5", re.IGNORECASE)


@dataclass
class InstallRecord:
    prefix: str
    version: str  # hpctrain's
    module_version: str
    modulefiles: str
    mpirun: str
    mpi_version_line: str  # the first line of `mpirun --version`
    mpi_version: str = ""
    mpicc: str = ""
    hdf5_version: str = ""
    hdf5_dir: str = ""
    hdf5_pkgconfig: str = ""
    torch: str = ""
    python: str = ""
    cuda: str = ""
    loaded_modules: list = field(default_factory=list)  # everything loaded at install time
    stack_modules: list = field(default_factory=list)  # those the modulefile loads again
    installed_at: str = ""
    format: int = RECORD_FORMAT

    @property
    def module(self):
        return f"hpctrain/{self.module_version}"

    def built_against(self):
        hdf5 = f"HDF5 {self.hdf5_version}" + (f" ({self.hdf5_dir})" if self.hdf5_dir else "")
        return f"{self.mpi_version_line} ({self.mpirun}), {hdf5}"


def share_dir(prefix):
    """Where an installation keeps its record, examples and job scripts."""
    return Path(prefix) / "share" / "hpctrain"


def record_path(prefix):
    return share_dir(prefix) / "install.json"


def read_record(path):
    """The record in ``path``; a damaged or foreign one is a ``ValueError`` that names the fix."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the installation record {path}: {exc}\n"
                         "HINT: reinstall: make install PREFIX=<this prefix>") from exc
    known = {f.name for f in fields(InstallRecord)}
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT or not {"prefix", "mpirun"} <= set(doc):
        raise ValueError(f"{path} is not an installation record of format {RECORD_FORMAT}\n"
                         "HINT: reinstall with this hpctrain: make install PREFIX=<this prefix>")
    return InstallRecord(**{k: v for k, v in doc.items() if k in known})


def write_record(record, path):
    """Write ``record`` to ``path`` whole or not at all (:func:`hpctrain.runtime.fsutil.write_text`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(asdict(record), indent=2) + "\n")


def installation_of(python_prefix=None):
    """The record of the installation this interpreter belongs to (default ``sys.prefix``), or None."""
    path = record_path(Path(python_prefix or sys.prefix).resolve().parent)
    return read_record(path) if path.is_file() else None


def parse_loaded_modules(text):
    """``$LOADEDMODULES`` (``a/1:b/2``) -> ``["a/1", "b/2"]``."""
    return [m for m in (text or "").split(":") if m]


def stack_modules_of(loaded):
    """Of the modules loaded at install time, those that provide MPI or HDF5 (by name)."""
    return [m for m in loaded if STACK_MODULE_PATTERN.search(m.split("/")[0])]


@dataclass
class StackProblem:
    text: str
    fix: str
    required: bool = True


def stack_problems(record, mpirun_path, mpirun_line, loaded):
    """How the MPI on PATH (``mpirun_path``, the first line of its ``--version``: ``mpirun_line``)
    and the ``loaded`` modules differ from what ``record`` was built against; ``[]`` when they match."""
    reinstall = f"reinstall against what is loaded now: make install PREFIX={record.prefix}"
    load = (f"module load {' '.join(record.stack_modules)} (or module load {record.module}, which loads them)"
            if record.stack_modules else
            f"put {os.path.dirname(record.mpirun)} first on PATH (the MPI it was built with)")
    problems = []
    missing = [m for m in record.stack_modules if m not in loaded]
    if missing:
        problems.append(StackProblem(f"built with the module(s) {' '.join(missing)}, not loaded now",
                                     f"module load {' '.join(missing)}, or {reinstall}"))
    if mpirun_path is None:
        problems.append(StackProblem(f"no mpirun on PATH; built against {record.mpi_version_line} ({record.mpirun})",
                                     f"{load}, or {reinstall}"))
    elif (mpirun_line or "").strip() != record.mpi_version_line.strip():
        problems.append(StackProblem(
            f"mpirun on PATH is '{(mpirun_line or '').strip() or 'unknown'}' ({mpirun_path}); this installation "
            f"was built against '{record.mpi_version_line}' ({record.mpirun})", f"{load}, or {reinstall}"))
    elif os.path.realpath(mpirun_path) != os.path.realpath(record.mpirun):
        problems.append(StackProblem(
            f"mpirun on PATH is {mpirun_path}, the same version as the {record.mpirun} it was built against, "
            "but another installation", f"if jobs fail in MPI start-up: {load}", required=False))
    return problems


def hdf5_problem(record, hdf5_version):
    """A :class:`StackProblem` when h5py runs on another HDF5 than it was built against, else None."""
    if not record.hdf5_version or hdf5_version == record.hdf5_version:
        return None
    load = (f"module load {' '.join(record.stack_modules)}" if record.stack_modules else
            f"put the HDF5 {record.hdf5_version} it was built with ({record.hdf5_dir or record.hdf5_pkgconfig}) first")
    return StackProblem(f"h5py runs on HDF5 {hdf5_version}; this installation was built against HDF5 {record.hdf5_version}",
                        f"{load}, or reinstall: make install PREFIX={record.prefix}")
