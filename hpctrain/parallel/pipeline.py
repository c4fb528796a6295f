"""Pipeline parallelism: a sequence of layers split into stages on consecutive ranks of ``grid.pp_comm``;
each batch is cut into micro-batches whose activations flow forward and whose gradients flow back
point-to-point (:class:`StageLink`), in one of two schedules:

* ``gpipe``: every stage runs all forward passes, then all backward passes. Simple; each stage keeps the
  activations of every micro-batch until the end.
* ``1f1b``: after ``stages - stage - 1`` warm-up forwards, each stage alternates one forward and one
  backward; stage ``s`` holds at most ``stages - s`` micro-batches' activations.

Both give one process's whole-batch gradients (up to summation order) when the loss is a mean over samples::

    pipe = Pipeline(model_layers, grid, loss_fn=nn.MSELoss(), micro_batches=4, schedule="1f1b")
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)   # this stage's parameters only
    loss = pipe.train_step(x, y)      # x read on the first stage, y on the last; None elsewhere is fine
    opt.step(); opt.zero_grad()
"""
import itertools
import time
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from ..config.schema import BALANCES, SCHEDULES
from ..config.validation import check_choice
from ..errors import ConfigError
from ..models.stack import LayerStack

# Header of every activation/gradient message: dtype code, ndim, up to MAX_DIMS sizes.
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.uint8, torch.bool]


# ---------------------------------------------------------------- splitting (pure)

def partition(weights, parts):
    """Split ``weights`` into ``parts`` consecutive, non-empty groups minimising the largest
    group's sum. Returns ``[(start, stop)]``. Deterministic: the same on every rank."""
    n = len(weights)
    if parts > n:
        raise ConfigError(f"cannot split {n} layer(s) into {parts} pipeline stages: a stage needs at least one layer",
                          hint=f"use at most {n} stages (parallel.stages), or give the model more layers")
    prefix = list(itertools.accumulate(map(float, weights), initial=0.0))
    # best[k][i]: (largest stage, sum of squares) when the first i layers form k stages; the
    # sum of squares only breaks ties, towards evenly filled stages.
    best = [[(float("inf"), float("inf"))] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                w = prefix[i] - prefix[j]
                cost = (max(best[k - 1][j][0], w), best[k - 1][j][1] + w * w)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def bounds_from_counts(counts, n):
    """``[(start, stop)]`` from a list of layers per stage (``balance=[3, 2]``)."""
    if sum(counts) != n or any(c < 1 for c in counts):
        raise ConfigError(f"pipeline balance {list(counts)} does not give every stage at least one of the "
                          f"model's {n} layers (it sums to {sum(counts)})",
                          hint=f"give {len(counts)} positive counts that sum to {n}, or balance='params'")
    return [(stop - c, stop) for c, stop in zip(counts, itertools.accumulate(counts))]


def schedule_ops(kind, stage, stages, micro_batches):
    """The order in which ``stage`` runs forward (``"F"``) and backward (``"B"``) passes of
    its micro-batches: ``[("F", 0), ("F", 1), ("B", 0), ...]`` (pure)."""
    check_choice("parallel.schedule", kind, SCHEDULES)
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if kind == "1f1b":
        warm = min(stages - stage - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(m - warm, m)]


def layer_list(model):
    """``[(name, layer)]`` of an ``nn.Sequential`` (its own names) or a list (``"0"``, ``"1"``...)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple)):
        return [(str(i), layer) for i, layer in enumerate(model)]
    raise ConfigError(f"a pipeline needs an nn.Sequential or a list of layers, got {type(model).__name__}",
                      hint="write the model as nn.Sequential(layer, layer, ...)")


def measure_times(layers, sample, repeats=3):
    """Forward + backward seconds of each layer on ``sample`` (best of ``repeats``). ``layers`` may be a
    generator (:meth:`LayerStack.layers`): each layer is timed, then dropped, so only one is alive at once."""
    times, x = [], sample
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            x_in = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(x_in)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        for p in layer.parameters():  # the timing passes must not leave gradients behind
            p.grad = None
        x = y.detach()
    return times


def stage_bounds(named, stack, stages, micro_batches, schedule, balance, sample):
    """``[(start, stop)]`` of every stage's layers, or None when ``balance = "time"`` (measured
    later); the same checks, and the same ConfigError, on every rank."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"parallel.micro_batches is {micro_batches!r}; expected an integer >= 1")
    schedule_ops(schedule, 0, stages, 1)
    if len(named) < stages:
        raise ConfigError(
            f"cannot split a model of {len(named)} layer(s) into {stages} pipeline stages: "
            f"every stage needs at least one layer",
            hint=f"use at most {len(named)} stages (parallel.stages), or split the model into more layers")
    if isinstance(balance, (list, tuple)):
        if len(balance) != stages:
            raise ConfigError(f"pipeline balance {list(balance)} names {len(balance)} stages, the layout has "
                              f"{stages}", hint="give one layer count per stage")
        return bounds_from_counts(balance, len(named))
    check_choice("parallel.balance", balance, BALANCES, "balance='params', 'time' or a list of layer counts")
    if balance == "params":
        counts = (stack.parameter_counts() if stack is not None
                  else [sum(p.numel() for p in layer.parameters()) for _, layer in named])
        return partition(counts, stages)
    if sample is None:
        raise ConfigError("balance='time' needs a sample micro-batch to time the layers on",
                          hint="pass sample=<a micro-batch of inputs>, or use balance='params'")
    return None


