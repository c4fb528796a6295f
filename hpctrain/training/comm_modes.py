"""When ranks exchange what (``comm.mode``): every step (``sync``, :mod:`.sync_mode`), every few steps
(``local_sgd``, :mod:`.local_sgd`), or one step late (``stale``: step t's gradient average travels while t+1
computes and is applied then; step 1, or one after a flush, applies nothing; a checkpoint holds the pending
average). The trainer drives one object of :func:`build` per run, whose tensors are in every checkpoint::

    mode = build(cfg.comm, backend, model); optimizer = mode.wrap_optimizer(inner, model, accumulation)
    mode.start(state)                                    # after resume and broadcast
    if mode.synchronize_gradients(optimizer, step):      # stale: last step's average (none at the first)
        mode.step(optimizer, scaler)
    synced = mode.after_step(step)                       # local_sgd: the parameter average every sync_every
    mode.may_save(step, **when)                          # local_sgd: only at those points, or averaging first
    mode.align_replicas(step); mode.settle(step, stopped)  # local_sgd: averages; stale settles: applies the pending
"""
from ..runtime.flat import views
from .local_sgd import LocalSGD
from .sync_mode import SelfAveraging, Sync


def build(comm_cfg, backend, model):
    """The mode object for ``comm_cfg.mode`` (``[comm]`` of the configuration)."""
    mode = {"local_sgd": LocalSGD, "stale": Stale}.get(getattr(comm_cfg, "mode", "sync"), Sync)
    return mode(backend, model, comm_cfg)


class Stale(SelfAveraging):
    """``comm.mode = "stale"``: see the module docstring."""

    name = "stale"

    def __init__(self, backend, model, cfg):
        super().__init__(backend, model, cfg)
        self._slots = [None, None]  # two gradient buffers: one travelling, one being applied
        self._slot = 0
        self._inflight = None  # (handle, flat) of the average started last step
        self._ready = None  # an averaged flat buffer not yet applied (restored from a checkpoint)
        self.applied = 0  # averages applied (a test counts them)

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
            (handle, flat), self._inflight = self._inflight, None
            self.backend.wait_average(handle)
            return flat
        return None

    def _set_grads(self, flat):
        params = self._grads()
        for p, chunk in zip(params, views(flat, params)):
            p.grad = chunk.to(p.dtype) if p.dtype != flat.dtype else chunk
        self.applied += 1

    def settle(self, step, stopped):
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
        self._ready = self._take_pending()  # waited for if in flight; it is still applied at the next step
        if self._ready is None:
            return {}
        params = self._grads()
        return {f"pending_gradient/{self._names[id(p)]}": chunk for p, chunk in zip(params, views(self._ready, params))}

    def restore_tensors(self, tensors):
        import torch

        self._ready = None
        self._take_pending()  # a rollback: what was travelling is waited for and dropped
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
