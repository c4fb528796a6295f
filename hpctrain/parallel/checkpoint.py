"""Checkpoints of split models, in the ordinary checkpoint format (docs/checkpoint-format.md).

The file holds *global* tensors under the full model's names and shapes, exactly as if one
process had saved the whole model: ``/model/3.fc1.weight`` is ``[256, 64]`` whether it was
trained on one rank, on two pipeline stages, or split over four tensor ranks. So a file
written in one layout loads in any other (including plain :func:`hpctrain.checkpoint.load_checkpoint`
into the dense model, and ``hpctrain ckpt export``).

Saving (collective over ``grid.comm``): every rank describes the region of each global
tensor it holds; the ranks holding the same region (the stage's replicas, and for
unsplit tensors its tensor ranks too) share the writing of it by rows; checksums of the
pieces are combined into each dataset's CRC-32; every rank writes its pieces collectively
into one temp file through MPI-IO; the file is re-read and verified, then renamed.

Loading (collective): rank 0 reads the header, every rank checks the tensors it needs
against the file's names and shapes (the same error on every rank if they do not fit),
the checksums are verified, then every rank reads its own regions.
"""
import json
import math
import os
import secrets

import numpy as np

from ..coordination import all_or_none, on_root
from ..errors import CheckpointError
from ..checkpoint import format as fmt
from ..checkpoint import reader, snapshot, writer
from .tensor import shard_dims


# ---------------------------------------------------------------- what this rank holds

class Held:
    """One local tensor and where it sits in the global one: ``region`` is a
    ``(start, stop)`` per dimension of ``shape`` (the global shape)."""

    def __init__(self, path, tensor, shape, region, dtype):
        self.path, self.tensor, self.shape, self.region, self.dtype = path, tensor, tuple(shape), tuple(region), dtype

    def describe(self):
        """Picklable description without data."""
        return (self.path, self.shape, self.dtype, self.region)


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


def held_tensors(module, optimizer):
    """``[Held]`` for this rank's model tensors and optimizer state, under global names."""
    shards = shard_dims(module)
    params = dict(module.named_parameters())
    out = []
    for name, t in module.state_dict().items():
        shape, region = _placement(tuple(t.shape), shards.get(name))
        out.append(Held(f"{fmt.MODEL}/{fmt.param_key(name)}", t, shape, region, snapshot._dtype_name(t)))
    if optimizer is not None:
        names = snapshot.optimizer_param_names(module, optimizer)
        state = optimizer.state_dict()["state"]
        for index in sorted(state):
            pname = names[index]
            for key in sorted(state[index]):
                value = state[index][key]
                if not hasattr(value, "detach"):
                    continue
                # State shaped like a split parameter (momentum, Adam moments) is split like it;
                # anything else (Adam's step counter) is the same on every tensor rank.
                same = tuple(value.shape) == tuple(params[pname].shape)
                shape, region = _placement(tuple(value.shape), shards.get(pname) if same else None)
                out.append(Held(f"{fmt.OPT_STATE}/{fmt.param_key(pname)}/{key}", value, shape, region,
                                snapshot._dtype_name(value)))
    return out


# ---------------------------------------------------------------- who writes what (pure)

def plan_writes(described):
    """``described``: per rank, a list of ``(path, shape, dtype, region)``.

    Returns ``(order, datasets, plan)``: dataset paths in first-seen order; ``{path: (shape,
    dtype)}``; ``{path: [(rank, subregion)]}``, where the ranks holding one region share its
    rows. Raises CheckpointError if the ranks disagree on a tensor or leave part of it uncovered.
    """
    order, datasets, holders = [], {}, {}
    problems = []
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
        raise fmt.everywhere(CheckpointError(
            "the ranks do not hold a consistent split model:\n  " + "\n  ".join(problems[:20]),
            hint="every rank must build the same model with the same layout before saving"))
    return order, datasets, plan


