"""``python -m hpctrain.install``: the last step of ``scripts/install.sh`` (``make install``),
run by the installed interpreter. Writes the installation record and the modulefiles from what
the script found (every fact is an argument: nothing here looks at the environment)."""
import argparse
import sys
import time

from .. import __version__
from .modulefiles import write_modulefiles
from .record import InstallRecord, parse_loaded_modules, record_path, stack_modules_of, write_record


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m hpctrain.install", description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--modulefiles", required=True)
    parser.add_argument("--module-version", default=__version__)
    for name in ("mpirun", "mpi-version-line"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("mpicc", "mpi-version", "hdf5-version", "hdf5-dir", "hdf5-pkgconfig", "torch-version",
                 "python-version", "cuda", "loaded-modules"):
        parser.add_argument(f"--{name}", default="")
    parser.add_argument("--stack-modules", default=None,
                        help="the modules the modulefile loads (default: those loaded whose names say MPI or HDF5)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    loaded = parse_loaded_modules(args.loaded_modules)
    stack = stack_modules_of(loaded) if args.stack_modules is None else args.stack_modules.split()
    record = InstallRecord(
        prefix=args.prefix, version=__version__, module_version=args.module_version, modulefiles=args.modulefiles,
        mpirun=args.mpirun, mpi_version_line=args.mpi_version_line, mpi_version=args.mpi_version, mpicc=args.mpicc,
        hdf5_version=args.hdf5_version, hdf5_dir=args.hdf5_dir, hdf5_pkgconfig=args.hdf5_pkgconfig,
        torch=args.torch_version, python=args.python_version, cuda=args.cuda, loaded_modules=loaded,
        stack_modules=stack, installed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_record(record, record_path(record.prefix))
    lua, tcl = write_modulefiles(record)
    print(f"[install] hpctrain {record.version} in {record.prefix}, built against {record.built_against()}\n"
          f"[install] record: {record_path(record.prefix)}\n"
          f"[install] modulefiles: {lua} (Lmod), {tcl} (Environment Modules)"
          + (f"; they load {' '.join(stack)}" if stack else "; they load no MPI or HDF5 module (none was loaded)")
          + f"\n[install] users: module use {record.modulefiles} && module load {record.module} && hpctrain doctor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
