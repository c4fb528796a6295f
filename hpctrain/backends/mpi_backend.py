"""mpi4py backend: gradients copied into a few fused flat buffers, compressed (:mod:`.compression`), summed
with ``MPI_Allreduce`` on numpy views, averaged. Simpler than Horovod: the all-reduce starts after the last
backward pass, not overlapping it. Needs nothing beyond mpi4py, so it runs wherever hpctrain does."""
import warnings

import numpy as np

from .compression import get_compressor
from ..runtime.flat import views
from .base import Backend, allgather_in_place

# Bytes per fused buffer: few enough calls that latency does not dominate, small enough
# that the extra copy does not double peak memory for a large model.
FUSION_BYTES = 64 * 2 ** 20


def _fp16_sum(inbuf, inoutbuf, datatype):
    # MPI has no float16 type: the buffers travel as 16-bit integers, summed here as float16. torch, not
    # numpy: numpy's float16 arithmetic is scalar code, ~40x slower, and this runs on every received segment.
    import torch

    b = np.frombuffer(inoutbuf, dtype=np.float16)
    if not b.size:
        return
    a = np.frombuffer(inbuf, dtype=np.float16)
    with warnings.catch_warnings():  # a read-only inbuf is fine: it is only read
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(b).add_(torch.from_numpy(a))  # overflow gives inf (a GradScaler skips the step)


class _GradientBuckets:
    """The fused buffers of :meth:`MPIBackend.synchronize`: the parameters, in order, in buckets of
    one dtype and at most ``limit`` bytes, each summed in one all-reduce of buffers kept between steps."""

    def __init__(self, params, limit):
        self.buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and (p.dtype != current[0].dtype or size + nbytes > limit):
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._flat = [{} for _ in self.buckets]  # per bucket: its persistent fused buffers

    def reduce(self, backend):
        import torch

        with torch.no_grad():
            for i, bucket in enumerate(self.buckets):
                self._reduce_bucket(i, bucket, backend)

    def _buffer(self, i, kind, numel, dtype, device):
        # Allocated once: a fresh buffer every step costs more in page faults than the
        # copy itself (large CPU allocations go straight back to the OS).
        import torch

        buf = self._flat[i].get(kind)
        if buf is None:
            buf = self._flat[i][kind] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def _reduce_bucket(self, i, bucket, backend):
        import torch

        numel = sum(p.numel() for p in bucket)
        flat = self._buffer(i, "flat", numel, bucket[0].dtype, bucket[0].device)
        # fp16 compression is a cast: done while copying the gradients in (and out), into
        # a persistent half-size buffer, instead of in extra passes that allocate.
        cast = backend.compressor.name == "fp16" and flat.dtype.is_floating_point and flat.dtype != torch.float16
        wire = self._buffer(i, "wire", numel, torch.float16, flat.device) if cast else flat
        for p, chunk in zip(bucket, views(wire, bucket)):
            if p.grad is None:
                chunk.zero_()
            elif backend.gradient_predivide_factor != 1.0:
                torch.div(p.grad, backend.gradient_predivide_factor, out=chunk)
            else:
                chunk.copy_(p.grad)
        wire, ctx = (wire, None) if cast else backend.compressor.compress(flat)
        host = wire.cpu()
        backend._allreduce_sum(host)
        if host is not wire:
            wire.copy_(host)
        if cast:
            flat.copy_(wire)
        else:
            flat = backend.compressor.decompress(wire, ctx)
        flat.div_(backend.size / backend.gradient_predivide_factor)
        # The gradients become views of the reduced buffer, not copies (as DDP's gradient_as_bucket_view);
        # zero_grad() drops the views, and the next backward pass makes fresh gradients, copied in above.
        for p, chunk in zip(bucket, views(flat, bucket)):
            p.grad = chunk


