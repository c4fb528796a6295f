"""Checkpoints of split models, in the ordinary checkpoint format (docs/checkpoint-format.md).

The file holds *global* tensors under the full model's names and shapes, as if one process had saved the
whole model: ``/model/3.fc1.weight`` is ``[256, 64]`` whether trained on one rank, two pipeline stages or
four tensor ranks. So a file written in one layout loads in any other (also plain
:func:`hpctrain.checkpoint.load_checkpoint` into the dense model, and ``hpctrain ckpt export``).

Saving runs the data-parallel save pipeline (:mod:`hpctrain.checkpoint.commit`): each stage's replicas are
checked for consistency, rank 0 names a temp file, every rank writes its pieces with the one writer, the file
is re-read, verified and committed. Only the plan differs: every rank describes the region of each global
tensor it holds, and the ranks holding one region (the stage's replicas, and for unsplit tensors its tensor
ranks too) share its rows (:func:`plan_writes`). Loading: rank 0 reads the header, every rank checks the
tensors it needs against the file's names and shapes, then every rank reads its regions and a share of every
dataset for the checksums through the one read path (:func:`hpctrain.checkpoint.io.reader.read`) and restores
them as a data-parallel load does (:func:`hpctrain.checkpoint.content.snapshot.restore`)."""
import math
import os

import numpy as np

from ..checkpoint.planners import (DatasetPlan, ReadPlan, RegionRead, WritePlan, begin, check_consistency, fmt,
                                   h5py_parallel, plan_checksums, read, read_header, snapshot, write_into_place)
from ..runtime.coordination import all_or_none, everywhere, on_root
from ..errors import CheckpointError
from ..state import Progress, TrainState
from .layout import rank_of
from .tensor import shard_dims


# ---------------------------------------------------------------- what this rank holds

class Held:
    """A local tensor and its place in the global ``shape``: ``region`` is a ``(start, stop)`` per dim."""

    def __init__(self, path, tensor, shape, region, dtype):
        self.path, self.tensor, self.shape, self.region, self.dtype = path, tensor, tuple(shape), tuple(region), dtype


def _placement(local_shape, shard):
    """Global shape and region of a local tensor split along ``shard = (dim, rank, size)``."""
    if shard is None:
        return tuple(local_shape), tuple((0, n) for n in local_shape)
    dim, rank, size = shard
    shape = list(local_shape)
    shape[dim] = local_shape[dim] * size
    region = [(0, n) for n in shape]
    region[dim] = (rank * local_shape[dim], (rank + 1) * local_shape[dim])
    return tuple(shape), tuple(region)


def held_tensors(module, opt_tensors=()):
    """``[Held]`` for this rank's model tensors and optimizer state (``opt_tensors``, from
    :func:`~hpctrain.checkpoint.content.snapshot.optimizer_parts`), under global names."""
    shards = shard_dims(module)
    params = dict(module.named_parameters())
    out = []
    for name, t in module.state_dict().items():
        shape, region = _placement(tuple(t.shape), shards.get(name))
        out.append(Held(snapshot.model_path(name), t, shape, region, snapshot.dtype_name(t)))
    for pname, key, value in opt_tensors:
        # State shaped like a split parameter (momentum, Adam moments) is split like it;
        # anything else (Adam's step counter) is the same on every tensor rank.
        same = tuple(value.shape) == tuple(params[pname].shape)
        shape, region = _placement(tuple(value.shape), shards.get(pname) if same else None)
        out.append(Held(snapshot.optimizer_state_path(pname, key), value, shape, region, snapshot.dtype_name(value)))
    return out


# ---------------------------------------------------------------- who writes what (pure)