def runs(shape, subregion, itemsize):
    """Byte ``(offset, nbytes)`` of the contiguous runs a sub-region covers in the C-order
    global array, in the order its own C-order elements come (pure)."""
    if not shape:
        return [(0, itemsize)]
    last = max((d for d, (a, b) in enumerate(subregion) if (a, b) != (0, shape[d])), default=0)
    inner = math.prod(shape[last + 1:])
    a, b = subregion[last]
    run = (b - a) * inner * itemsize
    outer = [range(lo, hi) for lo, hi in subregion[:last]]
    if not outer:
        return [(a * inner * itemsize, run)]
    idx = np.stack(np.meshgrid(*outer, indexing="ij"), axis=-1).reshape(-1, last)
    start = np.concatenate([idx, np.full((len(idx), 1), a)], axis=1)
    flat = np.ravel_multi_index(tuple(start.T), shape[:last + 1]) * inner * itemsize
    return [(int(o), run) for o in flat]


def _local_slices(held, subregion):
    """Slices of the local tensor for a sub-region (which differs from its region in dim 0 only)."""
    if not held.shape:
        return ()
    a0 = held.region[0][0]
    return (slice(subregion[0][0] - a0, subregion[0][1] - a0),)


def _global_slices(region):
    return tuple(slice(a, b) for a, b in region)


# ---------------------------------------------------------------- saving

class _Planned:
    """What ``writer.create_layout`` needs of a dataset, without its data."""

    def __init__(self, path, shape, dtype_name):
        self.path = path
        # A zero-stride array: the shape and storage dtype, and no memory.
        self.array = np.broadcast_to(np.zeros((), dtype=fmt.storage_dtype(dtype_name)), shape)
        self.attrs = {fmt.DTYPE_ATTR: dtype_name}


class _Layout:
    def __init__(self, entries, root_attrs, group_attrs):
        self.entries, self.root_attrs, self.group_attrs = entries, root_attrs, group_attrs


def _optimizer_groups(module, optimizer):
    """This stage's param groups with parameter names, and non-tensor state per parameter."""
    if optimizer is None:
        return None
    names = snapshot.optimizer_param_names(module, optimizer)
    sd = optimizer.state_dict()
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[names[i] for i in g["params"]])
              for g in sd["param_groups"]]
    values = {names[i]: {k: v for k, v in s.items() if not hasattr(v, "detach")} for i, s in sd["state"].items()}
    return {"class": type(optimizer).__name__, "groups": json.loads(fmt.to_json(groups)),
            "values": json.loads(fmt.to_json(values))}


def _group_attrs(grid, optimizers, progress, rng):
    """Group attributes, identical on every rank (built from allgathered data)."""
    from ..state import Progress

    firsts = [r for r in range(grid.comm.Get_size())
              if r < grid.layout.stages * grid.layout.tensor and r % grid.layout.tensor == 0]
    merged, cls, values = [], "", {}
    for r in firsts:  # replica 0, tensor rank 0 of each stage, in stage order
        opt = optimizers[r]
        if opt is None:
            continue
        cls = opt["class"]
        if merged and len(opt["groups"]) != len(merged):
            raise fmt.everywhere(CheckpointError(
                f"the stages' optimizers have different numbers of parameter groups "
                f"({len(merged)} and {len(opt['groups'])})", hint="give every stage's optimizer the same groups"))
        for g, group in enumerate(opt["groups"]):
            if g == len(merged):
                merged.append(dict(group, params=[]))
            merged[g]["params"] += group["params"]
        values.update(opt["values"])
    groups = {fmt.OPTIMIZER: {"param_groups": fmt.to_json(merged), "class": cls}, fmt.OPT_STATE: {}}
    for pname, vals in values.items():
        groups[f"{fmt.OPT_STATE}/{fmt.param_key(pname)}"] = {"values": fmt.to_json(vals)}
    p = progress if progress is not None else Progress()
    groups[fmt.TRAINER] = {
        "step": int(p.step), "epoch": int(p.epoch), "samples_in_epoch": int(p.samples_in_epoch),
        "seed": int(p.seed), "extra": fmt.to_json(p.extra), "best_metric": fmt.to_json(p.best_metric),
    }
    groups[fmt.RNG] = {"numpy_meta": fmt.to_json(rng["numpy_meta"]), "python": fmt.to_json(rng["python"])}
    return groups


