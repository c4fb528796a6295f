"""Reading checkpoint files in tests the way a user would: plain serial h5py."""


def tensors(path):
    """Every dataset under /model and /optimizer of a checkpoint, by name."""
    import h5py

    found = {}
    with h5py.File(path, "r") as f:
        for group in ("model", "optimizer"):
            f[group].visititems(lambda name, obj: found.__setitem__(f"{group}/{name}", obj[()])
                                if isinstance(obj, h5py.Dataset) else None)
    return found