def plan_writes(described):
    """``described``: per rank, a list of ``(path, shape, dtype, region)``. Returns
    ``(order, datasets, plan)``: dataset paths in first-seen order; ``{path: (shape, dtype)}``;
    ``{path: [(rank, subregion)]}``, where the ranks holding one region share its rows. Raises CheckpointError
    if the ranks disagree on a tensor or leave part of it uncovered."""
    order, datasets, holders, problems = [], {}, {}, []
    for rank, items in enumerate(described):
        for path, shape, dtype, region in items:
            if path not in datasets:
                order.append(path)
                datasets[path] = (shape, dtype)
                holders[path] = {}
            elif datasets[path] != (shape, dtype):
                problems.append(f"/{path}: rank {rank} has {list(shape)} {dtype}, another rank "
                                f"{list(datasets[path][0])} {datasets[path][1]}")
            holders[path].setdefault(region, []).append(rank)
    plan = {}
    for path in order:
        shape = datasets[path][0]
        regions = sorted(holders[path])
        covered = sum(math.prod(b - a for a, b in r) for r in regions)
        if covered != math.prod(shape):
            problems.append(f"/{path}: the ranks hold {covered} of its {math.prod(shape)} elements")
        pieces = []
        for region in regions:
            ranks = holders[path][region]
            if not shape:
                pieces.append((ranks[0], region))
                continue
            a, b = region[0]
            for j, rank in enumerate(ranks):  # split the region's rows among its copies
                lo, hi = a + (b - a) * j // len(ranks), a + (b - a) * (j + 1) // len(ranks)
                if hi > lo:
                    pieces.append((rank, ((lo, hi),) + region[1:]))
        plan[path] = pieces
    if problems:
        raise CheckpointError(
            "the ranks do not hold a consistent split model:\n  " + "\n  ".join(problems[:20]),
            hint="every rank must build the same model with the same layout before saving")
    return order, datasets, plan


# ---------------------------------------------------------------- saving

def _merged_optimizer(grid, descriptions):
    """The whole model's optimizer from every rank's description: the param groups of
    replica 0, tensor rank 0 of each stage, joined in stage order."""
    merged = {"class": "", "groups": [], "values": {}}
    for stage in range(grid.layout.stages):
        opt = descriptions[rank_of(0, stage, 0, grid.layout)]
        if not opt["class"]:  # no optimizer
            continue
        merged["class"] = opt["class"]
        if merged["groups"] and len(opt["groups"]) != len(merged["groups"]):
            raise CheckpointError(
                f"the stages' optimizers have different numbers of parameter groups "
                f"({len(merged['groups'])} and {len(opt['groups'])})",
                hint="give every stage's optimizer the same groups")
        for g, group in enumerate(opt["groups"]):
            if g == len(merged["groups"]):
                merged["groups"].append(dict(group, params=[]))
            merged["groups"][g]["params"] += group["params"]
        merged["values"].update(opt["values"])
    return merged


def layout_attr(grid):
    layout = grid.layout
    return fmt.to_json({"stages": layout.stages, "replicas": layout.replicas, "tensor": layout.tensor})


def _plan(module, optimizer, grid, progress, info):
    """The writer's plan of this rank: its pieces of every global tensor, as
    :func:`plan_writes` shares them out, and rank 0's generator states."""
    comm, rank = grid.comm, grid.comm.Get_rank()
    description, opt_tensors = snapshot.optimizer_parts(module, optimizer)
    held = held_tensors(module, opt_tensors)
    everyone = comm.allgather(([(h.path, h.shape, h.dtype, h.region) for h in held], description))
    (order, shapes, pieces), merged = all_or_none(
        lambda: (plan_writes([d for d, _ in everyone]), _merged_optimizer(grid, [o for _, o in everyone])), comm)
    groups = snapshot.optimizer_attrs(merged)
    groups.update(snapshot.progress_attrs(progress if progress is not None else Progress(), info["rng"]))
    mine = {h.path: h for h in held}
    datasets = []
    for prefix in (fmt.MODEL + "/", fmt.OPT_STATE + "/"):
        for path in (p for p in order if p.startswith(prefix)):
            shape, dtype = shapes[path]
            region, part = next((sub for r, sub in pieces[path] if r == rank), None), None
            if region is not None:
                h = mine[path]
                array, _ = snapshot.tensor_to_array(h.tensor, copy=False)
                if h.shape:  # its rows of the local tensor (a sub-region differs from its region in dim 0 only)
                    array = array[region[0][0] - h.region[0][0]:region[0][1] - h.region[0][0]]
                part = np.require(array, requirements="C")  # (a 0-d array is not indexed: () would give a scalar)
            datasets.append(DatasetPlan(path, shape, np.dtype(fmt.storage_dtype(dtype)),
                                               {fmt.DTYPE_ATTR: dtype}, pieces[path], part))
    for e in snapshot.rng_entries(info["rng"]):  # rank 0's generators, written by rank 0
        whole = [(0, fmt.rows(e.array.shape, 0, e.array.shape[0]))]
        datasets.append(DatasetPlan(e.path, e.array.shape, e.array.dtype, e.attrs, whole,
                                           e.array if rank == 0 else None))
    return WritePlan(datasets, info["meta"], groups)


