"""``hpctrain report RUN_DIR``: plots and a short summary of a run, from its ``metrics.jsonl``.

    hpctrain report runs/digits-20250101-120000            # writes RUN_DIR/report/
    hpctrain report RUN_DIR --out /tmp/report

What it draws and sums up: :mod:`hpctrain.monitoring.report`."""
import argparse
import sys
from pathlib import Path

from ..errors import HpctrainError
from ..monitoring.report import write_report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hpctrain report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="where to write the plots and summary.txt (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        text, paths = write_report(args.run_dir, args.out)
    except HpctrainError as exc:
        print(f"hpctrain report: error: {exc}", file=sys.stderr)
        return exc.exit_code
    sys.stdout.write(text)
    print("wrote " + ", ".join(str(p) for p in list(paths.values()) + [Path(args.out or Path(args.run_dir) / "report")
                                                                        / "summary.txt"]))
    return 0
