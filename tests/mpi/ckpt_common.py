"""Models, states and checks shared by the checkpoint MPI scripts (tests/mpi/ckpt_*.py)."""
import dataclasses
import os
import sys

import h5py
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hpctrain.config import CheckpointConfig  # noqa: E402
from hpctrain.errors import CheckpointError  # noqa: E402
from hpctrain.state import Progress, TrainState  # noqa: E402
from hpctrain.runtime.world import init_world  # noqa: E402


class Mixed(nn.Module):
    """Parameters of several sizes and dtypes: one large enough to be split across ranks,
    a bf16 and an fp16 tensor, integer and bool buffers."""

    def __init__(self, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(320, 1024)  # 1.25 MiB: split along axis 0
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 4)
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.gain = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float16))
        self.register_buffer("counter", torch.arange(5, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, idx, x):
        h = torch.relu(self.fc1(x)) + self.embed(idx)[:, : self.fc1.out_features]
        return self.fc2(h) * self.scale.float() + self.gain.float().sum()


class Tiny(nn.Module):
    """One tensor, no bias: more ranks than tensors."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))


def flip_byte(path, dataset, where=10):
    """Invert one byte of ``dataset``'s data in the file, as a bit flip on disk would."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + where)
        byte = f.read(1)
        f.seek(offset + where)
        f.write(bytes([byte[0] ^ 0xFF]))


def make_state(seed=0, hidden=16, tiny=False, lr=0.01):
    torch.manual_seed(seed)
    model = Tiny() if tiny else Mixed(hidden)
    if tiny:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        big = [model.embed.weight]
        rest = [p for n, p in model.named_parameters() if n != "embed.weight"]
        opt = torch.optim.Adam([{"params": rest, "lr": lr}, {"params": big, "lr": lr / 10, "betas": (0.8, 0.99)}])
    return TrainState(model, opt, Progress(seed=seed))


def step_once(state, step):
    """One deterministic optimizer step (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    model = state.model
    if isinstance(model, Tiny):
        loss = (model.w * torch.randn(3, 3, generator=g)).sum()
    else:
        idx = torch.randint(0, 320, (6,), generator=g)
        x = torch.randn(6, 8, generator=g)
        loss = model(idx, x).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.progress.step = step + 1


def config(**kw):
    base = dict(keep_last=0, on_epoch_end=False, on_finish=False, consistency="check")
    base.update(kw)
    return CheckpointConfig(**base)


def world():
    return init_world(pin=False, check=False)


def reference(state):
    return {"model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "optimizer": state.optimizer.state_dict(),
            "progress": dataclasses.asdict(state.progress)}


def _same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_state(ref, state):
    _same(ref["model"], state.model.state_dict(), "model")
    _same(ref["optimizer"], state.optimizer.state_dict(), "optimizer")
    _same(ref["progress"], dataclasses.asdict(state.progress), "progress")


# ---------------------------------------------------------------- scenario scripts
# What ckpt_scenarios.py and ckpt_safety.py share: the world and options their main() sets,
# and the helpers that print each rank's lines and check the expected errors.
W = None
OPTS = {}


def say(name, text):
    print(f"RANK {W.rank} {name} {text}", flush=True)


def expect_error(name, fn, *needles):
    """Run fn (collective); it must raise CheckpointError containing every needle."""
    try:
        fn()
    except CheckpointError as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{name}: {needle!r} not in error:\n{text}"
        say(name, "ERROR: " + text.replace("\n", " | "))
        return exc
    raise AssertionError(f"{name}: no CheckpointError raised")


def root_only(fn):
    if W.rank == 0:
        fn()
    W.comm.Barrier()


def fresh_dir(name):
    path = os.path.join(OPTS["dir"], name)
    root_only(lambda: os.makedirs(path, exist_ok=True))
    return path


def read_latest(d):
    with open(os.path.join(d, "latest")) as f:
        return f.read().strip()
