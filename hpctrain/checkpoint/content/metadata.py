"""What a checkpoint records beside the training state: the attributes of ``/`` that say which job wrote it,
when, on how many ranks, with which configuration and library versions (:func:`root_metadata`), and the
process's random generators (:func:`rng_states`, put back by :func:`set_rng_states`). Rank 0 takes both and
hands them to every rank (:func:`~.commit.prepare`); :mod:`.snapshot` stores them with the state's arrays."""
import random
import socket
import sys
import time

import numpy as np

from ... import __version__
from . import format as fmt


def _versions():
    import h5py
    import torch

    return {"hpctrain_version": __version__, "torch_version": str(torch.__version__), "h5py_version": h5py.__version__,
            "hdf5_version": h5py.version.hdf5_version, "numpy_version": np.__version__,
            "python_version": sys.version.split()[0]}


def root_metadata(nranks, run_config, metrics, reason, step, io_mode, nwriters):
    """Attributes of ``/``, made on rank 0 and broadcast: parallel HDF5 needs them identical on all ranks."""
    from ...runtime.world import launch_info

    info = launch_info()
    now = time.time()
    meta = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "step": int(step), "reason": reason,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "created_unix": now,
            "nranks": int(nranks), "nwriters": int(nwriters), "io_mode": io_mode, "hostname": socket.gethostname(),
            "run_config": fmt.to_json(run_config or {}), "metrics": fmt.to_json(metrics or {}), **_versions()}
    meta.update({key: getattr(info, key) for key in ("slurm_job_id", "slurm_nodelist") if getattr(info, key)})
    return meta


def rng_states():
    """This process's torch, numpy and Python generator states (small)."""
    import torch

    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state().numpy().copy(),
            "numpy_keys": np.asarray(np_state[1], dtype=np.uint32).copy(),
            "numpy_meta": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "python": random.getstate()}


def set_rng_states(rng):
    import torch

    torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(rng["torch"], dtype=np.uint8)))
    kind, pos, has_gauss, cached = rng["numpy_meta"]
    np.random.set_state((kind, np.asarray(rng["numpy_keys"], dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))
