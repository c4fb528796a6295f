"""``hpctrain examples``: where the examples and the job scripts are; ``--copy DIR`` copies them.

    hpctrain examples                  # prints the two directories
    hpctrain examples --copy mywork    # mywork/examples/ and mywork/slurm/
    cd mywork && sbatch slurm/train.sbatch examples/digits.toml

They are those of the site installation this command belongs to (``module load hpctrain``:
``PREFIX/share/hpctrain``), or those of the checkout it runs from."""
import argparse
import shutil
import sys
from pathlib import Path

from ..install.record import installation_of, share_dir

PARTS = ("examples", "slurm")


def example_dirs():
    """``{"examples": path, "slurm": path}`` of this installation or checkout; ``{}`` when there are none."""
    record = installation_of()
    base = share_dir(Path(sys.prefix).resolve().parent) if record else Path(__file__).resolve().parents[2]
    dirs = {part: base / part for part in PARTS}
    return dirs if all(d.is_dir() for d in dirs.values()) else {}


def build_parser():
    parser = argparse.ArgumentParser(prog="hpctrain examples", description=__doc__.split("\n")[0])
    parser.add_argument("--copy", metavar="DIR", help="copy examples/ and slurm/ into DIR (made if missing)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    dirs = example_dirs()
    if not dirs:
        print("error: this hpctrain has no examples or job scripts beside it (neither a site installation "
              "nor a checkout).\nHINT: module load hpctrain, or run hpctrain from a clone of the repository",
              file=sys.stderr)
        return 2
    if args.copy is None:
        print(f"examples:    {dirs['examples']}\njob scripts: {dirs['slurm']}")
        return 0
    target = Path(args.copy)
    there = [str(target / part) for part in PARTS if (target / part).exists()]
    if there:
        print(f"error: {' and '.join(there)} already exist(s); nothing was copied.\n"
              "HINT: copy into a new directory, or move them away first", file=sys.stderr)
        return 2
    for part in PARTS:
        shutil.copytree(dirs[part], target / part, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"copied {dirs['examples']} and {dirs['slurm']} into {target}/\n"
          f"next: cd {target} && sbatch slurm/train.sbatch examples/digits.toml")
    return 0
