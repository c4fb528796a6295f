"""Tensor parallelism: linear layers whose weights are split across the ranks of a sub-communicator
(``grid.tp_comm``), and the MLP and self-attention blocks built from them.

* :class:`ColumnParallelLinear` keeps rows ``[r*k, (r+1)*k)`` of the weight (output features): the input
  is the same on every rank, the output is this rank's slice.
* :class:`RowParallelLinear` keeps columns of the weight (input features): it takes a sliced input and
  all-reduces the partial products into the full output.

Column then row needs one all-reduce forward and one backward per block; the collectives are autograd
Functions, so ``loss.backward()`` does the right thing. The dense blocks (:mod:`hpctrain.models.blocks`)
have the same parameter names and shapes as their split versions, so a model written with them can be
trained in one process, split with :func:`tensor_parallelize`, and checkpointed either way::

    block = MLPBlock(64, 256)                           # dense, e.g. built on every rank with one seed
    par = ParallelMLP.from_dense(block, grid.tp_comm)   # this rank's quarter of fc1 and fc2
    y = par(x)                                          # x, y: the same on every tensor rank
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..models.blocks import MLPBlock, SelfAttention

# ---------------------------------------------------------------- collectives on tensors

_REDUCIBLE = (torch.float32, torch.float64)


def _host(t):
    """A contiguous CPU copy of ``t`` in a dtype MPI can sum (numpy has no bfloat16)."""
    work = t.detach() if t.dtype in _REDUCIBLE else t.detach().float()
    # Always a private copy: MPI writes into it in place.
    return work.to("cpu", copy=True).contiguous()


def allreduce_sum(t, comm):
    """Sum of ``t`` over ``comm`` as a new tensor (same dtype and device as ``t``)."""
    if comm.Get_size() == 1:
        return t.clone()
    from mpi4py import MPI

    host = _host(t)
    comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
    return host.to(dtype=t.dtype, device=t.device)


def allgather_last(t, comm):
    """Concatenation along the last dimension of every rank's ``t`` (equal shapes)."""
    size = comm.Get_size()
    if size == 1:
        return t.clone()
    host = _host(t)
    out = torch.empty((size,) + tuple(host.shape), dtype=host.dtype)
    comm.Allgather(host.numpy(), out.numpy())
    return torch.cat(list(out.unbind(0)), dim=-1).to(dtype=t.dtype, device=t.device)