def layout_attr(grid, pipeline_bounds=None):
    layout = grid.layout
    info = {"stages": layout.stages, "replicas": layout.replicas, "tensor": layout.tensor}
    if pipeline_bounds is not None:
        info["bounds"] = [list(b) for b in pipeline_bounds]
    return fmt.to_json(info)


def save_parallel_checkpoint(path, module, optimizer, grid, progress=None, run_config=None, metrics=None,
                             reason="manual", verify=True):
    """Collective over ``grid.comm``: write this stage's ``module`` and ``optimizer`` (every
    rank its part) into the checkpoint file ``path``: temp file, verified, renamed.

    >>> save_parallel_checkpoint("run/ckpt-00000100.h5", pipe.module, opt, grid, progress)  # doctest: +SKIP
    """
    from ..checkpoint.manager import durable_rename

    comm = grid.comm
    rank = comm.Get_rank()
    if not writer.h5py_parallel():
        raise fmt.everywhere(CheckpointError(
            "checkpoints of split models are written collectively, but h5py was built without MPI support",
            hint="build h5py against parallel HDF5 (`make setup`)"))
    path = os.path.abspath(os.fspath(path))
    step = 0 if progress is None else progress.step

    def prepare():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        meta = snapshot.root_metadata(comm.Get_size(), run_config, metrics, reason, step, "mpio", comm.Get_size())
        meta["parallel_layout"] = layout_attr(grid)
        return {"tmp": fmt.temp_name(path, f"{os.getpid()}-{secrets.token_hex(3)}"), "meta": meta,
                "rng": snapshot.rng_states()}

    info = on_root(prepare, comm)
    held = held_tensors(module, optimizer)
    if rank == 0:  # rank 0's generators, as the ordinary checkpoint stores them
        rng = info["rng"]
        import torch

        for key, dtype in (("torch", "uint8"), ("numpy_keys", "uint32")):
            t = torch.from_numpy(np.ascontiguousarray(rng[key]))
            held.append(Held(f"{fmt.RNG}/{key}", t, t.shape, tuple((0, n) for n in t.shape), dtype))
    everyone = comm.allgather(([h.describe() for h in held], _optimizer_groups(module, optimizer)))
    order, datasets, plan = all_or_none(lambda: plan_writes([d for d, _ in everyone]), comm)
    groups = all_or_none(lambda: _group_attrs(grid, [o for _, o in everyone], progress, info["rng"]), comm)
    model_first = [p for p in order if p.startswith(fmt.MODEL + "/")] + \
                  [p for p in order if p.startswith(fmt.OPT_STATE + "/")] + \
                  [p for p in order if p.startswith(fmt.RNG + "/")]

    # This rank's pieces and their checksums.
    mine = {h.path: h for h in held}
    pieces, sums = {}, []
    for i, p in enumerate(model_first):
        for r, sub in plan[p]:
            if r != rank:
                continue
            h = mine[p]
            array, _ = snapshot.tensor_to_array(h.tensor, copy=False)
            # (0-d arrays stay arrays: indexing one with () would give a numpy scalar)
            part = np.require(array[_local_slices(h, sub)] if h.shape else array, requirements="C")
            pieces[p] = (sub, part)
            flat = part.reshape(-1).view(np.uint8)
            pos = 0
            for offset, nbytes in runs(datasets[p][0], sub, part.dtype.itemsize):
                sums.append((i, offset, nbytes, fmt.crc32_bytes(flat[pos:pos + nbytes])))
                pos += nbytes
    checksums = writer.combine_checksums(comm.allgather(sums), len(model_first))
    entries = [_Planned(p, datasets[p][0], datasets[p][1]) for p in model_first]
    tmp = info["tmp"]
    try:
        _write(tmp, _Layout(entries, info["meta"], groups), checksums, pieces, comm)
        if verify:
            reader.verify_written(tmp, dict(zip(model_first, checksums)), comm, True)
    except BaseException:
        if rank == 0:
            try:
                os.remove(tmp)
            except OSError:
                pass
        raise

    def commit():
        durable_rename(tmp, path)
        return path

    return on_root(commit, comm)


