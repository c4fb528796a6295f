"""Are the data-parallel replicas still one model? A cheap, exact fingerprint per tensor, the rule that names
the ranks that differ, and the one collective check built on them: before every checkpoint save
(``checkpoint.consistency``), after every ``local_sgd`` average, and (gathered to rank 0 only) in the
monitor's periodic check."""
import numpy as np

from ..errors import HpctrainError

SAMPLE = 4096  # elements per tensor that enter the fingerprint's CRC


def tensor_fingerprint(tensor):
    """``(sum, crc)`` of one tensor, cheap and exact: the sum of its raw bytes read as int32 words with
    wrapping addition (so it depends neither on summation order nor on the thread count, and NaNs compare
    equal) sees every element; the CRC of a strided sample catches changes that keep the sum. One vectorised
    pass, no copy, and on a GPU only the sample leaves the device."""
    import zlib

    import torch

    with torch.no_grad():
        flat = tensor.detach().reshape(-1).contiguous()
        if flat.numel() == 0:
            return (0, 0)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        raw = flat.view(torch.uint8) if flat.element_size() > 1 else flat.to(torch.uint8)
        try:
            total = int(torch.sum(raw.view(torch.int32), dtype=torch.int32))
        except RuntimeError:  # not a whole number of aligned words: sum the bytes instead
            total = int(torch.sum(raw, dtype=torch.int64))
        sample = raw[::max(1, raw.numel() // SAMPLE)].contiguous().cpu().numpy()
    return (total, zlib.crc32(sample))


def model_fingerprints(model):
    """One fingerprint per tensor of ``model.state_dict()``, in its order."""
    return [tensor_fingerprint(t) for t in model.state_dict().values()]


def parameter_fingerprints(model):
    """One fingerprint per parameter, in ``model.parameters()`` order (the monitor's check)."""
    return [tensor_fingerprint(p) for p in model.parameters()]


def divergent_ranks(fingerprints):
    """``(reference_ranks, divergent_ranks)`` from one fingerprint (any comparable value) per rank: the
    largest group of equal values is the reference (ties: the group of rank 0); every other rank diverged."""
    groups = {}
    for rank, value in enumerate(fingerprints):
        key = tuple(map(tuple, value)) if isinstance(value, (list, np.ndarray)) else value
        groups.setdefault(key, []).append(rank)
    reference = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    return reference, sorted(r for ranks in groups.values() if ranks is not reference for r in ranks)


def first_difference(names, mine, theirs):
    """The name of the first tensor whose fingerprints differ, or None."""
    return next((n for n, a, b in zip(names, mine, theirs) if a != b), None)


class ReplicasDiverged(HpctrainError):
    """The ranks that should hold one model hold tensors that are not bitwise equal."""


def compare_replicas(model, comm):
    """Collective over ``comm``, whose ranks hold replicas of one model (or of one part of it): None when
    every rank's ``state_dict()`` tensors are bitwise equal, else ``(reference, diverged, first)``: the index
    in ``comm`` of a rank of the largest group of equal ranks, the job ranks (``MPI.COMM_WORLD``) that differ
    from it and its own job rank, and the name of the first tensor that differs."""
    if comm.Get_size() == 1:
        return None
    from mpi4py import MPI

    job_ranks, prints = zip(*comm.allgather((MPI.COMM_WORLD.Get_rank(), model_fingerprints(model))))
    reference, diverged = divergent_ranks(prints)
    if not diverged:
        return None
    first = first_difference(list(model.state_dict()), prints[reference[0]], prints[diverged[0]])
    return reference[0], ([job_ranks[r] for r in diverged], job_ranks[reference[0]]), first


def copy_replica(model, comm, root):
    """Collective: every rank's ``state_dict()`` tensors become rank ``root``'s, byte for byte."""
    import torch

    from .flat import bcast_bytes

    with torch.no_grad():
        for tensor in model.state_dict().values():
            host = tensor.detach().cpu().contiguous()
            bcast_bytes(host.reshape(-1).view(torch.uint8).numpy(), root, comm)
            if host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)
