"""Reading checkpoint files in tests the way a user would: plain serial h5py, and the ``latest`` pointer."""
import re
from pathlib import Path


def latest(run_dir):
    """The checkpoint file that ``RUN_DIR/checkpoints/latest`` names."""
    directory = Path(run_dir) / "checkpoints"
    return directory / (directory / "latest").read_text().strip()


def latest_step(run_dir):
    """(step, path) of the checkpoint ``latest`` names, or (0, None) before the first one."""
    if not (Path(run_dir) / "checkpoints" / "latest").exists():
        return 0, None
    path = latest(run_dir)
    return int(re.search(r"ckpt-(\d+)\.h5", path.name).group(1)), path


def tensors(path):
    """Every dataset under /model and /optimizer of a checkpoint, by name."""
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        for group in ("model", "optimizer"):
            f[group].visititems(lambda name, obj: found.__setitem__(f"{group}/{name}", obj[()])
                                if isinstance(obj, h5py.Dataset) else None)
    return found
