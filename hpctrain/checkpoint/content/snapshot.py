"""Between torch objects and the file: a :class:`Snapshot` is the list of arrays and attributes a checkpoint
holds, taken from a :class:`~hpctrain.state.TrainState` (and put back into one). Every rank builds the same
snapshot: parameters are data-parallel replicas and rank 0's trainer state (RNG, metadata: :mod:`.metadata`)
is broadcast first. Split models (``hpctrain.parallel.checkpoint``) build their optimizer, trainer and RNG
attributes with the same functions, and are restored by :func:`restore` with ``partial``."""
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from ...errors import CheckpointError
from . import format as fmt
from .metadata import set_rng_states


@dataclass
class Entry:
    """One dataset: its path in the file, the array to store, its attributes."""

    path: str
    array: np.ndarray
    attrs: Dict[str, Any] = field(default_factory=dict)
    finite: bool = False  # a parameter or optimizer state: NaN or infinity refuses the save
    private: bool = False  # ``array`` is the snapshot's own memory, not a view of training's tensor


@dataclass
class Snapshot:
    entries: List[Entry]
    root_attrs: Dict[str, Any]
    group_attrs: Dict[str, Dict[str, Any]]  # group path -> attributes


# ---------------------------------------------------------------- tensors <-> arrays

def dtype_name(tensor):
    """``"float32"``, ``"bfloat16"``...: the torch dtype without ``torch.``."""
    return str(tensor.dtype).replace("torch.", "")


def tensor_to_array(tensor, copy):
    """The array stored for ``tensor`` and its torch dtype name. ``copy``: own the memory
    (for background writes, so training may change the tensor meanwhile)."""
    import torch

    name = dtype_name(tensor)
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


def array_to_tensor(array, dtype):
    """The tensor of a stored array; ``dtype``: its torch dtype name (attribute ``dtype``)."""
    import torch

    raw = fmt.RAW_STORAGE.get(dtype)
    if raw is None:
        return torch.from_numpy(np.require(array, requirements="C"))
    if dtype == "bool":
        return torch.from_numpy(np.require(array, requirements="C")).to(torch.bool)
    bits = {"uint16": np.int16, "uint8": np.uint8}[raw]
    return torch.from_numpy(np.require(array, requirements="C").view(bits)).view(getattr(torch, dtype))


# ---------------------------------------------------------------- names in the file

def model_path(name):
    """Dataset path of the model tensor ``name`` of ``state_dict()``."""
    return f"{fmt.MODEL}/{fmt.param_key(name)}"


def optimizer_state_path(pname, key):
    """Dataset path of the optimizer state ``key`` (``exp_avg``...) of parameter ``pname``."""
    return f"{fmt.OPT_STATE}/{fmt.param_key(pname)}/{key}"


COMM = "comm"  # the communication mode's tensors (comm.mode, hpctrain.training.comm_modes)


def comm_path(name):
    """Dataset path of the communication mode's tensor ``name``, ``<kind>/<parameter name>``
    (``outer_momentum/fc.weight`` -> ``comm/outer_momentum/fc.weight``)."""
    kind, _, pname = name.partition("/")
    return f"{COMM}/{kind}/{fmt.param_key(pname)}"


def comm_name(path):
    """The inverse of :func:`comm_path`."""
    kind, _, key = path[len(COMM) + 1:].partition("/")
    return f"{kind}/{fmt.param_name(key)}"


def optimizer_param_names(model, optimizer):
    """Names of the optimizer's parameters, in the order of its ``state_dict()`` indices."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]


def optimizer_parts(model, optimizer):
    """The optimizer of ``model`` as the file holds it: ``(description, tensors)``. ``description`` (plain
    JSON values, the same on every replica): ``{"class": name, "groups": param_groups with parameter names in
    place of indices, "values": {parameter name: its non-tensor state}}``. ``tensors``: ``[(parameter name,
    key, tensor)]`` of its state."""
    if optimizer is None:
        return {"class": "", "groups": [], "values": {}}, []
    names = optimizer_param_names(model, optimizer)
    sd = optimizer.state_dict()
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    values, tensors = {}, []
    for index in sorted(sd["state"]):
        pname = names[index] if index < len(names) else f"param{index}"
        items = sorted(sd["state"][index].items())
        values[pname] = {key: value for key, value in items if not hasattr(value, "detach")}
        tensors += [(pname, key, value) for key, value in items if hasattr(value, "detach")]
    return json.loads(fmt.to_json({"class": type(optimizer).__name__, "groups": groups, "values": values})), tensors


def optimizer_attrs(description):
    """Group attributes of ``/optimizer`` and ``/optimizer/state/<param>`` (see :func:`optimizer_parts`)."""
    groups = {fmt.OPTIMIZER: {"param_groups": fmt.to_json(description["groups"]), "class": description["class"]},
              fmt.OPT_STATE: {}}
    for pname, values in description["values"].items():
        groups[f"{fmt.OPT_STATE}/{fmt.param_key(pname)}"] = {"values": fmt.to_json(values)}
    return groups


def progress_attrs(progress, rng, scaler=None):
    """Group attributes of ``/trainer`` and ``/trainer/rng``: ``progress``, rank 0's ``rng``."""
    p = progress
    trainer = {"step": int(p.step), "epoch": int(p.epoch), "samples_in_epoch": int(p.samples_in_epoch),
               "seed": int(p.seed), "extra": fmt.to_json(p.extra), "best_metric": fmt.to_json(p.best_metric)}
    if scaler is not None:
        trainer["scaler"] = fmt.to_json(scaler.state_dict())
    return {fmt.TRAINER: trainer,
            fmt.RNG: {"numpy_meta": fmt.to_json(rng["numpy_meta"]), "python": fmt.to_json(rng["python"])}}