class MPIBackend(Backend):
    name = "mpi"

    def __init__(self, world, compression="none", gradient_predivide_factor=1.0):
        super().__init__(world, compression, gradient_predivide_factor)
        from mpi4py import MPI

        self.MPI, self.comm = MPI, world.comm
        self.compressor = get_compressor(compression)
        self._fp16_op = None
        self._gradients = _GradientBuckets([], FUSION_BYTES)

    # ---- gradients
    def distributed_optimizer(self, optimizer, model, accumulation=1):
        # Gradients are summed locally by autograd between steps; synchronize() averages
        # them across ranks once per step, so accumulation needs nothing more here.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._gradients = _GradientBuckets(params, FUSION_BYTES)
        return optimizer

    def broadcast_state(self, model, optimizer, root=0):
        for tensor in model.state_dict().values():
            self.broadcast_tensor(tensor, root)
        state = self.comm.bcast(optimizer.state_dict() if self.rank == root else None, root=root)
        if self.rank != root:
            optimizer.load_state_dict(state)

    def synchronize(self, optimizer):
        self._gradients.reduce(self)

    def _fp16(self, *tensors):
        """MPI has no float16: the op that sums as float16 (made once, freed in close), then the tensors as int16."""
        import torch

        if self._fp16_op is None:
            self._fp16_op = self.MPI.Op.Create(_fp16_sum, commute=True)
        return [self._fp16_op] + [[t.view(torch.int16).numpy(), self.MPI.INT16_T] for t in tensors]

    def _allreduce_sum(self, tensor):
        import torch

        MPI = self.MPI
        op, array = self._fp16(tensor) if tensor.dtype == torch.float16 else (MPI.SUM, tensor.numpy())
        self.comm.Allreduce(MPI.IN_PLACE, array, op=op)

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
        if getattr(self, "_average_comm", None) is not None:  # comm.mode local_sgd/stale, comm.shard
            self._average_comm.Free()
            self._average_comm = None

    # ---- averaging of flat buffers (comm.mode local_sgd and stale)
    def start_average(self, flat, compress=True, name=None):
        import torch

        MPI = self.MPI
        if getattr(self, "_average_comm", None) is None:
            # Its own communicator: an average in flight never meets the other collectives.
            self._average_comm = self.comm.Dup()
        cast = (compress and self.compressor.name == "fp16" and flat.dtype.is_floating_point
                and flat.dtype != torch.float16)
        wire = flat.to(torch.float16) if cast else flat
        host = wire.cpu()
        op, array = self._fp16(host) if host.dtype == torch.float16 else (MPI.SUM, host.numpy())
        request = self._average_comm.Iallreduce(MPI.IN_PLACE, array, op=op)
        # Open MPI moves the data mostly inside Wait: the overlap is smaller than Horovod's.
        return request, host, wire, flat

    def wait_average(self, handle):
        request, host, wire, flat = handle
        request.Wait()
        if host is not wire:
            wire.copy_(host)
        if wire is not flat:
            flat.copy_(wire)
        flat.div_(self.size)
        return flat

    # ---- sharded training (comm.shard, hpctrain.training.sharding)
    def reduce_scatter_mean(self, flat, counts):
        # MPI_Reduce_scatter takes a count per rank, so uneven parts need no padding.
        import torch

        MPI = self.MPI
        f = self.gradient_predivide_factor
        fp16 = self.compressor.name == "fp16"
        wire = flat / f if f != 1.0 else flat  # divided before the cast: the fp16 range
        if fp16:
            wire = wire.to(torch.float16)
        host = wire.detach().cpu().contiguous()
        out = torch.empty(counts[self.rank], dtype=host.dtype)
        op, send, receive = self._fp16(host, out) if fp16 else (MPI.SUM, host.numpy(), out.numpy())
        self.comm.Reduce_scatter(send, receive, recvcounts=list(counts), op=op)
        return out.to(device=flat.device, dtype=flat.dtype).div_(self.size / f)

    def allgather_flat(self, flat, counts):
        # The parameters' flat buffer is float32 (hpctrain.training.sharding checks it).
        allgather_in_place(self.comm, flat, counts)

    def broadcast_tensor(self, tensor, root=0):
        import torch

        host = tensor.detach().cpu().contiguous()  # the same memory when already so
        # As raw bytes: numpy has no bfloat16, and MPI need not know the type to copy it.
        self.comm.Bcast(host.reshape(-1).view(torch.uint8).numpy(), root=root)
        if host.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(host)