def _write(tmp, layout, checksums, pieces, comm):
    import h5py

    errors, f = [], None
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, libver=writer.LIBVER)
    except Exception as exc:
        errors.append(f"creating the file: {type(exc).__name__}: {exc}")
    writer.agree(errors, comm, tmp, "creating")
    try:
        dsets = writer.create_layout(f, layout, checksums)
        for entry, dset in zip(layout.entries, dsets):
            try:
                with dset.collective:
                    if entry.path in pieces:
                        sub, part = pieces[entry.path]
                        if part.ndim == 0:
                            dset[()] = part
                        else:
                            dset[_global_slices(sub)] = part
                    else:
                        writer.write_empty(dset)
            except Exception as exc:
                errors.append(f"writing /{entry.path}: {type(exc).__name__}: {exc}")
        if not comm.allreduce(len(errors)):
            f.flush()
    finally:
        if f is not None:
            f.close()
    writer.agree(errors, comm, tmp, "writing")


# ---------------------------------------------------------------- loading

def _wanted_state(module, header):
    """``[(Held, pname, key)]`` for the optimizer state of this rank's parameters in the file,
    placed like each parameter when shaped like it (a fresh optimizer has no state to ask)."""
    shards = shard_dims(module)
    out = []
    for pname, param in module.named_parameters():
        gshape, region = _placement(tuple(param.shape), shards.get(pname))
        prefix = f"{fmt.OPT_STATE}/{fmt.param_key(pname)}/"
        for p, (shape, _, attrs) in sorted(header.datasets.items()):
            if p.startswith(prefix) and "/" not in p[len(prefix):]:
                if tuple(shape) == gshape:
                    h = Held(p, param, gshape, region, attrs[fmt.DTYPE_ATTR])
                else:
                    h = Held(p, None, tuple(shape), tuple((0, n) for n in shape), attrs[fmt.DTYPE_ATTR])
                out.append((h, pname, p[len(prefix):]))
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


def load_parallel_checkpoint(path, module, optimizer, grid, progress=None, restore_rng=True):
    """Collective over ``grid.comm``: load checkpoint ``path`` (written in any layout, or by
    the ordinary data-parallel trainer) into this stage's ``module`` and ``optimizer``.
    Raises the same :class:`CheckpointError` on every rank, before anything changes, when
    the file does not fit. Returns the file's header.

    >>> load_parallel_checkpoint("run/ckpt-00000100.h5", pipe.module, opt, grid, progress)  # doctest: +SKIP
    """
    import h5py

    comm = grid.comm
    path = os.path.abspath(os.fspath(path))
    header = on_root(lambda: reader.read_header(path), comm)
    model = held_tensors(module, None)
    saved_layout = header.root_attrs.get("parallel_layout",
                                         f"data parallel over {header.root_attrs.get('nranks')} ranks")
    all_or_none(lambda: _check_against(header, model, saved_layout, path), comm)
    # Every model tensor of the file must land somewhere in this layout.
    names = set().union(*comm.allgather({h.path for h in model}))
    extra = sorted(p for p in header.datasets if p.startswith(fmt.MODEL + "/") and p not in names)
    if extra:
        raise fmt.everywhere(CheckpointError(
            f"{path} holds tensors that no stage of this model has: " + ", ".join("/" + p for p in extra[:10]),
            hint="build the same model as the run that saved it (the layout may differ)"))
    wanted = _wanted_state(module, header) if optimizer is not None else []
    reader.verify_written(path, {p: int(a[2][fmt.CRC_ATTR]) for p, a in header.datasets.items()}, comm, True)

    arrays, errors, f = {}, [], None
    try:
        f = h5py.File(path, "r", driver="mpio", comm=comm)
        for h in model + [w[0] for w in wanted]:
            arrays[h.path] = f[h.path][_global_slices(h.region)] if h.shape else f[h.path][()]
        if restore_rng and comm.Get_rank() == 0 and f"{fmt.RNG}/torch" in header.datasets:
            for key in ("torch", "numpy_keys"):
                arrays[f"{fmt.RNG}/{key}"] = f[f"{fmt.RNG}/{key}"][()]
    except Exception as exc:
        errors.append(f"reading: {type(exc).__name__}: {exc}")
    finally:
        if f is not None:
            f.close()
    writer.agree(errors, comm, path, "reading")
    all_or_none(lambda: _apply(header, arrays, module, optimizer, wanted, progress, path), comm)
    if f"{fmt.RNG}/torch" in arrays:
        rng = header.group_attrs.get(fmt.RNG, {})
        snapshot.set_rng_states({"torch": arrays[f"{fmt.RNG}/torch"], "numpy_keys": arrays[f"{fmt.RNG}/numpy_keys"],
                                 "numpy_meta": json.loads(rng["numpy_meta"]), "python": json.loads(rng["python"])})
    return header


