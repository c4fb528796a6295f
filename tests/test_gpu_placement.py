"""Which ranks share a GPU, and the error that NCCL's one-rank-per-GPU rule gets (pure
logic; tests/test_gpu.py runs the real refusal on a GPU)."""
from hpctrain.backends.horovod_backend import nccl_sharing_error, ranks_sharing_a_gpu


def test_one_rank_per_gpu_shares_nothing():
    # Slurm's per-task GPU binding: every rank sees its own GPU as cuda:0, told apart by UUID.
    placements = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n2", "GPU-b")]
    assert ranks_sharing_a_gpu(placements) == []


def test_ranks_on_one_gpu_of_a_node_are_grouped():
    placements = [("n1", "GPU-a"), ("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n1", "GPU-b")]
    assert ranks_sharing_a_gpu(placements) == [[0, 1], [2, 4]]


def test_the_error_names_the_ranks_the_node_and_both_fixes():
    error = nccl_sharing_error([[0, 1], [2, 4]], ["n1", "n1", "n1", "n2", "n1"])
    text = str(error)
    assert "ranks 0, 1 on n1; ranks 2, 4 on n1" in text and "NCCL" in text
    assert "one rank per GPU" in error.hint and 'comm.backend = "mpi"' in error.hint


class _Comm:
    def __init__(self, placements):
        self.placements = placements

    def allgather(self, mine):
        return self.placements


class _Hvd:
    def __init__(self, nccl):
        self.nccl = nccl

    def nccl_built(self):
        return self.nccl


def _world(device, placements):
    from hpctrain.runtime.world import World

    return World(1, len(placements), 1, len(placements), "n1", "mpirun", _Comm(placements), device)


def test_the_refusal_is_only_for_nccl_on_shared_gpus():
    import pytest

    from hpctrain.backends.horovod_backend import refuse_shared_gpus
    from hpctrain.errors import ConfigError

    shared = [("n1", "GPU-a"), ("n1", "GPU-a")]
    with pytest.raises(ConfigError, match="ranks 0, 1 on n1"):
        refuse_shared_gpus(_Hvd(True), _world("cuda:0", shared), identity=lambda device: "GPU-a")
    # Not NCCL (a Horovod built without it), or CPU ranks, or one GPU each: nothing to refuse.
    refuse_shared_gpus(_Hvd(False), _world("cuda:0", shared), identity=lambda device: "GPU-a")
    refuse_shared_gpus(_Hvd(True), _world("cpu", shared), identity=lambda device: "GPU-a")
    refuse_shared_gpus(_Hvd(True), _world("cuda:0", [("n1", "GPU-a"), ("n1", "GPU-b")]),
                       identity=lambda device: "GPU-a")
