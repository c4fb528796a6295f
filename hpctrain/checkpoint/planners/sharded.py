"""Checkpoints of sharded runs (``comm.shard``, :mod:`hpctrain.training.sharding`) in the ordinary format.

A file written here has the same datasets, shapes, attributes and values as a replicated run's
(``/optimizer/state/<param>/<key>`` holds each parameter's whole state tensor); only who writes which rows
differs: every rank writes the rows of the parameters its optimizer slice covers, straight from that slice
(slices end on row boundaries, so each rank's part of a dataset is one block of rows; nothing is gathered, no
rank holds more than its slice). The model's tensors are written and read as in :mod:`.replicated`. A file
saved sharded on 4 ranks resumes replicated on 1, sharded on 2, and the reverse."""
import json
from types import SimpleNamespace

import numpy as np

from ...runtime import allocator
from ...runtime.coordination import all_or_none, everywhere, on_root
from ...errors import CheckpointError
from ..commit import io_mode
from ..content import format as fmt
from ..content import snapshot
from ..content.plan import DatasetPlan, WritePlan, plan_snapshot
from ..content.readplan import DatasetRead, ReadPlan, RegionRead
from ..io import reader
from ..io.iosettings import io_of
from .consistency import check_consistency

STATE_PREFIX = fmt.OPT_STATE + "/"


def is_sharded(state):
    """True when ``state.optimizer`` is a :class:`~hpctrain.training.sharding.ShardedOptimizer`."""
    return bool(getattr(state.optimizer, "sharded", False))


def _description(opt):
    """What :func:`.snapshot.optimizer_parts` gives for the replicated optimizer: groups with
    parameter names, and per parameter its non-tensor state; plus, per group, its shard's state tensors."""
    inner = opt.optimizer
    groups, values, tensors = [], {}, []
    for shard, group, names in zip(opt.shards, inner.state_dict()["param_groups"], opt.group_names()):
        groups.append(dict(group, params=names))
        state = inner.state.get(shard, {})
        if state:
            plain = {k: v for k, v in state.items() if not hasattr(v, "detach")}
            values.update({name: dict(plain) for name in names})
        tensors.append({k: v for k, v in sorted(state.items()) if hasattr(v, "detach")})
    return json.loads(fmt.to_json({"class": type(inner).__name__, "groups": groups, "values": values})), tensors


def _optimizer_plans(opt, tensors, rank, copy):
    """One :class:`~.plan.DatasetPlan` per parameter and state tensor: each rank its rows, from the state of
    its shard of the parameter's group (``tensors[group]``)."""
    plans = []
    lo = opt.bounds[rank][0]
    for (name, shape, pieces), g in zip(opt.layout(), opt.group_of):
        per_row = int(np.prod(shape[1:])) if shape else 1
        shift = opt.parts[g][0] - lo  # where the group's shard starts in this rank's slice
        for key, value in tensors[g].items():
            path = snapshot.optimizer_state_path(name, key)
            if value.dim() == 0:  # e.g. Adam's step: the same on every rank, written by one
                owner = pieces[0][0] if pieces else 0
                array, dtype = snapshot.tensor_to_array(value, copy)
                plans.append(DatasetPlan(path, (), array.dtype, {fmt.DTYPE_ATTR: dtype}, [(owner, ())],
                                         array if rank == owner else None, finite=True))
                continue
            mine, dtype = None, snapshot.dtype_name(value)
            for r, a, b, start in pieces:
                if r == rank:
                    first = start - shift
                    part = value.detach()[first:first + (b - a) * per_row].view((b - a,) + tuple(shape[1:]))
                    mine, dtype = snapshot.tensor_to_array(part, copy)
            stored = np.dtype(fmt.storage_dtype(dtype))
            plans.append(DatasetPlan(path, tuple(shape), stored, {fmt.DTYPE_ATTR: dtype},
                                     [(r, fmt.rows(shape, a, b)) for r, a, b, _ in pieces], mine, finite=True))
    return plans


