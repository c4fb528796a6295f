"""Flat buffers: many tensors as consecutive pieces of one 1-D tensor, so that one collective (or one copy)
moves them all; and the bytes of one buffer broadcast in pieces that MPI's int counts can hold.

>>> import torch
>>> flat = torch.arange(5.)
>>> [v.tolist() for v in views(flat, [torch.empty(2), torch.empty(1, 3)])]
[[0.0, 1.0], [[2.0, 3.0, 4.0]]]
"""


def views(flat, tensors):
    """Consecutive pieces of ``flat`` shaped like ``tensors`` (views: writing them writes ``flat``)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        yield flat[offset:offset + n].view(t.shape)
        offset += n


BCAST_BYTES = 1 << 30  # MPI counts are C ints: a broadcast moves at most this many bytes at a time


def bcast_bytes(array, root, comm):
    """Broadcast the bytes of the C-contiguous numpy ``array`` from ``root``, in place."""
    from mpi4py import MPI

    flat = array.reshape(-1).view("uint8")
    for start in range(0, flat.nbytes, BCAST_BYTES):
        comm.Bcast([flat[start:start + BCAST_BYTES], MPI.BYTE], root=root)
