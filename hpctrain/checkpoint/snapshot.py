"""Between torch objects and the file: a :class:`Snapshot` is the list of arrays and
attributes a checkpoint holds, taken from a :class:`~hpctrain.state.TrainState` (and put
back into one). Every rank builds the same snapshot: parameters are data-parallel replicas
and rank 0's trainer state (RNG, metadata) is broadcast first.
"""
import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from .. import __version__
from ..errors import CheckpointError
from . import format as fmt


@dataclass
class Entry:
    """One dataset: its path in the file, the array to store, its attributes."""

    path: str
    array: np.ndarray
    attrs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Snapshot:
    entries: List[Entry]
    root_attrs: Dict[str, Any]
    group_attrs: Dict[str, Dict[str, Any]]  # group path -> attributes

    @property
    def nbytes(self):
        return sum(e.array.nbytes for e in self.entries)


# ---------------------------------------------------------------- tensors <-> arrays

def _dtype_name(tensor):
    return str(tensor.dtype).replace("torch.", "")


def tensor_to_array(tensor, copy):
    """The array stored for ``tensor`` and its torch dtype name. ``copy``: own the memory
    (for background writes, so training may change the tensor meanwhile)."""
    import torch

    name = _dtype_name(tensor)
    t = tensor.detach()
    if t.device.type != "cpu":
        t, copy = t.cpu(), False  # .cpu() already made a private copy
    t = t.contiguous()
    raw = fmt.RAW_STORAGE.get(name)
    if raw is not None:
        bits = {"uint16": torch.int16, "uint8": torch.uint8}[raw]
        array = (t.to(torch.uint8) if name == "bool" else t.view(bits)).numpy().view(raw)
    else:
        array = t.numpy()
    if copy:
        array = array.copy()
    return array, name


def array_to_tensor(array, dtype_name):
    import torch

    raw = fmt.RAW_STORAGE.get(dtype_name)
    if raw is None:
        return torch.from_numpy(np.require(array, requirements="C"))
    if dtype_name == "bool":
        return torch.from_numpy(np.require(array, requirements="C")).to(torch.bool)
    bits = {"uint16": np.int16, "uint8": np.uint8}[raw]
    return torch.from_numpy(np.require(array, requirements="C").view(bits)).view(getattr(torch, dtype_name))


# ---------------------------------------------------------------- optimizer parameter names

def optimizer_param_names(model, optimizer):
    """Names of the optimizer's parameters, in the order of its ``state_dict()`` indices."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            names.append(by_id.get(id(p), f"param{len(names)}"))
    return names


# ---------------------------------------------------------------- environment metadata

def _versions():
    import h5py
    import torch

    return {
        "hpctrain_version": __version__,
        "torch_version": str(torch.__version__),
        "h5py_version": h5py.__version__,
        "hdf5_version": h5py.version.hdf5_version,
        "numpy_version": np.__version__,
        "python_version": sys.version.split()[0],
    }


def root_metadata(nranks, run_config, metrics, reason, step, io_mode, nwriters):
    """Attributes of ``/``: computed on rank 0 and broadcast, since parallel HDF5 needs
    every rank to write identical attribute values."""
    from ..world import launch_info

    info = launch_info()
    now = time.time()
    meta = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "step": int(step),
        "reason": reason,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "created_unix": now,
        "nranks": int(nranks),
        "nwriters": int(nwriters),
        "io_mode": io_mode,
        "hostname": socket.gethostname(),
        "run_config": fmt.to_json(run_config or {}),
        "metrics": fmt.to_json(metrics or {}),
    }
    meta.update(_versions())
    if info.slurm_job_id:
        meta["slurm_job_id"] = info.slurm_job_id
    if info.slurm_nodelist:
        meta["slurm_nodelist"] = info.slurm_nodelist
    return meta


def rng_states():
    """This process's torch, numpy and Python generator states (small)."""
    import torch

    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state().numpy().copy(),
        "numpy_keys": np.asarray(np_state[1], dtype=np.uint32).copy(),
        "numpy_meta": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
    }