def plan(state, info, comm, copy=False):
    """This rank's :class:`~.plan.WritePlan` of a sharded ``state`` (collective file, parallel HDF5)."""
    opt, rank = state.optimizer, comm.Get_rank()
    params = {name for name, _ in state.model.named_parameters(remove_duplicate=False)}
    entries = []
    for name, tensor in state.model.state_dict().items():
        array, dtype = snapshot.tensor_to_array(tensor, copy)
        entries.append(snapshot.Entry(snapshot.model_path(name), array, {fmt.DTYPE_ATTR: dtype},
                                      finite=name in params))
    base = plan_snapshot(snapshot.Snapshot(entries + snapshot.rng_entries(info["rng"]), dict(info["meta"]), {}),
                         comm.Get_size(), rank, io_of(info).alignment)
    description, tensors = _description(opt)
    groups = snapshot.optimizer_attrs(description)
    groups.update(snapshot.progress_attrs(state.progress, info["rng"], getattr(state, "scaler", None)))
    datasets = base.datasets[:len(entries)] + _optimizer_plans(opt, tensors, rank, copy) + base.datasets[len(entries):]
    return WritePlan(datasets, base.root_attrs, groups)


class ShardedPlanner:
    """Who writes and reads what of a sharded state (``comm.shard``), for the manager: each rank the rows of
    its optimizer slice, and its share of the model's rows as :class:`~.replicated.ReplicatedPlanner` does."""

    collective_only = False  # loads serially too; saving needs parallel HDF5 (check_parallel says so)

    def __init__(self, comm, consistency="check"):
        self.comm, self.consistency = comm, consistency

    def check_replicas(self, state):
        """Collective: every rank holds the whole model; the copies must agree."""
        check_consistency(state.model, self.comm, self.consistency)

    def plan(self, state, info, parallel, buffers=None):
        """This rank's plan; ``buffers`` given (a background save): its pieces are copies."""
        check_parallel(parallel)
        return plan(state, info, self.comm, copy=buffers is not None)

    def load(self, path, state, restore_rng=True):
        """Collective: read ``path`` into ``state``; returns its header."""
        parallel, _ = io_mode(self.comm)
        with allocator.reusing_large_blocks():
            return load(path, state, self.comm, parallel, restore_rng)


def check_parallel(parallel):
    if not parallel:
        raise everywhere(CheckpointError(
            "comm.shard needs parallel HDF5 to save: each rank writes its optimizer slice into the shared file, "
            "and this h5py has no MPI support (or HPCTRAIN_CKPT_SERIAL=1 is set)",
            hint="build h5py with HDF5_MPI=ON (scripts/setup.sh), unset HPCTRAIN_CKPT_SERIAL, or use comm.shard=none"))


# ---------------------------------------------------------------- loading

def _state_keys(header):
    """``{parameter name: {state key: (shape, numpy dtype, torch dtype name, crc)}}`` of the file."""
    keys = {}
    for path, (shape, dtype, attrs) in header.datasets.items():
        if path.startswith(STATE_PREFIX):
            pkey, key = path[len(STATE_PREFIX):].rsplit("/", 1)
            keys.setdefault(fmt.param_name(pkey), {})[key] = (tuple(shape), np.dtype(dtype),
                                                                attrs[fmt.DTYPE_ATTR], int(attrs[fmt.CRC_ATTR]))
    return keys


def _state_reads(header, opt, rank):
    """This rank's rows of every optimizer state dataset, read into flat slice arrays: ``(datasets, flats,
    scalars, problems)``: a :class:`~.readplan.DatasetRead` per state dataset of the file, the slice arrays by
    state key, the scalars by ``(group, key)`` (read by every rank, checked on the one that writes them) and
    what does not fit."""
    keys = _state_keys(header)
    count = opt.counts[rank]
    reads, flats, scalars, problems = {}, {}, {}, []
    for (name, shape, pieces), g in zip(opt.layout(), opt.group_of):
        per_row = int(np.prod(shape[1:])) if shape else 1
        for key, (dshape, dtype, tname, crc) in sorted(keys.get(name, {}).items()):
            path = snapshot.optimizer_state_path(name, key)
            if dshape == ():
                value = np.empty((), dtype=dtype)
                scalars.setdefault((g, key), (value, tname))  # the group's first parameter's
                owner = pieces[0][0] if pieces else 0
                reads[path] = DatasetRead(path, (), dtype, crc, tname, [RegionRead((), value, rank == owner)],
                                          failure=READ_FAILURE)
                continue
            if dshape != tuple(shape):
                problems.append(f"/{path} has shape {dshape}, the parameter {shape}")
                continue
            flat = flats.get(key)
            if flat is None:
                flat = flats[key] = np.empty(count, dtype=dtype)
            regions = [RegionRead(fmt.rows(dshape, a, b),
                                  flat[start:start + (b - a) * per_row].reshape((b - a,) + tuple(shape[1:])))
                       for r, a, b, start in pieces if r == rank]
            reads[path] = DatasetRead(path, dshape, dtype, crc, tname, regions, finite="the state",
                                      failure=READ_FAILURE)
    for path in header.datasets:  # state that no parameter here has: nothing read, so its checksum fails
        if path.startswith(STATE_PREFIX) and path not in reads:
            shape, dtype, attrs = header.datasets[path]
            reads[path] = DatasetRead(path, tuple(shape), np.dtype(dtype), int(attrs[fmt.CRC_ATTR]),
                                      attrs[fmt.DTYPE_ATTR], [])
    return list(reads.values()), flats, scalars, problems


