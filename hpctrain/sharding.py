"""Sharded optimizer state and gradients (``comm.shard``, ZeRO stages 1 and 2).

Data-parallel training keeps the whole optimizer state on every rank (AdamW: 8 bytes per
parameter beside 4 of weights and 4 of gradients). With ``comm.shard`` the parameters live
in one flat fp32 buffer (the model's tensors become views of it), cut into one contiguous
slice per rank. A step:

    backward passes (gradients summed locally, as without sharding)
    reduce-scatter: each rank receives the average of its slice only  (backend.reduce_scatter_mean)
    global gradient norm / finiteness: one small all-reduce over the slices
    a real torch optimizer (SGD, Adam, AdamW) updates the slice: its state is 1/N of the whole
    all-gather: every rank's updated slice to every rank               (backend.allgather_flat)

``"optimizer"`` (stage 1) keeps a persistent flat gradient buffer that the model's gradients
are views of (no allocation per step); ``"gradients"`` (stage 2) moves each gradient, as the
backward pass makes it, into a flat buffer that is freed after the reduce-scatter, and keeps
only the slice's averaged gradients between steps. Elementwise optimizers give the same
update on a slice as on the whole tensor, so a sharded run equals a replicated one up to
the order of the floating-point sums in the reduction.

Slice boundaries fall on row boundaries of the parameters (a row: all elements with one
index along dimension 0), so that each rank's part of a parameter is a block of rows: the
region the checkpoint writer takes (``hpctrain.checkpoint.sharded``). Slices are balanced
to within one row.

>>> bounds = shard_bounds([(4, 3), (5,)], 2)   # 12 + 5 elements, two ranks
>>> bounds
[(0, 9), (9, 17)]
"""
import math

from .errors import ConfigError

MODES = ("none", "optimizer", "gradients")


