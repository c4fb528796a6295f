"""When ranks exchange what (``comm.mode``): every step, every few steps, or one step late.

``sync`` (default): every step waits for the average of its gradients (the backend's
distributed optimizer), so every rank applies the same update.

``local_sgd``: every rank applies its optimizer to its own gradients; at synchronisation
points (every ``comm.sync_every`` steps, and every step of the first ``comm.sync_warmup``
steps, which average gradients as ``sync`` does) the replicas are averaged in one fused
collective: the change since the last synchronisation of the parameters and floating buffers
(batch-norm statistics), and the inner optimizer's state (momentum, Adam moments), so that
every synchronisation point is one model and one optimizer on every rank. The averaged change
``delta = anchor - mean(params)`` goes through an outer optimizer (SlowMo/DiLoCo):
``none`` makes the parameters the average; ``nesterov`` keeps a momentum buffer
``m = mu*m + delta`` and moves ``anchor -= outer_lr*(delta + mu*m)``.

``stale``: the average of step t's gradients is started without waiting and applied at step
t+1, so it travels while step t+1 computes. Step 1 of a run (or after a flush) applies
nothing; the end of training applies the last pending average; a checkpoint holds the
pending average (waiting for it, never applying it), so resuming continues the same sequence.

The trainer talks to one object of :func:`build` per run, at fixed places of a step::

    mode = build(cfg.comm, backend, model)
    optimizer = mode.wrap_optimizer(inner_optimizer, model, accumulation)
    mode.start(state)                                  # after resume and broadcast
    ... backward ...
    apply = mode.synchronize_gradients(optimizer, step)  # False: nothing to apply this step
    if apply: mode.step(optimizer, scaler)
    optimizer.zero_grad()
    synced = mode.after_step(step)                     # True at a synchronisation point
    mode.may_save(step, **when)                        # checkpoints only at those points
    mode.sync_now(step); mode.end(step, stopped)       # epoch end, the end of training

Its tensors (``checkpoint_tensors``/``restore_tensors``) are part of every checkpoint.
"""
import logging

from ..runtime.coordination import everywhere
from ..errors import HpctrainError
from ..runtime.flat import views
from ..runtime.replicas import ReplicasDiverged, compare_replicas
from . import nonfinite

log = logging.getLogger("hpctrain")


def build(comm_cfg, backend, model):
    """The mode object for ``comm_cfg.mode`` (``[comm]`` of the configuration)."""
    mode = getattr(comm_cfg, "mode", "sync")
    if mode == "local_sgd":
        return LocalSGD(backend, model, comm_cfg)
    if mode == "stale":
        return Stale(backend, model, comm_cfg)
    return Sync(backend, model, comm_cfg)


def check_replicas(model, comm, after):
    """Collective: raise the same :class:`ReplicasDiverged` on every rank, naming the ranks that
    differ, when they are not one model."""
    found = compare_replicas(model, comm)
    if found is not None:
        _, (diverged, reference), first = found
        raise everywhere(ReplicasDiverged(
            f"after {after}, ranks {', '.join(map(str, diverged))} hold parameters that differ from rank "
            f"{reference}'s (first differing: {first})",
            hint="the averaging gave ranks different results: check that every rank runs the same MPI and "
                 "Horovod build, or set comm.mode=sync"))


def _floating(tensors):
    return [t for t in tensors if t.is_floating_point()]


