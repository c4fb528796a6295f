"""Sharded optimizer state and gradients (``comm.shard``, ZeRO stages 1 and 2).

Data-parallel training keeps the whole optimizer state on every rank (AdamW: 8 bytes per parameter beside 4 of
weights and 4 of gradients). With ``comm.shard`` the parameters live in one flat fp32 buffer (the model's
tensors become views of it), cut into one contiguous slice per rank. A step:

    backward passes (gradients summed locally, as without sharding)
    reduction: each rank gets the average of (at least) its slice         (``comm.shard_reduce``)
    global gradient norm / finiteness: one small all-reduce over the slices
    a real torch optimizer (SGD, Adam, AdamW) updates the slice: its state is 1/N of the whole
        (one tensor per parameter group: the group's part of the slice, with the group's settings)
    all-gather: every rank's updated slice to every rank               (backend.allgather_flat)

The reduction is a reduce-scatter after the backward passes (``"reduce_scatter"``: each rank receives only its
slice, half the bytes of an all-reduce on a ring) or an all-reduce of flat gradient buckets, each started once
its gradients exist, so it travels while the backward pass goes on (``"allreduce"``; each rank keeps its
slice). ``"auto"``: the reduce-scatter on GPUs, the all-reduce on CPUs, where Open MPI's shared-memory
``MPI_Reduce_scatter`` measured 2-3x slower than its ``MPI_Allreduce`` of the same buffer (docs/sharding.md).

``"optimizer"`` (stage 1) keeps one flat gradient buffer that the model's gradients are views of (no
allocation per step); ``"gradients"`` (stage 2) moves each new gradient into a flat buffer freed after the
reduce-scatter, keeping only the slice's averaged gradients between steps. Elementwise optimizers update
a slice like the whole, so a sharded run equals a replicated one up to the order of floating-point sums.

Slices end on row boundaries (a row: all elements with one index along the first dimension): each rank's part
of a parameter is a block of rows, the region ``hpctrain.checkpoint.planners.sharded`` writes.

>>> bounds = shard_bounds([(4, 3), (5,)], 2)   # 12 + 5 elements, two ranks
>>> bounds
[(0, 9), (9, 17)]
"""
import functools
import itertools
import math
import weakref

from ..config.schema import SHARD_MODES, SHARD_REDUCTIONS
from ..config.validation import check_choice
from ..errors import ConfigError
from ..runtime.flat import views

BUCKET_BYTES = 25 * 2 ** 20  # an all-reduce bucket (DDP's default size): large enough to be efficient


def resolve_reduction(reduction, device):
    """``"allreduce"`` or ``"reduce_scatter"`` for ``comm.shard_reduce`` on ``device``."""
    check_choice("comm.shard_reduce", reduction, SHARD_REDUCTIONS)
    if reduction == "auto":
        return "reduce_scatter" if getattr(device, "type", str(device)) == "cuda" else "allreduce"
    return reduction


def gradient_buckets(sizes, limit_elements):
    """``[(start, stop, [indices])]``: consecutive tensors of ``sizes`` (elements, in flat
    order) grouped from the last, the order in which a backward pass makes their gradients,
    each group reaching ``limit_elements`` unless it is the first tensors' (pure).

    >>> gradient_buckets([4, 4, 4], 8)
    [(4, 12, [2, 1]), (0, 4, [0])]
    """
    offsets = list(itertools.accumulate(sizes, initial=0))
    buckets, current = [], []
    for i in reversed(range(len(sizes))):
        current.append(i)
        if sum(sizes[j] for j in current) >= limit_elements:
            buckets.append(current)
            current = []
    if current:
        buckets.append(current)
    return [(offsets[b[-1]], offsets[b[0]] + sizes[b[0]], b) for b in buckets]


