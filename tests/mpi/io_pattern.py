"""One collective save of a state with large tensors (split among the ranks) and small ones, and what it did:
where each rank's part of each dataset starts in the file (the layout read back), how many of hpctrain's own
collective calls the save made and how many bytes rank 0 received in them. Rank 0 prints one JSON line
``IO_PATTERN {...}``; run under strace, the writes themselves are in the trace.

    mpirun -n 4 python tests/mpi/io_pattern.py OUT_DIR ALIGNMENT [HINT=VALUE ...] [--direct]   # direct_io
        [--then-default OUT_DIR2]   # then a save with the default settings: IO_PATTERN_DEFAULT {...}
    mpirun -n 4 python tests/mpi/io_pattern.py --load FILE     # read it back: LOADED OK on every rank

``--then-default`` gives a second save's report from the same launch (a launch of 16 ranks costs half a
minute here); under strace its writes are in the trace too, in files under OUT_DIR2, which the test tells
apart by their path.
"""
import json
import os
import pickle
import sys

import h5py
import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hpctrain.checkpoint import CheckpointManager  # noqa: E402
from hpctrain.checkpoint.content import format as fmt  # noqa: E402
from hpctrain.config import CheckpointConfig  # noqa: E402
from hpctrain.runtime.coordination import abort_on_exception  # noqa: E402
from hpctrain.runtime.world import init_world  # noqa: E402
from hpctrain.state import Progress, TrainState  # noqa: E402

COLLECTIVES = ("allgather", "gather", "bcast", "allreduce", "reduce", "scatter", "alltoall", "Barrier",
               "Allreduce", "Allgather", "Allgatherv", "Bcast", "Gather", "Gatherv", "Reduce")


class Counted(MPI.Intracomm):
    """The same communicator (a real one: h5py opens the file over it), with hpctrain's collective calls
    counted, and the bytes that arrive at this rank in the object collectives."""

    calls = 0
    received = 0


def _counted(name):
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        Counted.calls += 1
        out = method(self, *args, **kwargs)
        if name.islower() and out is not None:
            Counted.received += len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        return out

    return call


for _name in COLLECTIVES:
    setattr(Counted, _name, _counted(_name))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1500, 1024)  # 5.9 MiB: split among the ranks
        self.proj = nn.Linear(1024, 768)  # 3 MiB
        self.head = nn.Linear(768, 10)  # small: one rank writes it whole
        self.norm = nn.LayerNorm(768)


def make_state(seed):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # optimizer state exists, as after a step
        p.grad = torch.ones_like(p)
    opt.step()
    return TrainState(model, opt, Progress(seed=0))


def load(path):
    """Read ``path`` into a state made with other numbers; it must then hold the file's."""
    world = init_world()
    state = make_state(seed=1)
    mgr = CheckpointManager(os.path.dirname(path), world, CheckpointConfig(resume=path))
    assert mgr.resume(state)
    with h5py.File(path, "r") as f:
        for name, tensor in state.model.state_dict().items():
            assert (tensor.numpy() == f["model"][name][()]).all(), name
        assert (state.optimizer.state[state.model.embed.weight]["exp_avg_sq"].numpy()
                == f["optimizer/state/embed.weight/exp_avg_sq"][()]).all()
    print(f"RANK {world.rank} LOADED OK", flush=True)


def main(out, alignment, hints, direct, then_default=None):
    world = init_world(comm=Counted(MPI.COMM_WORLD.Dup()))
    save_and_report(world, out, alignment, hints, direct, "IO_PATTERN")
    if then_default:
        save_and_report(world, then_default, 0, {}, False, "IO_PATTERN_DEFAULT")


def save_and_report(world, out, alignment, hints, direct, tag):
    state = make_state(seed=0)
    cfg = CheckpointConfig(on_epoch_end=False, alignment=alignment, io_hints=hints, direct_io=direct)
    mgr = CheckpointManager(out, world, cfg)
    Counted.calls = Counted.received = 0
    state.progress.step = 1
    path = mgr.save(state)
    calls = world.comm.gather((Counted.calls, Counted.received), root=0)
    if world.rank == 0:
        io = mgr.io
        datasets = {}
        with h5py.File(path, "r") as f:
            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    datasets[name] = {"offset": obj.id.get_offset(), "nbytes": obj.nbytes, "shape": obj.shape,
                                      "itemsize": obj.dtype.itemsize}
            f.visititems(visit)
        # The plan's order (the order the datasets were created in, the order of their offsets), not the names'.
        datasets = dict(sorted(datasets.items(), key=lambda item: item[1]["offset"] or 0))
        pieces = fmt.plan_pieces([(tuple(d["shape"]), d["itemsize"]) for d in datasets.values()], world.size,
                                 alignment=io.alignment)
        for d, p in zip(datasets.values(), pieces):
            row = fmt.row_bytes(d["shape"], d["itemsize"])
            d["starts"] = [d["offset"] + start * row for _, start, _ in p]
            d["ranks"] = [r for r, _, _ in p]
        print(f"{tag} " + json.dumps({
            "ranks": world.size, "alignment": io.alignment, "hints": io.hints, "file": path,
            "file_bytes": os.path.getsize(path), "data_bytes": sum(d["nbytes"] for d in datasets.values()),
            "datasets": datasets, "calls": [c for c, _ in calls], "received": [r for _, r in calls],
            "describe": io.describe()}), flush=True)
    mgr.close()


if __name__ == "__main__":
    with abort_on_exception(MPI.COMM_WORLD):
        if sys.argv[1] == "--load":
            load(sys.argv[2])
        else:
            args = sys.argv[3:]
            then = args[args.index("--then-default") + 1] if "--then-default" in args else None
            if then:
                del args[args.index("--then-default"):args.index("--then-default") + 2]
            main(sys.argv[1], int(sys.argv[2]), dict(a.split("=", 1) for a in args if a != "--direct"),
                 "--direct" in args, then)