def save_parallel_checkpoint(path, module, optimizer, grid, progress=None, run_config=None, metrics=None,
                             reason="manual", verify=True, consistency="check"):
    """Collective over ``grid.comm``: save this stage's ``module`` and ``optimizer`` (each rank its part)
    to ``path``; ``consistency`` (``check``, ``repair``, ``off``): how each stage's replicas are compared.

    >>> save_parallel_checkpoint("run/ckpt-00000100.h5", pipe.module, opt, grid, progress)  # doctest: +SKIP
    """
    _require_parallel_h5py()
    # The replicas of a stage (and tensor rank) hold the same regions: they must agree.
    all_or_none(lambda: check_consistency(module, grid.dp_comm, consistency), grid.comm)
    info = begin(path, grid.comm, True, run_config=run_config, metrics=metrics, reason=reason,
                 step=0 if progress is None else progress.step, extra={"parallel_layout": layout_attr(grid)})
    return write_into_place(_plan(module, optimizer, grid, progress, info), info, grid.comm, True, verify)


def _require_parallel_h5py():
    if not h5py_parallel():
        raise everywhere(CheckpointError(
            "checkpoints of split models are written collectively, but h5py was built without MPI support",
            hint="build h5py against parallel HDF5 (`make setup`)"))


class SplitPlanner:
    """Who writes and reads what of a split model's state, for the checkpoint manager
    (:class:`~hpctrain.checkpoint.manager.CheckpointManager`): each rank the regions it holds."""

    collective_only = True

    def __init__(self, grid, consistency="check"):
        _require_parallel_h5py()
        self.grid, self.consistency = grid, consistency

    def check_replicas(self, state):
        all_or_none(lambda: check_consistency(state.model, self.grid.dp_comm, self.consistency), self.grid.comm)

    def plan(self, state, info, parallel, buffers=None):
        info["meta"]["parallel_layout"] = layout_attr(self.grid)
        return _plan(state.model, state.optimizer, self.grid, state.progress, info)

    def load(self, path, state):
        return load_parallel_checkpoint(path, state.model, state.optimizer, self.grid, state.progress)


# ---------------------------------------------------------------- loading

def _wanted_state(module, header):
    """``[Held]`` for the optimizer state of this rank's parameters in the file,
    placed like each parameter when shaped like it (a fresh optimizer has no state to ask)."""
    shards = shard_dims(module)
    out = []
    for pname, param in module.named_parameters():
        gshape, region = _placement(tuple(param.shape), shards.get(pname))
        prefix = f"{fmt.OPT_STATE}/{fmt.param_key(pname)}/"
        for p, (shape, _, attrs) in sorted(header.datasets.items()):
            if p.startswith(prefix) and "/" not in p[len(prefix):]:
                placed = (param, gshape, region) if tuple(shape) == gshape else (None, shape, [(0, n) for n in shape])
                out.append(Held(p, *placed, attrs[fmt.DTYPE_ATTR]))
    return out


def _check_against(header, held, layout_text, path):
    problems = []
    for h in held:
        found = header.datasets.get(h.path)
        if found is None:
            problems.append(f"/{h.path} is not in the file")
        elif tuple(found[0]) != h.shape:
            problems.append(f"/{h.path}: this layout needs a tensor of shape {list(h.shape)}, the file has "
                            f"{list(found[0])}")
    if problems:
        raise CheckpointError(
            f"{path} does not fit this model (saved with layout {layout_text}):\n  " + "\n  ".join(problems[:20]),
            hint="build the same model (layer sizes and names) as the run that saved it; the number of "
                 "stages, replicas and tensor ranks may differ")


