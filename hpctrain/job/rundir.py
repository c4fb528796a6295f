"""The run directory: where a run's configuration, checkpoints, metrics and failure records go.

``run.run_dir`` when set (a requeued job comes back to it), else a new
``<run.root or HPCTRAIN_RUN_ROOT or runs>/<run.name>-<date>-<time>``. Its files are named here,
for everything that writes or reads them."""
import dataclasses
import json
import os
import time

from .. import settings
from ..errors import HpctrainError
from . import runlock

CONFIG_FILE = "config.toml"  # the resolved configuration
METRICS_FILE = "metrics.jsonl"  # hpctrain.monitoring writes it; hpctrain launch adds its restarts
FAILURE_FILE = "failures.jsonl"  # HPCTRAIN_FAILURE_FILE under hpctrain launch (hpctrain.runtime.coordination.record)
CHECKPOINTS = "checkpoints"  # unless checkpoint.directory says otherwise


def new_path(cfg):
    """A run directory for ``cfg`` that does not exist yet (absolute)."""
    root = cfg.run.root or settings.get("RUN_ROOT") or "runs"
    base = os.path.join(root, f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):  # two runs started in the same second
        n += 1
        path = f"{base}-{n}"
    return os.path.abspath(path)


def append_metrics(run_dir, record, warn):
    """Append ``record``, stamped with the time, to ``run_dir``'s metrics.jsonl (the supervisors' records);
    ``warn(text)`` says so when it cannot."""
    path = os.path.join(run_dir, METRICS_FILE)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({**record, "timestamp": time.time()}, default=str) + "\n")
    except OSError as exc:
        warn(f"warning: could not append to {path}: {exc}")


def checkpoint_dir(cfg, run_dir):
    return cfg.checkpoint.directory or os.path.join(run_dir, CHECKPOINTS)


def create(cfg, world, backend):
    """Create the run directory (rank 0) and write the resolved configuration into it."""
    path = cfg.run.run_dir or new_path(cfg)
    _make(path, "run directory", "run.run_dir (or run.root, HPCTRAIN_RUN_ROOT)")
    if cfg.checkpoint.directory:
        _make(cfg.checkpoint.directory, "checkpoint directory", "checkpoint.directory")
    # A second job on either directory stops here, before overwriting anything; release(path) frees both.
    runlock.acquire(path, checkpoint_dir=cfg.checkpoint.directory)
    resolved = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=os.path.abspath(path)))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        f.write(f"# resolved configuration of this run: {world.size} ranks ({world.launcher}), "
                f"{backend.name} backend, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                f"# train.batch_size is per rank\n\n")
        f.write(resolved.to_toml())
    return os.path.abspath(path)


def _make(path, what, setting):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:  # a part of the path is a file, no permission, a read-only file system
        raise HpctrainError(f"cannot create the {what} {path}: {exc.strerror or exc}",
                            hint=f"set {setting} to a directory you can write; every part of the path "
                                 f"must be a directory") from None