def rng_entries(rng):
    """The datasets of rank 0's generator states."""
    return [Entry(f"{fmt.RNG}/torch", rng["torch"], {fmt.DTYPE_ATTR: "uint8"}),
            Entry(f"{fmt.RNG}/numpy_keys", rng["numpy_keys"], {fmt.DTYPE_ATTR: "uint32"})]


# ---------------------------------------------------------------- taking a snapshot

def take_snapshot(state, root_info):
    """Arrays and attributes of a checkpoint of ``state``; ``root_info``: ``{"meta": root attributes, "rng":
    rank 0's RNG states}`` from rank 0. The arrays of CPU tensors are views of them (a background save copies
    only the rows its rank writes, once it has its plan: :func:`.plan.copy_own_pieces`)."""

    def entry(path, tensor, finite):
        array, dtype = tensor_to_array(tensor, copy=False)
        return Entry(path, array, {fmt.DTYPE_ATTR: dtype}, finite=finite,
                     private=tensor.device.type != "cpu")  # .cpu() made a private copy

    description, opt_tensors = optimizer_parts(state.model, state.optimizer)
    params = {name for name, _ in state.model.named_parameters(remove_duplicate=False)}
    entries = [entry(model_path(name), t, name in params) for name, t in state.model.state_dict().items()]
    entries += [entry(optimizer_state_path(pname, key), t, True) for pname, key, t in opt_tensors]
    mode = getattr(state, "comm_mode", None)
    if mode is not None:  # collective: the stale mode waits here for an average in flight
        entries += [entry(comm_path(name), t, True) for name, t in mode.checkpoint_tensors().items()]
    entries += rng_entries(root_info["rng"])
    groups = optimizer_attrs(description)
    groups.update(progress_attrs(state.progress, root_info["rng"], getattr(state, "scaler", None)))
    return Snapshot(entries, dict(root_info["meta"]), groups)


# ---------------------------------------------------------------- putting one back

def check_model_against(model, manifest, path):
    """Compare the model's tensors with the file's before reading any data."""
    found = {fmt.param_name(p.split("/", 1)[1]): shape for p, (shape, _, _) in manifest.items()
             if p.startswith(fmt.MODEL + "/")}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    parts = [f"{what}: {', '.join(names[:10])}" for what, names in
             (("missing in the file", missing), ("not in the model", unexpected)) if names]
    if parts:
        raise fmt.CheckpointCorrupt(f"{path}: the checkpoint's tensors do not match the model's ({'; '.join(parts)})",
                                    hint="load it into the model it was saved from")
    problems = [f"{name}: model has {tuple(shape)}, checkpoint has {tuple(found[name])}"
                for name, shape in expected.items() if name in found and tuple(found[name]) != tuple(shape)]
    if problems:  # in model order
        raise CheckpointError(
            "shape mismatch between the model and the checkpoint:\n  " + "\n  ".join(problems),
            hint="the model definition (or its config) differs from the run that wrote the checkpoint; "
                 "load it into the same architecture, or start fresh with checkpoint.resume=none")


def in_place_targets(state, datasets):
    """``{dataset path: (array, tensor)}``: the tensors of ``state`` a load can read straight into (on the
    CPU, contiguous, of the stored dtype and shape, sharing memory with no other: tied weights are read into
    fresh arrays), each with the numpy view of its memory. Reading into them needs no new memory (fresh pages
    cost a fault on first touch), and the load does not hold the state twice."""
    candidates = [(model_path(name), tensor) for name, tensor in state.model.state_dict().items()]
    if state.optimizer is not None:
        candidates += [(optimizer_state_path(pname, key), tensor)
                       for pname, key, tensor in optimizer_parts(state.model, state.optimizer)[1]]
    users = Counter(t.untyped_storage().data_ptr() for _, t in candidates if t.device.type == "cpu")
    targets = {}
    for dpath, tensor in candidates:
        stored = datasets.get(dpath)
        if (stored is None or tensor.device.type != "cpu" or not tensor.is_contiguous()
                or users[tensor.untyped_storage().data_ptr()] != 1 or dtype_name(tensor) == "bool"
                or stored[2].get(fmt.DTYPE_ATTR) != dtype_name(tensor) or tuple(stored[0]) != tuple(tensor.shape)):
            continue
        array, _ = tensor_to_array(tensor, copy=False)
        if array.dtype == np.dtype(stored[1]) and array.flags.c_contiguous and array.flags.writeable:
            targets[dpath] = (array, tensor)
    return targets