def set_rng_states(rng):
    import torch

    torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(rng["torch"], dtype=np.uint8)))
    kind, pos, has_gauss, cached = rng["numpy_meta"]
    np.random.set_state((kind, np.asarray(rng["numpy_keys"], dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))


# ---------------------------------------------------------------- taking a snapshot

def _private(path, tensor, copy, buffers):
    """The array for ``tensor``; with ``copy``, in memory training will not touch: the
    buffer ``buffers`` kept for ``path`` from the previous save when it still fits, since
    fresh memory costs a page fault per page on top of the copy."""
    if not copy or buffers is None:
        return tensor_to_array(tensor, copy)
    array, dtype = tensor_to_array(tensor, copy=False)
    if tensor.device.type != "cpu":
        return array, dtype  # .cpu() made it private already
    buf = buffers.get(path)
    if buf is None or buf.shape != array.shape or buf.dtype != array.dtype:
        buf = np.empty_like(array)
    np.copyto(buf, array)
    return buf, dtype


def take_snapshot(state, root_info, copy, buffers=None):
    """Arrays and attributes of a checkpoint of ``state``.

    ``root_info``: ``{"meta": root attributes, "rng": rank 0's RNG states}`` from rank 0.
    ``copy``: copy tensors to private host memory (asynchronous saves). ``buffers``: a dict
    (path -> array) of host buffers to copy into, reused from one save to the next; it is
    updated to hold exactly this snapshot's buffers. Only reuse it once the previous
    snapshot has been written.
    """
    entries, groups = [], {}
    old = dict(buffers) if buffers is not None else None
    if buffers is not None:
        buffers.clear()

    def array_of(path, tensor):
        array, dtype = _private(path, tensor, copy, old)
        if buffers is not None and copy:
            buffers[path] = array
        return array, dtype

    for name, tensor in state.model.state_dict().items():
        path = f"{fmt.MODEL}/{fmt.param_key(name)}"
        array, dtype = array_of(path, tensor)
        entries.append(Entry(path, array, {fmt.DTYPE_ATTR: dtype}))

    opt = state.optimizer.state_dict() if state.optimizer is not None else {"state": {}, "param_groups": []}
    names = optimizer_param_names(state.model, state.optimizer) if state.optimizer is not None else []
    groups_json = []
    for group in opt["param_groups"]:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[i] for i in group["params"]]
        groups_json.append(g)
    groups[fmt.OPTIMIZER] = {
        "param_groups": fmt.to_json(groups_json),
        "class": type(state.optimizer).__name__ if state.optimizer is not None else "",
    }
    groups[fmt.OPT_STATE] = {}
    for index in sorted(opt["state"]):
        pname = names[index] if index < len(names) else f"param{index}"
        group_path = f"{fmt.OPT_STATE}/{fmt.param_key(pname)}"
        values = {}
        for key in sorted(opt["state"][index]):
            value = opt["state"][index][key]
            if hasattr(value, "detach"):
                array, dtype = array_of(f"{group_path}/{key}", value)
                entries.append(Entry(f"{group_path}/{key}", array, {fmt.DTYPE_ATTR: dtype}))
            else:
                values[key] = value
        groups[group_path] = {"values": fmt.to_json(values)}

    p = state.progress
    trainer = {
        "step": int(p.step), "epoch": int(p.epoch), "samples_in_epoch": int(p.samples_in_epoch),
        "seed": int(p.seed), "extra": fmt.to_json(p.extra),
        "best_metric": fmt.to_json(p.best_metric),
    }
    if getattr(state, "scaler", None) is not None:
        trainer["scaler"] = fmt.to_json(state.scaler.state_dict())
    groups[fmt.TRAINER] = trainer
    rng = root_info["rng"]
    groups[fmt.RNG] = {"numpy_meta": fmt.to_json(rng["numpy_meta"]), "python": fmt.to_json(rng["python"])}
    entries.append(Entry(f"{fmt.RNG}/torch", rng["torch"], {fmt.DTYPE_ATTR: "uint8"}))
    entries.append(Entry(f"{fmt.RNG}/numpy_keys", rng["numpy_keys"], {fmt.DTYPE_ATTR: "uint32"}))
    return Snapshot(entries, dict(root_info["meta"]), groups)


