"""Create the HDF5 data files that the example configurations name, if missing.

    python examples/prepare_data.py            # every example
    python examples/prepare_data.py digits     # examples/digits.toml only

Training creates them too (on rank 0, the others waiting) when ``data.generate`` is set;
this script does it ahead of a batch job, e.g. on a login node.
"""
import os
import sys
from pathlib import Path

from hpctrain.config import load_config
from hpctrain.data import generate

HERE = Path(__file__).resolve().parent


def main(names):
    names = names or sorted(p.stem for p in HERE.glob("*.toml"))
    for name in names:
        cfg = load_config(HERE / f"{name}.toml")
        if cfg.data.factory:
            print(f"{name}: its data factory {cfg.data.factory} makes the data on the first run")
            continue
        if cfg.data.kind == "tokens" and not os.path.exists(cfg.data.path):
            print(f"{name}: token files are written by their own script: see the first lines of {name}.toml")
            continue
        if not cfg.data.path:
            print(f"{name}: names no data file")
            continue
        if os.path.exists(cfg.data.path):
            print(f"{name}: {cfg.data.path} exists")
            continue
        generate(cfg.data, cfg.model, seed=cfg.run.seed)
        print(f"{name}: wrote {cfg.data.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
