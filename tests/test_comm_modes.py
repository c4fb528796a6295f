"""``comm.mode`` without MPI: the validation of ``[comm]`` and the outer optimizer's arithmetic
(a one-rank stand-in backend whose average is the tensor itself)."""
from types import SimpleNamespace

import pytest
import torch

from hpctrain.config import load_config, validate
from hpctrain.errors import ConfigError
from hpctrain.runtime.replicas import ReplicasDiverged
from hpctrain.training import comm_modes
from hpctrain.training.local_sgd import check_replicas


def check(*overrides, cuda=False):
    return validate(load_config(None, ["data.path=x.h5", *overrides]), world_size=2, cuda=cuda)


def test_defaults_are_sync_and_valid():
    cfg = check()
    assert cfg.comm.mode == "sync" and cfg.comm.sync_every == 1 and cfg.comm.outer_optimizer == "none"


@pytest.mark.parametrize("overrides, text, hint", [
    (["comm.mode=async"], "comm.mode = 'async' is not one of sync, local_sgd, stale", "comm.mode"),
    (["comm.mode=local_sgd", "comm.sync_every=0"], "comm.sync_every = 0 must be >= 1", "comm.sync_every=16"),
    (["comm.mode=local_sgd", "comm.sync_warmup=-1"], "comm.sync_warmup = -1 must be >= 0", "sync_warmup=100"),
    (["comm.sync_every=8"], 'comm.sync_every = 8 is only used with comm.mode = "local_sgd"', "comm.mode=local_sgd"),
    (["comm.mode=stale", "comm.outer_optimizer=nesterov"], "comm.outer_optimizer = 'nesterov' is only used",
     "comm.mode=local_sgd"),
    (["comm.mode=local_sgd", "comm.outer_optimizer=adam"], "comm.outer_optimizer = 'adam' is not one of none, nesterov",
     "comm.outer_optimizer"),
    (["comm.mode=local_sgd", "comm.outer_momentum=0.9"], 'comm.outer_optimizer = "none"', "outer_optimizer=nesterov"),
    (["comm.mode=local_sgd", "comm.outer_optimizer=nesterov", "comm.outer_momentum=1.0"],
     "comm.outer_momentum = 1.0 must be in [0, 1)", "0.9"),
    (["comm.mode=local_sgd", "comm.outer_optimizer=nesterov", "comm.outer_lr=0"], "comm.outer_lr = 0.0 must be > 0",
     "outer_lr=0.7"),
    (["comm.mode=local_sgd", "comm.sync_every=8", "checkpoint.every_steps=12"],
     "checkpoint.every_steps = 12 is not a multiple of comm.sync_every = 8", "checkpoint.every_steps=8"),
    (["comm.mode=local_sgd", "comm.sync_every=8", "monitor.consistency_every=4"],
     "monitor.consistency_every = 4 is not a multiple", "monitor.consistency_every=8"),
])
def test_bad_comm_settings_name_the_key_and_the_fix(overrides, text, hint):
    with pytest.raises(ConfigError) as err:
        check(*overrides)
    assert text in str(err.value) and hint in err.value.hint


@pytest.mark.parametrize("mode", ["local_sgd", "stale"])
def test_fp16_with_a_grad_scaler_is_refused(mode):
    with pytest.raises(ConfigError, match="does not support train.precision") as err:
        check(f"comm.mode={mode}", "train.precision=fp16", cuda=True)
    assert "bf16" in err.value.hint


def test_stale_with_accumulation_and_local_sgd_with_aligned_intervals_are_valid():
    check("comm.mode=stale", "train.accumulation=4", "comm.compression=fp16")
    check("comm.mode=local_sgd", "comm.sync_every=16", "checkpoint.every_steps=64", "train.eval_every=32",
          "comm.outer_optimizer=nesterov", "comm.outer_lr=0.7", "comm.outer_momentum=0.9")


class OneRank:
    """The backend interface of a one-rank job (the average of one tensor is itself)."""

    compression = "none"
    size = 1
    rank = 0

    class world:  # noqa: N801 - the attribute the mode reads
        class comm:  # noqa: N801
            @staticmethod
            def Get_size():
                return 1

    def start_average(self, flat, compress=True, name=None):
        return flat

    def wait_average(self, handle):
        return handle

    def average(self, flat, compress=True):
        return flat


def started(optimizer):
    """What ``mode.start`` reads of a TrainState at step 0."""
    return SimpleNamespace(optimizer=optimizer, progress=SimpleNamespace(step=0))


def test_nesterov_outer_step_follows_slowmo():
    cfg = check("comm.mode=local_sgd", "comm.sync_every=2", "comm.outer_optimizer=nesterov", "comm.outer_lr=0.5",
                "comm.outer_momentum=0.9").comm
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mode = comm_modes.build(cfg, OneRank(), model)

    mode.start(started(opt))
    expected, m = 1.0, 0.0
    for step in range(1, 5):
        model.weight.grad = torch.full_like(model.weight, 0.25)  # each local step moves -0.25
        assert mode.synchronize_gradients(opt, step) is True
        mode.step(opt)
        synced = mode.after_step(step)
        assert synced == (step % 2 == 0)
        if synced:
            delta = 0.5  # two local steps since the anchor
            m = 0.9 * m + delta
            expected -= 0.5 * (delta + 0.9 * m)
            assert model.weight.item() == pytest.approx(expected)
    saved = mode.checkpoint_tensors()
    assert list(saved) == ["outer_momentum/weight"] and saved["outer_momentum/weight"].item() == pytest.approx(m)


def test_local_sgd_leaves_out_a_local_step_with_non_finite_gradients_on_this_rank_alone():
    cfg = check("comm.mode=local_sgd", "comm.sync_every=4").comm
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = comm_modes.build(cfg, OneRank(), model)

    mode.start(started(opt))
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    # no collective to agree on it: the trainer sees nothing to apply, so its policy never runs
    assert mode.synchronize_gradients(opt, 1) is False and mode.local_skips == 1
    assert mode.may_save(1) is False  # not a synchronisation point


def test_a_replica_that_differs_after_an_average_is_named_on_every_rank():
    from hpctrain.runtime.replicas import model_fingerprints

    model = torch.nn.Linear(2, 2)
    mine = model_fingerprints(model)
    other = [(s + 1, c) for s, c in mine]

    class ThreeRanks:  # what allgather hands every rank: rank 2 differs
        @staticmethod
        def Get_size():
            return 3

        @staticmethod
        def allgather(value):  # (job rank, fingerprints) of every rank
            return [(0, mine), (1, mine), (2, other)]

    with pytest.raises(ReplicasDiverged, match=r"after the parameter average of step 8, ranks 2 hold "
                                                          r"parameters that differ from rank 0's \(first differing: "
                                                          r"weight\)") as err:
        check_replicas(model, ThreeRanks, "the parameter average of step 8")
    assert err.value.collective  # raised alike on every rank: no abort, no hang