# ---------------------------------------------------------------- putting one back

def _check_shapes(expected, found):
    """Raise naming every tensor whose shape differs (model order)."""
    problems = [f"{name}: model has {tuple(shape)}, checkpoint has {tuple(found[name])}"
                for name, shape in expected.items() if name in found and tuple(found[name]) != tuple(shape)]
    if problems:
        raise CheckpointError(
            "shape mismatch between the model and the checkpoint:\n  " + "\n  ".join(problems),
            hint="the model definition (or its config) differs from the run that wrote the checkpoint; "
                 "load it into the same architecture, or start fresh with checkpoint.resume=none")


def check_model_against(model, manifest, path):
    """Compare the model's tensors with the file's before reading any data."""
    found = {fmt.param_name(p.split("/", 1)[1]): shape for p, (shape, _, _) in manifest.items()
             if p.startswith(fmt.MODEL + "/")}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing in the file: {', '.join(missing[:10])}")
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:10])}")
        raise fmt.CheckpointCorrupt(f"{path}: the checkpoint's tensors do not match the model's ({'; '.join(parts)})",
                              hint="load it into the model it was saved from")
    _check_shapes(expected, found)


def restore(state, arrays, attrs, path):
    """Load arrays (path -> (array, dtype name)) and group attributes into ``state``."""
    model_sd = {}
    for name, tensor in state.model.state_dict().items():
        array, dtype = arrays[f"{fmt.MODEL}/{fmt.param_key(name)}"]
        model_sd[name] = array_to_tensor(array, dtype).to(tensor.device)
    state.model.load_state_dict(model_sd, strict=True)

    if state.optimizer is not None:
        names = optimizer_param_names(state.model, state.optimizer)
        index = {n: i for i, n in enumerate(names)}
        saved_groups = json.loads(attrs[fmt.OPTIMIZER]["param_groups"])
        current = [[names[k] for k in g["params"]] for g in state.optimizer.state_dict()["param_groups"]]
        if [g["params"] for g in saved_groups] != current:
            raise CheckpointError(
                f"{path}: the optimizer's parameter groups differ from the checkpoint's "
                f"(file: {[len(g['params']) for g in saved_groups]} parameters per group, "
                f"now: {[len(g) for g in current]})",
                hint="build the optimizer with the same parameter groups as the run that saved it")
        groups = []
        for g in saved_groups:
            g = dict(g)
            g["params"] = [index[n] for n in g["params"]]
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
            groups.append(g)
        opt_state = {}
        prefix = fmt.OPT_STATE + "/"
        for gpath, gattrs in attrs.items():
            if not gpath.startswith(prefix) or "/" in gpath[len(prefix):]:
                continue
            pname = fmt.param_name(gpath[len(prefix):])
            if pname not in index:
                raise CheckpointError(f"{path}: optimizer state for {pname}, which the model does not have")
            values = json.loads(gattrs.get("values", "{}"))
            opt_state[index[pname]] = values
        for dpath, (array, dtype) in arrays.items():
            if dpath.startswith(prefix):
                gkey, key = dpath[len(prefix):].rsplit("/", 1)
                opt_state.setdefault(index[fmt.param_name(gkey)], {})[key] = array_to_tensor(array, dtype)
        state.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})

    t = attrs[fmt.TRAINER]
    p = state.progress
    p.step, p.epoch = int(t["step"]), int(t["epoch"])
    p.samples_in_epoch, p.seed = int(t["samples_in_epoch"]), int(t["seed"])
    p.best_metric = json.loads(t["best_metric"])
    p.extra = json.loads(t["extra"])
    if "scaler" in t and getattr(state, "scaler", None) is not None:
        state.scaler.load_state_dict(json.loads(t["scaler"]))