# ---------------------------------------------------------------- point-to-point

class StageLink:
    """Activations and gradients between the stages of one pipeline (``comm``: ``grid.pp_comm``), by mpi4py
    ``Isend``/``Recv`` of contiguous host buffers (no CUDA-aware MPI is assumed), each after a small header
    (dtype code, ndim, sizes). Sends are non-blocking until :meth:`wait_sends`."""

    def __init__(self, comm):
        self.comm, self._pending = comm, []

    def send(self, tensor, dest, tag):
        from mpi4py import MPI

        t = tensor.detach()
        if t.dim() > MAX_DIMS:
            raise ConfigError(f"a pipeline activation has {t.dim()} dimensions; at most {MAX_DIMS} can be sent")
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = t.shape
        host = t.to("cpu", copy=True).contiguous()
        raw = host.reshape(-1).view(torch.uint8).numpy()
        self._pending.append((self.comm.Isend(header, dest=dest, tag=tag), header, host))
        self._pending.append((self.comm.Isend([raw, MPI.BYTE], dest=dest, tag=tag), raw, host))

    def recv(self, source, tag, device):
        from mpi4py import MPI

        header = np.empty(HEADER_LEN, dtype=np.int64)
        self.comm.Recv(header, source=source, tag=tag)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        host = torch.empty(tuple(int(d) for d in header[2:2 + ndim]), dtype=dtype)
        self.comm.Recv([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], source=source, tag=tag)
        return host.to(device)

    def wait_sends(self):
        from mpi4py import MPI

        if self._pending:
            MPI.Request.Waitall([req for req, _, _ in self._pending])
        self._pending = []


# ---------------------------------------------------------------- the pipeline