def _read_plan(header, held, rank, nranks, rng):
    """This rank's :class:`ReadPlan` and the ``{path: array}`` it fills: the regions of ``held`` (and, with
    ``rng``, the generator states), unchecked, since the ranks' regions overlap and need not cover the file;
    every dataset's checksum instead from the rows each of ``nranks`` ranks reads for it alone."""
    reads = {d.path: d for d in plan_checksums(header, sorted(header.datasets), rank, nranks)}
    wanted = [(h.path, h.region) for h in held]
    if rng and f"{fmt.RNG}/torch" in header.datasets:
        wanted += [(f"{fmt.RNG}/{key}", None) for key in ("torch", "numpy_keys")]
    arrays = {}
    for path, region in wanted:
        d = reads[path]
        region = tuple((0, n) for n in d.shape) if region is None else region
        arrays[path] = np.empty(tuple(b - a for a, b in region), dtype=d.dtype)
        d.regions.append(RegionRead(region, arrays[path], checked=False))
    return ReadPlan(header.path, list(reads.values()), True, error=CheckpointError), arrays


def load_parallel_checkpoint(path, module, optimizer, grid, progress=None, restore_rng=True):
    """Collective over ``grid.comm``: load ``path`` (written in any layout, or by the data-parallel trainer)
    into this stage's ``module`` and ``optimizer``; returns the file's header. If the file does not fit,
    raises the same :class:`CheckpointError` on every rank, before anything changes.

    >>> load_parallel_checkpoint("run/ckpt-00000100.h5", pipe.module, opt, grid, progress)  # doctest: +SKIP
    """
    comm = grid.comm
    path = os.path.abspath(os.fspath(path))
    header = on_root(lambda: read_header(path), comm)
    model = held_tensors(module)
    saved_layout = header.root_attrs.get("parallel_layout",
                                         f"data parallel over {header.root_attrs.get('nranks')} ranks")
    all_or_none(lambda: _check_against(header, model, saved_layout, path), comm)
    # Every model tensor of the file must land somewhere in this layout.
    names = set().union(*comm.allgather({h.path for h in model}))
    extra = sorted(p for p in header.datasets if p.startswith(fmt.MODEL + "/") and p not in names)
    if extra:
        raise everywhere(CheckpointError(
            f"{path} holds tensors that no stage of this model has: " + ", ".join("/" + p for p in extra[:10]),
            hint="build the same model as the run that saved it (the layout may differ)"))
    wanted = _wanted_state(module, header) if optimizer is not None else []
    plan, arrays = _read_plan(header, model + wanted, comm.Get_rank(), comm.Get_size(),
                              restore_rng and comm.Get_rank() == 0)
    read(plan, comm)
    state = TrainState(module, optimizer, progress if progress is not None else Progress())
    typed = {p: (a, header.datasets[p][2][fmt.DTYPE_ATTR]) for p, a in arrays.items()}
    all_or_none(lambda: snapshot.restore(state, typed, header.group_attrs, path, partial=True), comm)
    if f"{fmt.RNG}/torch" in arrays:
        snapshot.restore_rng(arrays, header.group_attrs)
    return header


# ---------------------------------------------------------------- the whole model in one place

def gather_state(module, optimizer, grid, root=0):
    """Collective: on ``root``, the full model's ``{name: tensor}`` and optimizer state
    ``{name: {key: tensor}}`` assembled from every stage and tensor rank (replica 0's);
    ``None`` elsewhere. Pickles through MPI: for small models, tests and exports."""
    import torch

    held = held_tensors(module, snapshot.optimizer_parts(module, optimizer)[1]) if grid.replica == 0 else []
    parts = grid.comm.gather([(h.path, h.shape, h.region, h.tensor.detach().cpu().clone()) for h in held], root=root)
    if grid.comm.Get_rank() != root:
        return None
    full = {}
    for rank_parts in parts:
        for p, shape, region, t in rank_parts:
            if p not in full:
                full[p] = torch.empty(shape, dtype=t.dtype)
            full[p][fmt.slices(region)] = t
    model = {fmt.param_name(p.split("/", 1)[1]): t for p, t in full.items() if p.startswith(fmt.MODEL + "/")}
    opt = {}
    for p, t in full.items():
        if p.startswith(fmt.OPT_STATE + "/"):
            gkey, key = p[len(fmt.OPT_STATE) + 1:].rsplit("/", 1)
            opt.setdefault(fmt.param_name(gkey), {})[key] = t
    return {"model": model, "optimizer": opt}