class Sync:
    """``comm.mode = "sync"``: the backend's distributed optimizer, as always."""

    name = "sync"

    def __init__(self, backend, model, cfg):
        self.backend = backend
        self.model = model
        self.cfg = cfg
        self.sent_bytes = 0  # bytes this rank handed to collectives of this mode (0 for sync: the backend's)

    def wrap_optimizer(self, optimizer, model, accumulation):
        return self.backend.distributed_optimizer(optimizer, model, accumulation)

    def start(self, state):
        self.optimizer = state.optimizer

    def synchronize_gradients(self, optimizer, step):
        """After the backward passes of step ``step`` (counted from 1): make the gradients to
        apply; False when there are none this step."""
        self.backend.synchronize(optimizer)
        return True

    def step(self, optimizer, scaler=None):
        self.backend.step(optimizer, scaler)

    def after_step(self, step):
        return True

    def may_save(self, step, **when):
        return True

    def sync_now(self, step):
        pass

    def end(self, step, stopped):
        pass

    def checkpoint_tensors(self):
        return {}

    def restore_tensors(self, tensors):
        pass

    def describe(self):
        return "comm.mode sync"

    # ---- shared by the modes that average themselves
    def _plain_step(self, optimizer, scaler=None):
        # Not the backend's step: the plain optimizer has no Horovod skip_synchronize.
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    def _grads(self):
        return [p for p in self._params if p.requires_grad]

    def _grads_to(self, flat, params):
        for p, chunk in zip(params, views(flat, params)):
            if p.grad is None:
                chunk.zero_()
            else:
                chunk.copy_(p.grad)
        return flat

    def _count(self, flat):
        compress = self.backend.compression == "fp16" and flat.dtype.is_floating_point
        self.sent_bytes += flat.numel() * (2 if compress else flat.element_size())


