"""The model, data and single-process reference the parallel MPI scripts share."""
import zlib

import numpy as np
import torch
from torch import nn

from hpctrain.parallel.tensor import MLPBlock, SelfAttention

WIDTH, HEADS, HIDDEN, SEQ, IN, OUT = 16, 4, 32, 5, 8, 3


def build_model(seed=0, width=WIDTH):
    """Six layers: enough for 4 stages; attention and MLP blocks split over tensor ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, width), nn.Tanh(), SelfAttention(width, HEADS),
        MLPBlock(width, HIDDEN), nn.Tanh(), nn.Linear(width, OUT))


def batch(step, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, SEQ, IN, generator=g)
    y = torch.randn(n, SEQ, OUT, generator=g)
    return x, y


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(steps, seed=0):
    """Full-batch training of the dense model in this process: per step, the gradients
    (before the update) and the parameters (after it), by name."""
    model = build_model(seed)
    opt = optimizer(model.parameters())
    loss_fn = nn.MSELoss()
    grads, params, losses = [], [], []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return grads, params, losses


def local_view(full, name, shards):
    """The part of a full tensor ``name`` that this tensor rank holds."""
    if name not in shards:
        return full
    dim, rank, size = shards[name]
    k = full.shape[dim] // size
    return full.narrow(dim, rank * k, k)


def crc(t):
    return zlib.crc32(np.ascontiguousarray(t.detach().numpy()).tobytes())
