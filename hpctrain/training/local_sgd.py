"""``comm.mode = "local_sgd"``: each rank applies its own gradients; at synchronisation points (every
``comm.sync_every`` steps, and each of the first ``comm.sync_warmup``, averaging gradients as ``sync`` does) one
fused collective averages the change since the last one of the parameters and floating buffers (batch-norm
statistics), and the inner optimizer's state (momentum, Adam moments), leaving one model and one optimizer on all
ranks. The averaged change ``delta = anchor - mean(params)`` goes through an outer optimizer (SlowMo/DiLoCo):
``none``: the plain average; ``nesterov``: momentum ``m = mu*m + delta``, ``anchor -= outer_lr*(delta + mu*m)``."""
import logging

from ..errors import HpctrainError
from ..runtime.coordination import everywhere
from ..runtime.flat import views
from ..runtime.replicas import ReplicasDiverged, compare_replicas
from . import nonfinite
from .sync_mode import SelfAveraging

log = logging.getLogger("hpctrain")


def check_replicas(model, comm, after):
    """Collective: if replicas differ, every rank raises the same :class:`ReplicasDiverged`, naming them."""
    found = compare_replicas(model, comm)
    if found is not None:
        _, (diverged, reference), first = found
        raise everywhere(ReplicasDiverged(
            f"after {after}, ranks {', '.join(map(str, diverged))} hold parameters that differ from rank "
            f"{reference}'s (first differing: {first})",
            hint="the averaging gave ranks different results: check that every rank runs the same MPI and "
                 "Horovod build, or set comm.mode=sync"))


class OuterOptimizer:
    """``local_sgd``'s outer step: the anchor, ``tensors`` (parameters named ``names``, then floating buffers)
    at the last synchronisation, moves by the averaged change (nesterov: via momentum per parameter)."""

    def __init__(self, cfg, tensors, names):
        import torch

        self.nesterov = cfg.outer_optimizer == "nesterov"
        self.mu, self.lr = cfg.outer_momentum, cfg.outer_lr
        self.tensors, self.names, self.anchor = tensors, names, None
        self.momentum = ([torch.zeros_like(p, memory_format=torch.contiguous_format) for p in tensors[:len(names)]]
                         if self.nesterov else [])

    def reset(self):
        """The model as it is now becomes the anchor."""
        import torch

        if self.anchor is None:
            self.anchor = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.tensors]
        with torch.no_grad():
            for a, t in zip(self.anchor, self.tensors):
                a.copy_(t)

    def changes_to(self, flat):
        """Write ``anchor - model`` into ``flat``."""
        for a, t, chunk in zip(self.anchor, self.tensors, views(flat, self.tensors)):
            chunk.copy_(a - t)

    def step(self, flat):
        """Move the anchor by the averaged changes in ``flat``; the model becomes the anchor."""
        for i, (a, t, d) in enumerate(zip(self.anchor, self.tensors, views(flat, self.tensors))):
            d = d.to(a.dtype) if d.dtype != a.dtype else d
            if i < len(self.momentum):  # a parameter, with nesterov
                m = self.momentum[i]
                m.mul_(self.mu).add_(d)
                a.sub_(d.add(m, alpha=self.mu), alpha=self.lr)
            else:
                a.sub_(d)
            t.copy_(a)

    def checkpoint_tensors(self):
        return {f"outer_momentum/{name}": m for name, m in zip(self.names, self.momentum)}

    def restore_tensors(self, tensors):
        import torch

        with torch.no_grad():
            for name, m in zip(self.names, self.momentum):
                saved = tensors.get(f"outer_momentum/{name}")
                if saved is None:
                    m.zero_()
                else:
                    m.copy_(saved)
        if self.anchor is not None:  # a rollback: the loaded model is the new anchor
            self.reset()

    def describe(self):
        return f"outer nesterov lr {self.lr:g} momentum {self.mu:g}" if self.nesterov else "plain average"


