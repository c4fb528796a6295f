"""mpi4py backend: gradients copied into a few fused flat buffers, compressed
(:mod:`hpctrain.compression`), summed with ``MPI_Allreduce`` on numpy views, averaged.

Simpler than Horovod: the all-reduce starts after the last backward pass instead of
overlapping with it. Needs nothing beyond mpi4py, so it runs wherever hpctrain does.
"""
import numpy as np

from ..compression import get_compressor
from .base import Backend

# Bytes per fused buffer: few enough calls that latency does not dominate, small enough
# that the extra copy does not double peak memory for a large model.
FUSION_BYTES = 64 * 2 ** 20


def _fp16_sum(inbuf, inoutbuf, datatype):
    # MPI has no float16 type: the buffers travel as 16-bit integers, summed here as float16.
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    with np.errstate(over="ignore"):  # inf is the answer then (a GradScaler skips the step)
        np.add(a, b, out=b)


def _buckets(params, limit):
    """Group parameters (in order) into lists of equal dtype and at most ``limit`` bytes."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (p.dtype != current[0].dtype or size + nbytes > limit):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class MPIBackend(Backend):
    name = "mpi"

    def __init__(self, world, compression="none", gradient_predivide_factor=1.0):
        super().__init__(world, compression, gradient_predivide_factor)
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = world.comm
        self.compressor = get_compressor(compression)
        self._fp16_op = None
        self._buckets = []

    # ---- gradients
    def distributed_optimizer(self, optimizer, model, accumulation=1):
        # Gradients are summed locally by autograd between steps; synchronize() averages
        # them across ranks once per step, so accumulation needs nothing more here.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._buckets = _buckets(params, FUSION_BYTES)
        return optimizer

    def broadcast_state(self, model, optimizer, root=0):
        import torch

        for tensor in model.state_dict().values():
            host = tensor.detach().cpu().contiguous()  # the same memory when already so
            # As raw bytes: numpy has no bfloat16, and MPI need not know the type to copy it.
            self.comm.Bcast(host.reshape(-1).view(torch.uint8).numpy(), root=root)
            if host.data_ptr() != tensor.data_ptr():
                tensor.detach().copy_(host)
        state = self.comm.bcast(optimizer.state_dict() if self.rank == root else None, root=root)
        if self.rank != root:
            optimizer.load_state_dict(state)

    def synchronize(self, optimizer):
        import torch

        for bucket in self._buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.detach().reshape(-1) for g in grads])
            if self.gradient_predivide_factor != 1.0:
                flat.div_(self.gradient_predivide_factor)
            wire, ctx = self.compressor.compress(flat)
            wire = wire.cpu()
            self._allreduce_sum(wire)
            flat = self.compressor.decompress(wire.to(flat.device), ctx)
            flat.div_(self.size / self.gradient_predivide_factor)
            offset = 0
            for p in bucket:
                n = p.numel()
                chunk = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += n

    def _allreduce_sum(self, tensor):
        import torch

        MPI = self.MPI
        if tensor.dtype == torch.float16:
            if self._fp16_op is None:
                self._fp16_op = MPI.Op.Create(_fp16_sum, commute=True)
            array = tensor.view(torch.int16).numpy()
            self.comm.Allreduce(MPI.IN_PLACE, [array, MPI.INT16_T], op=self._fp16_op)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)

    def step(self, optimizer, scaler=None):
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    # ---- small collectives
    def allreduce_mean(self, value):
        import torch

        if isinstance(value, torch.Tensor):
            array = value.detach().cpu().to(torch.float64).numpy().copy()
            self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)
            return torch.from_numpy(array / self.size).to(dtype=value.dtype, device=value.device)
        return self.comm.allreduce(float(value), op=self.MPI.SUM) / self.size

    def broadcast_object(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        if self._fp16_op is not None:
            self._fp16_op.Free()
            self._fp16_op = None