def own_chunk_last(t, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    k = t.shape[-1] // size
    return t[..., rank * k:(rank + 1) * k].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradients of every tensor rank (each
    rank's slice of the next layer contributed a part of it)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return allreduce_sum(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum the partial outputs. Backward: identity (every rank needs the full grad)."""

    @staticmethod
    def forward(ctx, x, comm):
        return allreduce_sum(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: concatenate the slices along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return allgather_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return own_chunk_last(grad, ctx.comm), None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: gather the slices."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return own_chunk_last(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return allgather_last(grad, ctx.comm), None


copy_to_tp, reduce_from_tp = _CopyToTP.apply, _ReduceFromTP.apply
gather_from_tp, scatter_to_tp = _GatherFromTP.apply, _ScatterToTP.apply


# ---------------------------------------------------------------- layers

def _split(n, comm, what):
    size = comm.Get_size()
    if n % size:
        raise ConfigError(f"{what} is {n}, which does not split evenly over {size} tensor-parallel ranks",
                          hint=f"choose parallel.tensor among the divisors of {n}, or change the layer width")
    return n // size


class _TensorParallel(nn.Module):
    """Base of the split layers. ``tp_shards``: parameter name -> dimension split across the
    tensor ranks (absent: replicated). Checkpoints use it to store global tensors."""

    tp_shards = {}

    def __init__(self, comm):
        super().__init__()
        self.comm, self.tp_size, self.tp_rank = comm, comm.Get_size(), comm.Get_rank()

    def extra_repr(self):
        return f"tensor rank {self.tp_rank} of {self.tp_size}"


class ColumnParallelLinear(_TensorParallel):
    """``y = x W^T + b`` with the rows of ``W`` (and ``b``) split across ``comm``. ``gather_output=False``
    (usual, before a :class:`RowParallelLinear`) leaves each rank its slice of ``y``'s last dimension."""

    tp_shards = {"weight": 0, "bias": 0}

    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False, dense=None):
        super().__init__(comm)
        local = _split(out_features, comm, "the output width of a column-parallel linear layer")
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        # Slice a dense layer seeded alike on every rank: the split model equals the dense one from that seed.
        dense = nn.Linear(in_features, out_features, bias=bias) if dense is None else dense
        rows = slice(self.tp_rank * local, (self.tp_rank + 1) * local)
        self.weight = nn.Parameter(dense.weight.detach()[rows].clone())
        self.bias = nn.Parameter(dense.bias.detach()[rows].clone()) if dense.bias is not None else None

    @classmethod
    def from_dense(cls, linear, comm, gather_output=False):
        return cls(linear.in_features, linear.out_features, comm, linear.bias is not None, gather_output, linear)

    def forward(self, x):
        y = F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y


class RowParallelLinear(_TensorParallel):
    """``y = x W^T + b`` with the columns of ``W`` split across ``comm``; ``b`` is replicated
    and added once, after the all-reduce. ``input_is_parallel=False`` slices a full input."""

    tp_shards = {"weight": 1}

    def __init__(self, in_features, out_features, comm, bias=True, input_is_parallel=True, dense=None):
        super().__init__(comm)
        local = _split(in_features, comm, "the input width of a row-parallel linear layer")
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        dense = nn.Linear(in_features, out_features, bias=bias) if dense is None else dense
        cols = slice(self.tp_rank * local, (self.tp_rank + 1) * local)
        self.weight = nn.Parameter(dense.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None

    @classmethod
    def from_dense(cls, linear, comm, input_is_parallel=True):
        return cls(linear.in_features, linear.out_features, comm, linear.bias is not None, input_is_parallel, linear)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.comm)
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- blocks

class ParallelMLP(nn.Module):
    """:class:`MLPBlock` with ``fc1`` column-parallel and ``fc2`` row-parallel."""

    def __init__(self, width, hidden, comm, dense=None):
        super().__init__()
        dense = MLPBlock(width, hidden) if dense is None else dense
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, comm)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, comm)

    @classmethod
    def from_dense(cls, block, comm):
        return cls(block.fc1.in_features, block.fc1.out_features, comm, block)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ParallelSelfAttention(SelfAttention):
    """:class:`SelfAttention` with the heads split across ``comm``: q, k, v projections are
    column-parallel (each rank computes its heads), the output projection row-parallel."""

    def __init__(self, width, heads, comm, causal=False, dense=None):
        nn.Module.__init__(self)
        dense = SelfAttention(width, heads, causal) if dense is None else dense
        self.width, self.heads, self.causal = width, heads, causal
        self.comm, self.local_heads = comm, _split(heads, comm, "the number of attention heads")
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ColumnParallelLinear.from_dense(getattr(dense, name), comm))
        self.out_proj = RowParallelLinear.from_dense(dense.out_proj, comm)

    @classmethod
    def from_dense(cls, block, comm):
        return cls(block.width, block.heads, comm, block.causal, block)

    def forward(self, x):
        # One backward all-reduce for x's gradient instead of one per projection.
        x = copy_to_tp(x, self.comm)
        q, k, v = (F.linear(x, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(self._attend(q, k, v, self.local_heads))


_PARALLEL_OF = {MLPBlock: ParallelMLP, SelfAttention: ParallelSelfAttention}


def tensor_parallelize(module, comm):
    """Split each :class:`MLPBlock` and :class:`SelfAttention` in ``module`` (or ``module`` itself) over
    ``comm``, keeping parameter names; returns the module to use (as is with one tensor rank)."""
    if comm.Get_size() == 1:
        return module
    kind = _PARALLEL_OF.get(type(module))
    if kind is not None:
        return kind.from_dense(module, comm)
    for name, child in list(module.named_children()):
        replaced = tensor_parallelize(child, comm)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def shard_dims(module):
    """``{parameter name: (dim, tensor rank, tensor size)}`` for every split parameter of
    ``module``; parameters not listed are the same on every tensor rank."""
    out = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, _TensorParallel):
            for pname, dim in sub.tp_shards.items():
                if getattr(sub, pname, None) is not None:
                    out[f"{prefix}.{pname}" if prefix else pname] = (dim, sub.tp_rank, sub.tp_size)
    return out