READ_FAILURE = "reading the optimizer state"


def _check_header(h, opt, path):
    """Raise CheckpointError if ``h`` does not fit the sharded optimizer ``opt``."""
    saved = json.loads(h.group_attrs.get(fmt.OPTIMIZER, {}).get("param_groups", "[]"))
    groups = opt.group_names()
    if [g.get("params") for g in saved] != groups:
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups differ from the checkpoint's (file: "
            f"{[len(g.get('params', [])) for g in saved]} parameters per group, now: {list(map(len, groups))})",
            hint="build the optimizer with the same parameter groups as the run that saved it")
    # A group's shard spans parameters: it can only be filled when each of them has the same state.
    keys = _state_keys(h)
    for names in groups:
        every = {key for name in names for key in keys.get(name, {})}
        lacking = [name for name in names if keys and set(keys.get(name, {})) != every]
        if lacking:
            raise CheckpointError(
                f"{path}: the optimizer state of {', '.join(lacking[:5])} lacks some of "
                f"{', '.join(sorted(every))}, which other parameters of its group have; a sharded run needs "
                f"the same state for every parameter of a group", hint="resume this checkpoint with comm.shard=none")


def load(path, state, comm, parallel, restore_rng=True):
    """Collective: read checkpoint ``path`` (written sharded or not, on any rank count) into a sharded
    ``state``: the whole model on every rank, the optimizer state of this rank's slice only. The same
    :class:`CheckpointError` on every rank before anything changes."""
    opt, rank = state.optimizer, comm.Get_rank()

    def header():
        h = reader.read_header(path)
        snapshot.check_model_against(state.model, h.datasets, path)
        _check_header(h, opt, path)
        return h

    h = on_root(header, comm)
    # Two plans, read one after the other: the model's rows first, as a replicated load reads them, so a
    # damaged model is reported alone, before the optimizer state is read.
    arrays = reader.read_arrays(h, comm, parallel, keep=lambda p: not p.startswith(STATE_PREFIX))
    state_reads, flats, scalars, problems = _state_reads(h, opt, rank)
    reader.read(ReadPlan(h.path, sorted(state_reads, key=lambda d: d.path), parallel, problems=problems,
                         opening=READ_FAILURE), comm)
    dtypes = {key: tname for per in _state_keys(h).values() for key, (_, _, tname, _) in per.items()}
    tensors = {k: snapshot.array_to_tensor(v, dtypes[k]) for k, v in flats.items()}
    typed = {p: (a, h.datasets[p][2][fmt.DTYPE_ATTR]) for p, a in arrays.items()}

    def apply():
        lo = opt.bounds[comm.Get_rank()][0]
        keys = _state_keys(h)
        groups, per_group = [], {}
        for g, (group, names, (a, b)) in enumerate(zip(json.loads(h.group_attrs[fmt.OPTIMIZER]["param_groups"]),
                                                       opt.group_names(), opt.parts)):
            group = dict(group, params=[g])
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])
            groups.append(group)
            own = {}  # the group's shard's state: its part of the slice's tensors, its first parameter's rest
            for key in keys.get(names[0], {}) if names else ():
                if (g, key) in scalars:
                    value, tname = scalars[(g, key)]
                    own[key] = snapshot.array_to_tensor(np.array(value), tname)
                else:
                    own[key] = tensors[key][a - lo:b - lo].to(opt.flat.device)
            if own:
                attrs = h.group_attrs.get(f"{fmt.OPT_STATE}/{fmt.param_key(names[0])}", {})
                own.update(json.loads(attrs.get("values", "{}")))
                per_group[g] = own
        view = SimpleNamespace(model=state.model, optimizer=None, progress=state.progress,
                               scaler=getattr(state, "scaler", None))
        snapshot.restore(view, typed, h.group_attrs, path)
        opt.optimizer.load_state_dict({"state": per_group, "param_groups": groups})
        if restore_rng and comm.Get_rank() == 0:
            snapshot.restore_rng(arrays, h.group_attrs)

    all_or_none(apply, comm)
    return h