class LocalSGD(Sync):
    """``comm.mode = "local_sgd"``: see the module docstring."""

    name = "local_sgd"

    def __init__(self, backend, model, cfg):
        import torch

        super().__init__(backend, model, cfg)
        self.every = int(cfg.sync_every)
        self.warmup = int(cfg.sync_warmup)
        self.nesterov = cfg.outer_optimizer == "nesterov"
        self.check = bool(getattr(cfg, "check_replicas", True))
        self._params = [p for p in model.parameters()]
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._buffers = _floating([b for b in model.buffers()])
        self._model_tensors = self._params + self._buffers
        self._anchor = None  # the parameters and buffers at the last synchronisation point
        self._momentum = ([torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self._params]
                          if self.nesterov else [])
        self._synced = True  # the replicas are one model now
        self.syncs = 0
        self.local_skips = 0  # local steps whose non-finite gradients this rank did not apply

    def wrap_optimizer(self, optimizer, model, accumulation):
        # The plain optimizer: no hooks that average every step (Horovod's would).
        return optimizer

    def step(self, optimizer, scaler=None):
        self._plain_step(optimizer, scaler)

    def start(self, state):
        import torch

        self.optimizer = state.optimizer
        if self._anchor is None:
            self._anchor = [torch.empty_like(t, memory_format=torch.contiguous_format)
                            for t in self._model_tensors]
        self._refresh_anchor()
        self._synced = True

    def _refresh_anchor(self):
        import torch

        with torch.no_grad():
            for a, t in zip(self._anchor, self._model_tensors):
                a.copy_(t)

    def synchronize_gradients(self, optimizer, step):
        if step <= self.warmup:
            self._average_gradients_and_buffers()
        else:
            if not nonfinite.grads_finite(optimizer):
                # Local gradients: the other ranks may not agree, and the trainer's skip, rollback
                # or stop must be the same on every rank. This rank's update is left out alone.
                self.local_skips += 1
                log.warning("rank %d: non-finite gradients at step %d (comm.mode local_sgd): this rank's update "
                            "is skipped; the next average brings it back to the others", self.backend.rank, step)
                self._synced = False
                return False
        self._synced = step <= self.warmup
        return True

    def _average_gradients_and_buffers(self):
        """A warm-up step, as ``sync``: the averaged gradients, and the floating buffers averaged
        too (batch-norm statistics are computed from each rank's own batch), so that the anchor
        of the first local period is the same on every rank."""
        import torch

        params = self._grads()
        n_grads = sum(p.numel() for p in params)
        n_buffers = sum(b.numel() for b in self._buffers)
        with torch.no_grad():
            flat = torch.empty(n_grads + n_buffers, dtype=torch.float32, device=params[0].device)
            self._grads_to(flat[:n_grads], params)
            for b, chunk in zip(self._buffers, views(flat[n_grads:], self._buffers)):
                chunk.copy_(b)
            self._average_split(flat, n_grads)
            for p, chunk in zip(params, views(flat, params)):
                p.grad = chunk.to(p.dtype) if p.dtype != flat.dtype else chunk
            for b, chunk in zip(self._buffers, views(flat[n_grads:], self._buffers)):
                b.copy_(chunk)

    def _average_split(self, flat, n_compressible):
        """Average ``flat`` in one collective; with fp16 compression, its first ``n_compressible``
        elements in fp16 and the rest in fp32 apart (values that fp16 would not hold)."""
        if self.backend.compression == "fp16" and n_compressible < flat.numel():
            head, tail = flat[:n_compressible], flat[n_compressible:]
            self._count(head)
            handle = self.backend.start_average(head)
            self.sent_bytes += tail.numel() * tail.element_size()
            self.backend.average(tail, compress=False)
            self.backend.wait_average(handle)
        else:
            self._count(flat)
            self.backend.average(flat)

    def after_step(self, step):
        """End of step ``step`` (counted from 1): average if it is a synchronisation point."""
        if step <= self.warmup:
            self._synced = True
            if step == self.warmup:
                # The anchor of the first local period: taken here, not at the next step, whose
                # forward pass already changes each rank's batch-norm statistics its own way.
                self._refresh_anchor()
            return True
        if step % self.every == 0:
            self._average(f"the parameter average of step {step}")
            return True
        return False

    def sync_now(self, step):
        """Average now unless this step already ended synchronised (epoch end, stop, end)."""
        if not self._synced:
            self._average(f"the forced parameter average of step {step}")

    def may_save(self, step, requested=False, final=False, epoch_end=False, **_):
        if requested or final or epoch_end:
            self.sync_now(step)
        return self._synced

    def end(self, step, stopped):
        self.sync_now(step)

    def _optimizer_state(self):
        state = self.optimizer.state
        out = []
        for p in self._params:
            for key in sorted(state.get(p, {})):
                value = state[p][key]
                if hasattr(value, "is_floating_point") and value.is_floating_point():
                    out.append(value)
        return out

    def _average(self, after):
        """One synchronisation: the fused average, the outer step, the replica check."""
        import torch

        model_part = self._model_tensors
        opt_part = self._optimizer_state()
        n_model = sum(t.numel() for t in model_part)
        n_opt = sum(t.numel() for t in opt_part)
        device = self._params[0].device
        with torch.no_grad():
            flat = torch.empty(n_model + n_opt, dtype=torch.float32, device=device)
            for a, t, chunk in zip(self._anchor, model_part, views(flat, model_part)):
                chunk.copy_(a - t)
            opt_flat = flat[n_model:]
            for t, chunk in zip(opt_part, views(opt_flat, opt_part)):
                chunk.copy_(t)
            # The change is small and travels well in fp16; optimizer state (Adam's squared
            # moments) would underflow, so with compression it goes in fp32 apart.
            self._average_split(flat, n_model)
            deltas = list(views(flat, model_part))
            for i, (a, t, d) in enumerate(zip(self._anchor, model_part, deltas)):
                d = d.to(a.dtype) if d.dtype != a.dtype else d
                if self.nesterov and i < len(self._params):
                    m = self._momentum[i]
                    mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
                    m.mul_(mu).add_(d)
                    a.sub_(d.add(m, alpha=mu), alpha=lr)
                else:
                    a.sub_(d)
                t.copy_(a)
            for t, chunk in zip(opt_part, views(opt_flat, opt_part)):
                t.copy_(chunk)
        self._synced = True
        self.syncs += 1
        if self.check:
            check_replicas(self.model, self.backend.world.comm, after)

    def checkpoint_tensors(self):
        if not self._synced:
            # A checkpoint between synchronisation points would mix replicas.
            raise everywhere(HpctrainError("internal: a local_sgd checkpoint was asked for between "
                                           "synchronisation points"))
        return {f"outer_momentum/{self._names[id(p)]}": m for p, m in zip(self._params, self._momentum)}

    def restore_tensors(self, tensors):
        import torch

        with torch.no_grad():
            for p, m in zip(self._params, self._momentum):
                saved = tensors.get(f"outer_momentum/{self._names[id(p)]}")
                if saved is None:
                    m.zero_()
                else:
                    m.copy_(saved)
        if self._anchor is not None:  # a rollback: the loaded model is the new anchor
            self._refresh_anchor()
        self._synced = True

    def describe(self):
        outer = (f"outer nesterov lr {self.cfg.outer_lr:g} momentum {self.cfg.outer_momentum:g}"
                 if self.nesterov else "plain average")
        warm = f" after {self.warmup} synchronous steps" if self.warmup else ""
        return f"comm.mode local_sgd: parameters averaged every {self.every} steps{warm}, {outer}"