def _rows(shape):
    """``(rows, elements per row)`` of a tensor of ``shape`` (a scalar is one row of one)."""
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def shard_bounds(shapes, nranks):
    """``[(start, stop)]`` per rank: contiguous element ranges covering the flat concatenation of tensors of
    ``shapes``, each boundary on the row boundary nearest to an equal share (pure; the same on every rank)."""
    *offsets, total = itertools.accumulate(map(math.prod, shapes), initial=0)
    cuts = [0]
    for r in range(1, nranks):
        target = total * r // nranks
        cut = total
        for off, shape in zip(offsets, shapes):
            n = math.prod(shape)
            if off <= target < off + n or (n and off + n == target):
                _, per_row = _rows(shape)
                cut = off + min(n, round((target - off) / per_row) * per_row)
                break
        cuts.append(max(cuts[-1], cut))
    cuts.append(total)
    return [(cuts[r], cuts[r + 1]) for r in range(nranks)]


def pieces_of(offset, shape, bounds):
    """``[(rank, first row, stop row, start in that rank's slice)]`` of the tensor of ``shape``
    at ``offset`` in the flat buffer: which rank holds which of its rows (pure)."""
    rows, per_row = _rows(shape)
    n = rows * per_row
    out = []
    for rank, (lo, hi) in enumerate(bounds):
        a, b = max(lo, offset), min(hi, offset + n)
        if b > a:
            out.append((rank, (a - offset) // per_row, (b - offset) // per_row, a - lo))
    return out


def check_supported(optimizer, model):
    """Raise :class:`ConfigError` for what sharding does not handle (the same on every rank)."""
    import torch

    supported = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    if type(optimizer) not in supported:
        raise ConfigError(f"comm.shard supports SGD, Adam and AdamW (elementwise updates), not "
                          f"{type(optimizer).__name__}", hint="use train.optimizer sgd, adam or adamw, or comm.shard=none")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.dim() == 0 for p in params):
        raise ConfigError("comm.shard does not handle 0-dimensional parameters (a slice boundary needs rows)",
                          hint="make them 1-element tensors (shape (1,)), or use comm.shard=none")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1 or next(iter(kinds))[0] != torch.float32:
        raise ConfigError(f"comm.shard needs every parameter in float32 on one device; found {sorted(map(str, kinds))}",
                          hint="keep the parameters in fp32 (use train.precision=bf16 for mixed precision)")


class ShardGradients:
    """A step's gradients, from the backward passes to ``part``, this rank's slice of their average
    (``comm.shard_reduce``): a :class:`ShardedOptimizer`'s, fed by hooks on the model's parameters."""

    def __init__(self, params, offsets, part, counts, backend, stage, reduction, accumulation, max_in_flight):
        import torch

        self.params, self.offsets, self.part, self.counts, self.backend = params, offsets, part, counts, backend
        self.stage, self.reduction, self.accumulation, self.max_in_flight = stage, reduction, accumulation, max_in_flight
        self.numel = sum(p.numel() for p in params)
        self._zeros = functools.partial(torch.zeros, dtype=torch.float32, device=params[0].device)
        # All-reduce buckets, started in order (the same order on every rank, as MPI needs)
        # once every gradient of the bucket has arrived from the step's last backward pass.
        self.buckets = gradient_buckets([p.numel() for p in params], BUCKET_BYTES // 4)
        self._bucket_of = {i: k for k, (_, _, members) in enumerate(self.buckets) for i in members}
        self._in_flight = []  # (bucket, handle) started and not yet waited for, oldest first
        self.grad_flat = None
        self.zero_grad()  # the rest as between two steps: no bucket started, no buffer of stage 2
        if stage == "optimizer":  # stage 1: gradients accumulate in place into one kept buffer
            self.grad_flat = self._zeros(self.numel)
            for p, view in zip(params, views(self.grad_flat, params)):
                p.grad = view
        hooked = stage == "gradients" or reduction == "allreduce"
        for i, p in enumerate(params):
            if getattr(p, "_hpctrain_shard_hook", None) is not None:  # a model trained again (a second fit)
                p._hpctrain_shard_hook.remove()  # must not feed the last optimizer
            p._hpctrain_shard_hook = p.register_post_accumulate_grad_hook(self._on_grad(i)) if hooked else None

    def _on_grad(self, i):
        """The hook run when parameter ``i``'s gradient of a backward pass is complete. Stage 2: add it into a
        flat buffer and free it, so that the model's gradients never all exist beside the buffer.
        ``"allreduce"``: count it, and start the buckets that the step's last backward pass has completed."""
        off, n = self.offsets[i], self.params[i].numel()
        k = self._bucket_of[i]
        start = self.buckets[k][0]
        # A weak reference: the hook lives in autograd (C++), where Python's collector cannot
        # see a cycle back to these buffers and the model's parameters.
        ref = weakref.ref(self)

        def hook(p):
            self = ref()
            if self is None:
                return
            if self.stage == "gradients":
                if self.reduction == "allreduce":
                    self._bucket_tensor(k)[off - start:off - start + n].view(p.shape).add_(p.grad)
                else:
                    self._whole()[off:off + n].view(p.shape).add_(p.grad)
                p.grad = None
            if self.reduction == "allreduce":
                self._arrived[k] += 1
                self._start_ready_buckets()
        return hook

    def _whole(self):
        """The flat buffer of this step's summed local gradients (reduce-scatter, or stage 1)."""
        if self.grad_flat is not None:
            return self.grad_flat
        if self._accumulated is None:
            self._accumulated = self._zeros(self.numel)
        return self._accumulated

    def _bucket_tensor(self, k):
        """Bucket ``k``'s gradients: a view of the kept buffer (stage 1), or its own buffer (stage 2)."""
        lo, hi, _ = self.buckets[k]
        if self.grad_flat is not None:
            return self.grad_flat[lo:hi]
        if self._bucket_grads[k] is None:
            self._bucket_grads[k] = self._zeros(hi - lo)
        return self._bucket_grads[k]

    def _start_ready_buckets(self, all_now=False):
        while self._started < len(self.buckets):
            k = self._started
            if not all_now and self._arrived[k] < len(self.buckets[k][2]) * self.accumulation:
                return
            handle = self.backend.start_average(self._bucket_tensor(k), name=f"hpctrain.shard.reduce.{k}")
            self._in_flight.append((k, handle))
            self._started += 1
            while self.stage == "gradients" and len(self._in_flight) > self.max_in_flight:
                self._finish_oldest()

    def _finish_oldest(self):
        """Wait for the oldest bucket in flight; stage 2 keeps only its part of this rank's slice."""
        k, handle = self._in_flight.pop(0)
        self.backend.wait_average(handle)
        if self.grad_flat is None:
            lo, hi, _ = self.buckets[k]
            slo, shi = self.part
            if self._slice_grad is None:
                self._slice_grad = self._zeros(shi - slo)
            a, b = max(lo, slo), min(hi, shi)
            if b > a:
                self._slice_grad[a - slo:b - slo] = self._bucket_grads[k][a - lo:b - lo]
            self._bucket_grads[k] = None

    def _reset_buckets(self):
        while self._in_flight:  # started but never synchronized: a collective cannot be dropped
            self._finish_oldest()
        self._started, self._arrived = 0, [0] * len(self.buckets)  # buckets started, gradients arrived per bucket
        self._bucket_grads = [None] * len(self.buckets)  # stage 2: each bucket's own buffer

    def zero_grad(self):
        self._reset_buckets()
        self._slice_grad = self._accumulated = None  # stage 2's buffers (_finish_oldest, _whole)
        if self.grad_flat is not None:
            self.grad_flat.zero_()  # the model's gradients stay views of it

    def reduce(self):
        """This rank's slice of the average of the summed local gradients (called under no_grad)."""
        if self.reduction == "allreduce":
            self._start_ready_buckets(all_now=True)  # those no backward pass completed
            self._reset_buckets()
            grad, self._slice_grad = self._slice_grad, None  # stage 2's
            lo, hi = self.part
            return grad if self.grad_flat is None else self.grad_flat[lo:hi]  # stage 1: a view of the kept buffer
        flat, self._accumulated = self._whole(), None  # stage 2: freed once the slice is taken
        return self.backend.reduce_scatter_mean(flat, self.counts)


def _slice_optimizer(optimizer, flat, lo, hi):
    """``(parts, shards, inner)``: this rank's part ``[lo, hi)`` of each group's range of ``flat`` (maybe empty),
    one tensor per group to keep its settings (weight decay, lr scale), an optimizer of the same class and settings."""
    import torch

    groups = optimizer.param_groups
    sizes = [sum(p.numel() for p in group["params"]) for group in groups]
    parts = [(min(max(lo, a), hi), max(min(max(lo, a), hi), min(hi, a + n)))
             for a, n in zip(itertools.accumulate(sizes, initial=0), sizes)]
    shards = [torch.nn.Parameter(flat[a:b]) for a, b in parts]
    inner = type(optimizer)([{"params": [s]} for s in shards], lr=groups[0]["lr"])
    for mine, group in zip(inner.param_groups, groups):  # some group keys are not constructor arguments
        mine.update({k: v for k, v in group.items() if k != "params"})
    inner.defaults = dict(optimizer.defaults)
    return parts, shards, inner


class ShardedOptimizer:
    """The optimizer the trainer steps when ``comm.shard`` is not ``"none"``.

    ``optimizer``: the torch optimizer over the model's parameters as built for a replicated run, replaced by
    one of the same class and settings over this rank's slice. ``stage``: ``"optimizer"`` or ``"gradients"``.

    >>> opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, backend)  # doctest: +SKIP
    >>> loss.backward(); opt.synchronize(); opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()    # doctest: +SKIP
    """

    sharded = True
    # Stage 2 waits for the oldest bucket past this many in flight, so few buckets' full gradients coexist.
    MAX_IN_FLIGHT = 2

    def __init__(self, optimizer, model, backend, stage="optimizer", accumulation=1, reduction="auto"):
        import torch

        check_supported(optimizer, model)
        check_choice("comm.shard", stage, SHARD_MODES[1:])
        self.backend, self.model, self.stage = backend, model, stage
        self.accumulation = max(1, int(accumulation))
        self.rank, self.size = backend.rank, backend.size
        groups = optimizer.param_groups
        self.params = [p for group in groups for p in group["params"]]  # the flat buffer's order: group by group
        self.shapes = [tuple(p.shape) for p in self.params]
        self.bounds = shard_bounds(self.shapes, self.size)
        self.counts = [b - a for a, b in self.bounds]
        *self.offsets, self.numel = itertools.accumulate((p.numel() for p in self.params), initial=0)
        # Views of one buffer: the all-gather fills them in place; the optimizer updates this rank's slice.
        self.flat = torch.empty(self.numel, dtype=torch.float32, device=self.params[0].device)
        with torch.no_grad():
            for p, view in zip(self.params, views(self.flat, self.params)):
                view.copy_(p)
                p.data = view
        lo, hi = self.bounds[self.rank]
        self.parts, self.shards, self.optimizer = _slice_optimizer(optimizer, self.flat, lo, hi)
        self.group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        self.grad = None  # this rank's slice of the averaged gradients; each group's shard has a view of it
        self.reduction = resolve_reduction(reduction, self.flat.device)
        self.gradients = ShardGradients(self.params, self.offsets, (lo, hi), self.counts, backend, stage,
                                        self.reduction, self.accumulation, self.MAX_IN_FLIGHT)
        self.buckets = self.gradients.buckets  # the all-reduce buckets: (start, stop, [parameter indices])

    # ---- what the trainer uses of a torch optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self._set_grad(None)
        self.gradients.zero_grad()

    def _set_grad(self, grad):
        self.grad = grad
        lo = self.bounds[self.rank][0]
        for shard, (a, b) in zip(self.shards, self.parts):
            shard.grad = None if grad is None else grad[a - lo:b - lo]

    # ---- one step
    def synchronize(self):
        """Reduce: this rank's slice of the summed local gradients' average becomes its optimizer's grad."""
        import torch

        with torch.no_grad():
            self._set_grad(self.gradients.reduce())

    def grads_finite(self):
        """True on every rank if every averaged gradient is finite (one all-reduce of a flag)."""
        import torch

        ok = self.grad is None or self.grad.numel() == 0 or bool(torch.isfinite(self.grad.pow(2).sum()))
        return self.backend.allreduce_mean(1.0 if ok else 0.0) == 1.0

    def first_nonfinite(self):
        """As :func:`.nonfinite.first_nonfinite`, over every rank's slice (the same answer on every rank)."""
        import torch

        lo, hi = self.bounds[self.rank]
        # Always a (index, name) tuple: hvd.allgather_object names its collective after the type.
        found = (len(self.params), "")
        grad = self.grad
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if grad is not None and b > a:
                part = grad[a - lo:b - lo]
                if not bool(torch.isfinite(part).all()):
                    found = (i, f"{self.param_names()[i]} ({'NaN' if bool(torch.isnan(part).any()) else 'inf'})")
                    break
        candidates = [f for f in self.backend.allgather_object(found) if f[1]]
        return min(candidates)[1] if candidates else "none: every element is finite, but their norm overflows"

    def clip_grad_norm(self, max_norm):
        """Clip as ``torch.nn.utils.clip_grad_norm_`` does on the whole; returns the global norm before."""
        import torch

        grad = self.grad
        local = float(grad.double().pow(2).sum()) if grad is not None and grad.numel() else 0.0
        total = math.sqrt(max(self.backend.allreduce_mean(local) * self.size, 0.0))
        if grad is not None:
            grad.mul_(torch.clamp(torch.tensor(max_norm / (total + 1e-6)), max=1.0).to(grad.dtype))
        return total

    def step(self):
        """Update this rank's slice, then all-gather every slice into every rank's parameters."""
        import torch

        self.optimizer.step()
        with torch.no_grad():
            self.backend.allgather_flat(self.flat, self.counts)

    def broadcast_parameters(self, root=0):
        """Make every rank's parameters and buffers ``root``'s (the optimizer slices stay each rank's own)."""
        self.backend.broadcast_tensor(self.flat, root)
        for buf in self.model.buffers():
            self.backend.broadcast_tensor(buf, root)

    # ---- what checkpoints need (hpctrain.checkpoint.planners.sharded)
    def param_names(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]

    def group_names(self):
        """The parameter names of each group, in the optimizer's order."""
        named = list(zip(self.group_of, self.param_names()))
        return [[name for g, name in named if g == group] for group in range(len(self.shards))]

    def layout(self):
        """``[(name, shape, pieces)]`` per parameter, pieces as :func:`pieces_of` gives them."""
        return [(name, shape, pieces_of(off, shape, self.bounds))
                for name, shape, off in zip(self.param_names(), self.shapes, self.offsets)]

    def memory(self):
        """Bytes this rank holds of parameters, gradients and optimizer state (tensor accounting)."""
        grads = self.gradients.grad_flat.nbytes if self.gradients.grad_flat is not None else 0
        if self.grad is not None and self.grad._base is None:  # not a view of grad_flat
            grads += self.grad.nbytes
        state = sum(t.nbytes for s in self.optimizer.state.values() for t in s.values() if hasattr(t, "nbytes"))
        return {"parameters": self.flat.nbytes, "gradients": grads, "optimizer_state": state}