def _apply(header, arrays, module, optimizer, wanted, progress, path):
    def tensor(p, like):
        t = snapshot.array_to_tensor(arrays[p], header.datasets[p][2][fmt.DTYPE_ATTR])
        return t if like is None else t.to(dtype=like.dtype, device=like.device)

    sd = {name: tensor(f"{fmt.MODEL}/{fmt.param_key(name)}", t) for name, t in module.state_dict().items()}
    if optimizer is not None:
        names = snapshot.optimizer_param_names(module, optimizer)
        saved = json.loads(header.group_attrs[fmt.OPTIMIZER]["param_groups"])
        current = optimizer.state_dict()["param_groups"]
        if len(saved) != len(current):
            raise CheckpointError(f"{path}: this optimizer has {len(current)} parameter group(s), the file "
                                  f"{len(saved)}", hint="build the optimizer with the same parameter groups")
        groups = []
        for g_saved, g_now in zip(saved, current):
            # The file's hyperparameters (learning rate as scheduled, betas...), this stage's parameters.
            g = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                 for k, v in g_saved.items() if k != "params"}
            g["params"] = list(g_now["params"])
            groups.append(g)
        index = {n: i for i, n in enumerate(names)}
        state = {}
        for pname, i in index.items():
            gpath = f"{fmt.OPT_STATE}/{fmt.param_key(pname)}"
            if gpath in header.group_attrs:
                state[i] = dict(json.loads(header.group_attrs[gpath].get("values", "{}")))
        for h, pname, key in wanted:
            if pname in index:
                state.setdefault(index[pname], {})[key] = tensor(h.path, h.tensor)
    module.load_state_dict(sd, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    if progress is not None:
        t = header.group_attrs[fmt.TRAINER]
        progress.step, progress.epoch = int(t["step"]), int(t["epoch"])
        progress.samples_in_epoch, progress.seed = int(t["samples_in_epoch"]), int(t["seed"])
        progress.best_metric = json.loads(t["best_metric"])
        progress.extra = json.loads(t["extra"])


# ---------------------------------------------------------------- the whole model in one place

def gather_state(module, optimizer, grid, root=0):
    """Collective: on ``root``, the full model's ``{name: tensor}`` and optimizer state
    ``{name: {key: tensor}}`` assembled from every stage and tensor rank (replica 0's);
    ``None`` elsewhere. Pickles through MPI: for small models, tests and exports."""
    import torch

    held = held_tensors(module, optimizer) if grid.replica == 0 else []
    parts = grid.comm.gather([(h.path, h.shape, h.region, h.tensor.detach().cpu().clone()) for h in held], root=root)
    if grid.comm.Get_rank() != root:
        return None
    full = {}
    for rank_parts in parts:
        for p, shape, region, t in rank_parts:
            if p not in full:
                full[p] = torch.empty(shape, dtype=t.dtype)
            full[p][_global_slices(region)] = t
    model = {fmt.param_name(p.split("/", 1)[1]): t for p, t in full.items() if p.startswith(fmt.MODEL + "/")}
    opt = {}
    for p, t in full.items():
        if p.startswith(fmt.OPT_STATE + "/"):
            gkey, key = p[len(fmt.OPT_STATE) + 1:].rsplit("/", 1)
            opt.setdefault(fmt.param_name(gkey), {})[key] = t
    return {"model": model, "optimizer": opt}