class Pipeline:
    """This rank's stage of a pipeline over ``grid.pp_comm``. ``model``: ``nn.Sequential`` or list of layers,
    the same on every rank (build it with one seed everywhere; only this stage's layers are kept), or a
    :class:`~hpctrain.models.stack.LayerStack`, of which every rank builds only its stage's layers.
    ``loss_fn(output, target)`` runs on the last stage and should average over samples. ``balance``:
    ``"params"`` (parameter count), ``"time"`` (measured on ``sample``, a micro-batch of inputs) or a list of
    layers per stage. With ``grid.layout.tensor > 1`` the stage's MLP and attention blocks are split over
    ``grid.tp_comm`` (:func:`~.tensor.tensor_parallelize`). ``module`` is this stage's ``nn.Sequential``; its
    parameter names are the full model's."""

    def __init__(self, model, grid, loss_fn=None, micro_batches=1, schedule="1f1b", balance="params", sample=None):
        from ..runtime.coordination import all_or_none

        self.grid, self.link, self.stages, self.stage = grid, StageLink(grid.pp_comm), grid.layout.stages, grid.stage
        self.loss_fn, self.micro_batches, self.schedule = loss_fn, micro_batches, schedule
        stack = model if isinstance(model, LayerStack) else None
        named = [(name, None) for name in stack.names] if stack is not None else layer_list(model)
        self.bounds = all_or_none(
            lambda: stage_bounds(named, stack, self.stages, micro_batches, schedule, balance, sample), grid.comm)
        if self.bounds is None:
            layers = stack.layers() if stack is not None else [layer for _, layer in named]
            self.bounds = self._balance_by_time(layers, sample)
        start, stop = self.bounds[self.stage]

        def build():
            stage = stack.sequential(start, stop) if stack is not None else nn.Sequential(OrderedDict(named[start:stop]))
            if grid.layout.tensor > 1:
                from .tensor import tensor_parallelize

                stage = tensor_parallelize(stage, grid.tp_comm)
            return stage

        # A layer that cannot be split over the tensor ranks lives on one stage: all ranks hear of it.
        self.module = all_or_none(build, grid.comm)

    def _balance_by_time(self, layers, sample):
        from ..runtime.coordination import on_root

        everyone = self.grid.comm.gather(measure_times(layers, sample), root=0)
        # Rank 0 decides from the mean of all ranks' timings, so every rank gets one answer.
        return on_root(lambda: partition(list(np.mean(everyone, axis=0)), self.stages), self.grid.comm)

    def _device(self):
        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    def _chunks(self, tensor, what):
        if tensor is None:
            raise ConfigError(f"stage {self.stage} needs the {what} of the batch, got None")
        chunks = torch.tensor_split(tensor, self.micro_batches, dim=0)
        if any(len(c) == 0 for c in chunks):
            raise ConfigError(f"a batch of {len(tensor)} samples cannot be cut into {self.micro_batches} micro-batches",
                              hint="use a batch size of at least parallel.micro_batches")
        return chunks

    def train_step(self, inputs=None, targets=None):
        """Forward and backward passes of one batch; gradients accumulate in ``module``'s
        parameters (as ``loss.backward()`` would). Returns the batch's mean loss on every
        stage. ``inputs`` is used on the first stage, ``targets`` on the last."""
        first, last = self.grid.is_first_stage, self.grid.is_last_stage
        if last and self.loss_fn is None:
            raise ConfigError("the last pipeline stage needs a loss_fn")
        xs = self._chunks(inputs, "inputs") if first else None
        ys = self._chunks(targets, "targets") if last else None
        total = len(targets) if last else 0
        stash, loss_sum = {}, 0.0
        prev, nxt, device = self.stage - 1, self.stage + 1, self._device()
        try:
            for op, m in schedule_ops(self.schedule, self.stage, self.stages, self.micro_batches):
                fwd_tag, bwd_tag = 2 * m, 2 * m + 1
                if op == "F":
                    x = xs[m] if first else self.link.recv(prev, fwd_tag, device).requires_grad_()
                    out = self.module(x)
                    if last:
                        # Weighted by micro-batch size: the sum is the whole batch's mean loss.
                        out = self.loss_fn(out, ys[m]) * (len(ys[m]) / total)
                        loss_sum += float(out.detach())
                    else:
                        self.link.send(out, nxt, fwd_tag)
                    stash[m] = (x, out)
                else:
                    x, out = stash.pop(m)
                    if last:
                        out.backward()
                    else:
                        grad = self.link.recv(nxt, bwd_tag, device)
                        if out.requires_grad:
                            torch.autograd.backward(out, grad)
                    if not first:
                        self.link.send(x.grad if x.grad is not None else torch.zeros_like(x), prev, bwd_tag)
        finally:
            self.link.wait_sends()
        return self.grid.pp_comm.bcast(loss_sum, root=self.stages - 1)

    @torch.no_grad()
    def forward(self, inputs=None):
        """Evaluation forward pass in micro-batches: the model's output on the last stage, None elsewhere."""
        first, last = self.grid.is_first_stage, self.grid.is_last_stage
        xs = self._chunks(inputs, "inputs") if first else None
        outs, device = [], self._device()
        try:
            for m in range(self.micro_batches):
                x = xs[m] if first else self.link.recv(self.stage - 1, 2 * m, device)
                out = self.module(x)
                if last:
                    outs.append(out)
                else:
                    self.link.send(out, self.stage + 1, 2 * m)
        finally:
            self.link.wait_sends()
        return torch.cat(outs) if last else None

    def describe(self):
        start, stop = self.bounds[self.stage]
        return (f"stage {self.stage} of {self.stages}: layers {start}..{stop - 1} "
                f"({sum(p.numel() for p in self.module.parameters())} parameters here), schedule "
                f"{self.schedule}, {self.micro_batches} micro-batches")
