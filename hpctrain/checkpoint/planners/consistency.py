"""Whether the ranks that hold copies of one model (or of one part of it) still hold the same values, checked
before a checkpoint is written (``checkpoint.consistency``)."""
import logging

from ...errors import CheckpointError
from ...runtime.coordination import everywhere
from ...runtime.replicas import compare_replicas, copy_replica

log = logging.getLogger("hpctrain.checkpoint")


def check_consistency(model, comm, mode="check"):
    """Collective: compare fingerprints of every rank's model tensors (the ranks of ``comm`` hold replicas of
    one model, or of one part of it). ``"check"``: raise CheckpointError naming the ranks that diverged;
    ``"repair"``: copy the tensors of the largest group of equal ranks to the others (with a warning);
    ``"off"``: do nothing."""
    found = None if mode == "off" else compare_replicas(model, comm)
    if found is None:
        return
    root, (diverged, source), first = found
    ranks = ", ".join(map(str, diverged))
    if mode == "repair":
        if comm.Get_rank() == 0:
            log.warning("ranks %s hold model tensors that differ from rank %d's (first: %s); copying "
                        "rank %d's to every rank (checkpoint.consistency=repair)", ranks, source, first, source)
        copy_replica(model, comm, root)
        return
    raise everywhere(CheckpointError(
        f"ranks {ranks} hold model tensors that differ from rank {source}'s (first differing: {first}); "
        f"the replicas have diverged, so no checkpoint was written",
        hint="look for rank-dependent code in the model or a missed broadcast of the initial "
             "parameters; checkpoint.consistency=repair copies one replica's parameters to the others"))