class Stale(Sync):
    """``comm.mode = "stale"``: see the module docstring."""

    name = "stale"

    def __init__(self, backend, model, cfg):
        super().__init__(backend, model, cfg)
        self._params = [p for p in model.parameters()]
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._slots = [None, None]  # two gradient buffers: one travelling, one being applied
        self._slot = 0
        self._inflight = None  # (handle, flat) of the average started last step
        self._ready = None  # an averaged flat buffer not yet applied (restored from a checkpoint)
        self.applied = 0  # averages applied (a test counts them)

    def wrap_optimizer(self, optimizer, model, accumulation):
        return optimizer

    def _buffer(self):
        import torch

        params = self._grads()
        slot = self._slots[self._slot]
        if slot is None:
            slot = self._slots[self._slot] = torch.empty(sum(p.numel() for p in params), dtype=torch.float32,
                                                         device=params[0].device)
        self._slot ^= 1
        return slot

    def synchronize_gradients(self, optimizer, step):
        import torch

        with torch.no_grad():
            previous = self._take_pending()
            flat = self._grads_to(self._buffer(), self._grads())
            self._count(flat)
            self._inflight = (self.backend.start_average(flat, name=f"hpctrain.stale.{self._slot}"), flat)
            if previous is None:
                for p in self._params:
                    p.grad = None
                return False
            self._set_grads(previous)
        return True

    def _take_pending(self):
        """The averaged gradients waiting to be applied (waiting for them if in flight)."""
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self._inflight is not None:
            handle, flat = self._inflight
            self._inflight = None
            self.backend.wait_average(handle)
            return flat
        return None

    def _set_grads(self, flat):
        params = self._grads()
        for p, chunk in zip(params, views(flat, params)):
            p.grad = chunk.to(p.dtype) if p.dtype != flat.dtype else chunk
        self.applied += 1

    def step(self, optimizer, scaler=None):
        self._plain_step(optimizer, scaler)

    def end(self, step, stopped):
        """The end of training applies the pending average; a stop keeps it (it was saved)."""
        import torch

        pending = self._take_pending()
        if pending is None:
            return
        if stopped:
            self._ready = pending
            return
        with torch.no_grad():
            self._set_grads(pending)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def checkpoint_tensors(self):
        import torch

        if self._inflight is not None:  # wait for it; it is still applied at the next step
            handle, flat = self._inflight
            self._inflight = None
            self.backend.wait_average(handle)
            self._ready = flat
        if self._ready is None:
            return {}
        params = self._grads()
        return {f"pending_gradient/{self._names[id(p)]}": chunk
                for p, chunk in zip(params, views(self._ready, params))}

    def restore_tensors(self, tensors):
        import torch

        if self._inflight is not None:  # a rollback: what was travelling is dropped
            self.backend.wait_average(self._inflight[0])
            self._inflight = None
        self._ready = None
        params = self._grads()
        found = [tensors.get(f"pending_gradient/{self._names[id(p)]}") for p in params]
        if any(t is not None for t in found):
            flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
            for t, chunk in zip(found, views(flat, params)):
                if t is not None:
                    chunk.copy_(t)
            self._ready = flat

    def describe(self):
        return "comm.mode stale: gradients averaged while the next step computes, applied one step late"