def _rows(shape):
    """``(rows, elements per row)`` of a tensor of ``shape`` (a scalar is one row of one)."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def shard_bounds(shapes, nranks):
    """``[(start, stop)]`` per rank: element ranges of the flat concatenation of tensors of
    ``shapes`` (in order), contiguous, together the whole, each boundary on a row boundary
    and nearest to an equal share (pure; the same on every rank)."""
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += math.prod(shape)
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

    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"comm.shard needs an optimizer with one parameter group; this one has "
                          f"{len(optimizer.param_groups)}", hint="use one group, or comm.shard=none")
    supported = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    if type(optimizer) not in supported:
        raise ConfigError(f"comm.shard supports SGD, Adam and AdamW (elementwise updates), not "
                          f"{type(optimizer).__name__}", hint="use train.optimizer sgd, adam or adamw, or comm.shard=none")
    params = optimizer.param_groups[0]["params"]
    if any(p.dim() == 0 for p in params):
        raise ConfigError("comm.shard does not handle 0-dimensional parameters (a slice boundary needs rows)",
                          hint="make them 1-element tensors (shape (1,)), or use comm.shard=none")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1 or next(iter(kinds))[0] != torch.float32:
        raise ConfigError(f"comm.shard needs every parameter in float32 on one device; found {sorted(map(str, kinds))}",
                          hint="keep the parameters in fp32 (use train.precision=bf16 for mixed precision)")


class ShardedOptimizer:
    """The optimizer the trainer steps when ``comm.shard`` is not ``"none"``.

    ``optimizer``: the torch optimizer over the model's parameters, as built for a
    replicated run; it is replaced by one of the same class and settings over this rank's
    slice. ``stage``: ``"optimizer"`` or ``"gradients"``.

    >>> opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, backend)  # doctest: +SKIP
    >>> loss.backward(); opt.synchronize(); opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()    # doctest: +SKIP
    """

    sharded = True

    def __init__(self, optimizer, model, backend, stage="optimizer"):
        import torch

        check_supported(optimizer, model)
        if stage not in MODES[1:]:
            raise ConfigError(f"comm.shard = {stage!r} is not one of {', '.join(MODES)}")
        self.backend, self.model, self.stage = backend, model, stage
        self.rank, self.size = backend.rank, backend.size
        group = optimizer.param_groups[0]
        self.params = list(group["params"])
        self.shapes = [tuple(p.shape) for p in self.params]
        self.bounds = shard_bounds(self.shapes, self.size)
        self.counts = [b - a for a, b in self.bounds]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        device = self.params[0].device
        # The model's parameters become views of one flat buffer: the all-gather writes
        # straight into them, and this rank's slice is the tensor its optimizer updates.
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, view in zip(self.params, self._views(self.flat)):
                view.copy_(p)
                p.data = view
        lo, hi = self.bounds[self.rank]
        self.shard = torch.nn.Parameter(self.flat[lo:hi])
        # The same class and settings (some group keys are not constructor arguments).
        self.optimizer = type(optimizer)([self.shard], lr=group["lr"])
        self.optimizer.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.optimizer.defaults = dict(optimizer.defaults)
        self.grad_flat = None
        self._accumulated = None  # stage 2: this step's gradients, summed as autograd makes them
        for p in self.params:  # a model trained again (a second fit) must not feed the last optimizer
            handle = getattr(p, "_hpctrain_shard_hook", None)
            if handle is not None:
                handle.remove()
                p._hpctrain_shard_hook = None
        if stage == "optimizer":  # stage 1: gradients accumulate in place into one kept buffer
            self.grad_flat = torch.zeros(total, dtype=torch.float32, device=device)
            for p, view in zip(self.params, self._views(self.grad_flat)):
                p.grad = view
        else:  # stage 2: each gradient moves into a buffer that lives until the reduce-scatter
            for i, p in enumerate(self.params):
                p._hpctrain_shard_hook = p.register_post_accumulate_grad_hook(self._take_grad(i))

    def _take_grad(self, i):
        """Stage 2: add parameter ``i``'s new gradient into this step's flat buffer and free
        it, so that the model's gradients never all exist beside the buffer."""
        import torch

        off, n = self.offsets[i], self.params[i].numel()

        def hook(p):
            if self._accumulated is None:
                self._accumulated = torch.zeros(self.numel, dtype=torch.float32, device=self.flat.device)
            self._accumulated[off:off + n].view(p.shape).add_(p.grad)
            p.grad = None
        return hook

    def _views(self, flat):
        for p, off in zip(self.params, self.offsets):
            yield flat[off:off + p.numel()].view(p.shape)

    # ---- what the trainer uses of a torch optimizer
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.shard.grad = None
        if self.grad_flat is not None:
            self.grad_flat.zero_()  # the model's gradients stay views of it
        else:
            self._accumulated = None

    # ---- one step
    def synchronize(self):
        """Reduce-scatter the summed local gradients: this rank's slice of their average."""
        import torch

        with torch.no_grad():
            flat = self.grad_flat
            if flat is None:  # stage 2: the buffer the hooks filled, freed after the reduce-scatter
                flat, self._accumulated = self._accumulated, None
                if flat is None:  # no backward pass reached a parameter
                    flat = torch.zeros(self.numel, dtype=torch.float32, device=self.flat.device)
            self.shard.grad = self.backend.reduce_scatter_mean(flat, self.counts)

    def grads_finite(self):
        """True on every rank if every averaged gradient is finite (one all-reduce of a flag)."""
        import torch

        grad = self.shard.grad
        ok = grad is None or grad.numel() == 0 or bool(torch.isfinite(grad.pow(2).sum()))
        return self.backend.allreduce_mean(1.0 if ok else 0.0) == 1.0

    def first_nonfinite(self):
        """``name (NaN)`` or ``name (inf)`` of the first parameter with a non-finite gradient
        element, found on whichever rank holds it (the same answer on every rank)."""
        import torch

        names = {id(p): n for n, p in self.model.named_parameters()}
        lo, hi = self.bounds[self.rank]
        # Always a (index, name) tuple: hvd.allgather_object names its collective after the type.
        found = (len(self.params), "")
        grad = self.shard.grad
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if grad is not None and b > a:
                part = grad[a - lo:b - lo]
                if not bool(torch.isfinite(part).all()):
                    found = (i, f"{names.get(id(p), f'param{i}')} ({'NaN' if bool(torch.isnan(part).any()) else 'inf'})")
                    break
        candidates = [f for f in self.backend.allgather_object(found) if f[1]]
        return min(candidates)[1] if candidates else "none: every element is finite, but their norm overflows"

    def clip_grad_norm(self, max_norm):
        """Scale the gradients so that their global L2 norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on the whole; returns the norm before."""
        import torch

        grad = self.shard.grad
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

    # ---- what checkpoints need (hpctrain.checkpoint.sharded)
    def param_names(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]

    def layout(self):
        """``[(name, shape, pieces)]`` per parameter, pieces as :func:`pieces_of` gives them."""
        return [(name, shape, pieces_of(off, shape, self.bounds))
                for name, shape, off in zip(self.param_names(), self.shapes, self.offsets)]

    def memory(self):
        """Bytes this rank holds of parameters, gradients and optimizer state (tensor accounting)."""
        grads = self.grad_flat.nbytes if self.grad_flat is not None else 0
        if self.shard.grad is not None:
            grads += self.shard.grad.nbytes
        state = sum(t.nbytes for s in self.optimizer.state.values() for t in s.values() if hasattr(t, "nbytes"))
        return {"parameters": self.flat.nbytes, "gradients": grads, "optimizer_state": state}