def restore(state, arrays, attrs, path, partial=False, own=None):
    """Load arrays (path -> (array, dtype name)) and group attributes into ``state``; on an error nothing has
    changed. ``partial``: ``state.model`` is a part of the saved model (a pipeline stage): the optimizer takes
    the saved groups' hyperparameters and the state of the parameters it has. ``own``: path -> the state's own
    tensor that already holds the array (read in place, :func:`in_place_targets`): kept, not copied."""
    own = own or {}

    def tensor_of(dpath, device):
        return own[dpath] if dpath in own else array_to_tensor(*arrays[dpath]).to(device)

    model_sd = {name: tensor_of(model_path(name), tensor.device)
                for name, tensor in state.model.state_dict().items()}
    opt_sd = None if state.optimizer is None else _optimizer_state(state, arrays, attrs, path, partial, own)
    state.model.load_state_dict(model_sd, strict=True)
    if opt_sd is not None:
        state.optimizer.load_state_dict(opt_sd)
    t = attrs[fmt.TRAINER]
    p = state.progress
    p.step, p.epoch = int(t["step"]), int(t["epoch"])
    p.samples_in_epoch, p.seed = int(t["samples_in_epoch"]), int(t["seed"])
    p.best_metric, p.extra = json.loads(t["best_metric"]), json.loads(t["extra"])
    if "scaler" in t and getattr(state, "scaler", None) is not None:
        state.scaler.load_state_dict(json.loads(t["scaler"]))
    if getattr(state, "comm_mode", None) is not None:
        state.comm_mode.restore_tensors({comm_name(p): array_to_tensor(*v)
                                    for p, v in arrays.items() if p.startswith(COMM + "/")})


def check_optimizer_groups(state, attrs, path, partial=False):
    """Raise CheckpointError if the saved optimizer's parameter groups or state do not fit
    ``state.optimizer``: before a load reads anything into the state."""
    if state.optimizer is not None:
        _optimizer_groups(state, attrs, path, partial)


def _optimizer_groups(state, attrs, path, partial):
    """``(parameter index by name, param_groups, non-tensor state by index)`` of the file."""
    names = optimizer_param_names(state.model, state.optimizer)
    index = {n: i for i, n in enumerate(names)}
    saved_groups = json.loads(attrs[fmt.OPTIMIZER]["param_groups"])
    saved = [[n for n in g["params"] if not partial or n in index] for g in saved_groups]
    current = [[names[k] for k in g["params"]] for g in state.optimizer.state_dict()["param_groups"]]
    if saved != current:
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups differ from the checkpoint's "
            f"(file: {[len(g) for g in saved]} parameters per group, now: {[len(g) for g in current]})",
            hint="build the optimizer with the same parameter groups as the run that saved it")
    groups = []
    for g, gnames in zip(saved_groups, saved):
        g = dict(g, params=[index[n] for n in gnames])
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt_state = {}
    prefix = fmt.OPT_STATE + "/"
    for gpath, gattrs in attrs.items():
        if not gpath.startswith(prefix) or "/" in gpath[len(prefix):]:
            continue
        pname = fmt.param_name(gpath[len(prefix):])
        if pname in index:
            opt_state[index[pname]] = json.loads(gattrs.get("values", "{}"))
        elif not partial:
            raise CheckpointError(f"{path}: optimizer state for {pname}, which the model does not have")
    return index, groups, opt_state


def _optimizer_state(state, arrays, attrs, path, partial, own):
    index, groups, opt_state = _optimizer_groups(state, attrs, path, partial)
    prefix = fmt.OPT_STATE + "/"
    for dpath, (array, dtype) in arrays.items():
        if dpath.startswith(prefix):
            gkey, key = dpath[len(prefix):].rsplit("/", 1)
            value = own[dpath] if dpath in own else array_to_tensor(array, dtype)
            opt_state.setdefault(index[fmt.param_name(gkey)], {})[key] = value
    return {"state": opt_state, "param_groups": groups}


def restore_rng(arrays, attrs):
    """Set this process's generators to the saved ones (``arrays``: path -> array)."""
    rng = attrs.get(fmt.RNG, {})
    set_rng_states({"torch": arrays[f"{fmt.RNG}/torch"], "numpy_keys": arrays[f"{fmt.RNG}/numpy_keys"],
                    "numpy_meta": json.loads(rng["numpy_meta"]), "python": json.loads(rng["python"])})