class LocalSGD(SelfAveraging):
    """``comm.mode = "local_sgd"``: see the module docstring."""

    name = "local_sgd"

    def __init__(self, backend, model, cfg):
        super().__init__(backend, model, cfg)
        self.every, self.warmup = int(cfg.sync_every), int(cfg.sync_warmup)
        self.check = bool(getattr(cfg, "check_replicas", True))
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.outer = OuterOptimizer(cfg, self._params + self._buffers, [self._names[id(p)] for p in self._params])
        self._synced = True  # the replicas are one model now
        self.syncs = 0
        self.local_skips = 0  # local steps whose non-finite gradients this rank did not apply

    def start(self, state):
        self.optimizer = state.optimizer
        self.outer.reset()
        self._synced = True

    def synchronize_gradients(self, optimizer, step):
        if step <= self.warmup:
            self._average_gradients_and_buffers()
        elif not nonfinite.grads_finite(optimizer):
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
        """A warm-up step, as ``sync``, with the floating buffers averaged too (batch-norm statistics come
        from each rank's own batch), so the first local period's anchor is the same on every rank."""
        import torch

        params = self._grads()
        with torch.no_grad():
            grads = self._average_fused(params, lambda flat: self._grads_to(flat, params), self._buffers)
            for p, chunk in zip(params, views(grads, params)):
                p.grad = chunk.to(p.dtype) if p.dtype != grads.dtype else chunk

    def _average_fused(self, head, fill, tail):
        """One collective averages a flat buffer: ``fill``'s values for the tensors ``head`` (returned,
        averaged), then the tensors ``tail`` (averaged in place). With fp16 compression the head (gradients,
        changes: small) goes in fp16, the tail apart in fp32 (Adam's squared moments would underflow)."""
        import torch

        n_head = sum(t.numel() for t in head)
        flat = torch.empty(n_head + sum(t.numel() for t in tail), dtype=torch.float32, device=head[0].device)
        front, back = flat[:n_head], flat[n_head:]
        fill(front)
        for t, chunk in zip(tail, views(back, tail)):
            chunk.copy_(t)
        if self.backend.compression == "fp16" and back.numel():
            self._count(front)
            handle = self.backend.start_average(front)
            self.sent_bytes += back.numel() * back.element_size()
            self.backend.average(back, compress=False)
            self.backend.wait_average(handle)
        else:
            self._count(flat)
            self.backend.average(flat)
        for t, chunk in zip(tail, views(back, tail)):
            t.copy_(chunk)
        return front

    def after_step(self, step):
        """End of step ``step`` (counted from 1): average if it is a synchronisation point."""
        if step <= self.warmup:
            self._synced = True
            if step == self.warmup:
                # The anchor of the first local period: taken here, not at the next step, whose
                # forward pass already changes each rank's batch-norm statistics its own way.
                self.outer.reset()
            return True
        if step % self.every == 0:
            self._average(f"the parameter average of step {step}")
            return True
        return False

    def align_replicas(self, step):
        """Average now unless this step already ended synchronised."""
        if not self._synced:
            self._average(f"the forced parameter average of step {step}")

    def may_save(self, step, requested=False, final=False, epoch_end=False, **_):
        """A save that must happen averages first; a periodic one waits for a synchronisation point."""
        if requested or final or epoch_end:
            self.align_replicas(step)
        return self._synced

    def settle(self, step, stopped):
        """One model, averaged, at the end (and at a stop, which saves it)."""
        self.align_replicas(step)

    def _optimizer_state(self):
        state = self.optimizer.state
        return [value for p in self._params for _, value in sorted(state.get(p, {}).items())
                if hasattr(value, "is_floating_point") and value.is_floating_point()]

    def _average(self, after):
        import torch

        with torch.no_grad():
            changes = self._average_fused(self.outer.tensors, self.outer.changes_to, self._optimizer_state())
            self.outer.step(changes)
        self._synced = True
        self.syncs += 1
        if self.check:
            check_replicas(self.model, self.backend.world.comm, after)

    def checkpoint_tensors(self):
        if not self._synced:
            # A checkpoint between synchronisation points would mix replicas.
            raise everywhere(HpctrainError("internal: a local_sgd checkpoint was asked for between "
                                           "synchronisation points"))
        return self.outer.checkpoint_tensors()

    def restore_tensors(self, tensors):
        self.outer.restore_tensors(tensors)
        self._synced = True

    def describe(self):
        warm = f" after {self.warmup} synchronous steps" if self.warmup else ""
        return f"comm.mode local_sgd: parameters averaged every {self.every} steps{warm}, {self.outer.describe()}"
