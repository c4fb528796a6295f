"""``comm.mode = "sync"``, whose methods are the step interface of every mode (:mod:`.comm_modes`), and the
base of the modes that average flat buffers themselves (:mod:`.local_sgd`, ``stale``)."""
from ..backends.base import step_optimizer
from ..runtime.flat import views


class Sync:
    """``comm.mode = "sync"``: the backend's distributed optimizer averages every step's gradients."""

    name = "sync"

    def __init__(self, backend, model, cfg):
        self.backend, self.model, self.cfg = backend, model, cfg
        self.sent_bytes = 0  # bytes this rank handed to collectives of this mode (0 for sync: the backend's)

    def wrap_optimizer(self, optimizer, model, accumulation):
        return self.backend.distributed_optimizer(optimizer, model, accumulation)

    def start(self, state):
        self.optimizer = state.optimizer

    def synchronize_gradients(self, optimizer, step):
        """After step ``step``'s backward passes (from 1): the gradients to apply; False: none this step."""
        self.backend.synchronize(optimizer)
        return True

    def step(self, optimizer, scaler=None):
        self.backend.step(optimizer, scaler)

    def after_step(self, step):
        """The exchange due at the end of step ``step``; True when the ranks hold one model now (always here)."""
        return True

    def may_save(self, step, **when):
        """Whether a checkpoint may be saved now (``when``: the save's reasons); always here."""
        return True

    def align_replicas(self, step):
        """Before an evaluation or an epoch's end: every rank holds one model after it (here always does)."""

    def settle(self, step, stopped):
        """The end of training, or a stop: no exchange left pending (here none ever is)."""

    def checkpoint_tensors(self):
        return {}

    def restore_tensors(self, tensors):
        pass

    def describe(self):
        return "comm.mode sync"


class SelfAveraging(Sync):
    """The modes that average themselves: the plain optimizer, no hooks that average every step (Horovod's would)."""

    def __init__(self, backend, model, cfg):
        super().__init__(backend, model, cfg)
        self._params = [p for p in model.parameters()]
        self._names = {id(p): n for n, p in model.named_parameters()}

    def wrap_optimizer(self, optimizer, model, accumulation):
        return optimizer

    def step(self, optimizer, scaler=None):
        # Not the backend's step: the plain optimizer has no Horovod skip_synchronize.
        step_optimizer(optimizer, scaler)

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
