"""Flat buffers: many tensors as consecutive pieces of one 1-D tensor, so that one
collective (or one copy) moves them all.

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
