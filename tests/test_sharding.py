"""Pure logic of comm.shard: how the flat parameter buffer is cut into rank slices, which
rows of each parameter a rank holds, and the configuration checks."""
import math

import pytest

from hpctrain.config import TrainConfig, validate
from hpctrain.errors import ConfigError
from hpctrain.training.sharding import ShardedOptimizer, pieces_of, shard_bounds

SHAPES = [(24, 8), (24,), (24, 24), (24,), (4, 24), (4,)]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7, 64])
def test_slices_cover_everything_on_row_boundaries_balanced_within_a_row(nranks):
    bounds = shard_bounds(SHAPES, nranks)
    total = sum(math.prod(s) for s in SHAPES)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in rank order
    offsets = [sum(math.prod(s) for s in SHAPES[:i]) for i in range(len(SHAPES))]
    widest = max(math.prod(s[1:]) for s in SHAPES)
    for lo, hi in bounds:
        assert hi >= lo
        assert hi - lo <= total / nranks + widest  # balanced within one row
        for cut in (lo, hi):  # every cut is a row boundary of the parameter it falls in
            for off, shape in zip(offsets, SHAPES):
                if off < cut < off + math.prod(shape):
                    assert (cut - off) % math.prod(shape[1:]) == 0


def test_pieces_of_a_parameter_are_row_blocks_in_rank_order():
    bounds = shard_bounds([(4, 3), (5,)], 2)
    assert bounds == [(0, 9), (9, 17)]
    assert pieces_of(0, (4, 3), bounds) == [(0, 0, 3, 0), (1, 3, 4, 0)]
    assert pieces_of(12, (5,), bounds) == [(1, 0, 5, 3)]


def test_more_ranks_than_rows_leaves_empty_slices():
    bounds = shard_bounds([(2,)], 4)
    assert sum(b - a for a, b in bounds) == 2
    assert [r for r, *_ in pieces_of(0, (2,), bounds)] == [1, 3]


def _cfg(**train):
    cfg = TrainConfig()
    cfg.data.path = "x.h5"
    for key, value in train.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_config_shard_choices_and_clip():
    assert validate(_cfg(comm__shard="gradients")).comm.shard == "gradients"
    with pytest.raises(ConfigError, match="(?s)comm.shard = 'optimiser'.*did you mean comm.shard = 'optimizer'"):
        validate(_cfg(comm__shard="optimiser"))
    with pytest.raises(ConfigError, match="train.clip_grad_norm = -1.0 must be >= 0"):
        validate(_cfg(train__clip_grad_norm=-1.0))


def test_config_shard_refuses_fp16_gradscaler():
    with pytest.raises(ConfigError, match="does not support train.precision = \"fp16\""):
        validate(_cfg(comm__shard="optimizer", train__precision="fp16"), cuda=True)


def test_unsupported_optimizer_shapes_are_refused_before_any_collective():
    import torch

    from hpctrain.training.sharding import check_supported

    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.0}]
    check_supported(torch.optim.SGD(groups, lr=0.1), model)  # groups are sharded group by group
    with pytest.raises(ConfigError, match="supports SGD, Adam and AdamW"):
        check_supported(torch.optim.Adagrad(model.parameters()), model)
    half = torch.nn.Linear(3, 2).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="float32"):
        check_supported(torch.optim.SGD(half.parameters(), lr=0.1), half)


class OneRank:
    """The collectives of a one-rank world (every one is the identity there)."""

    rank, size = 0, 1

    def __init__(self):
        self.started = []  # the all-reduce buckets, in the order started

    def reduce_scatter_mean(self, flat, counts):
        return flat.clone()

    def allgather_flat(self, flat, counts):
        pass

    def start_average(self, flat, compress=True, name=None):
        self.started.append(name)
        return flat

    def wait_average(self, handle):
        return handle

    def allreduce_mean(self, value):
        return value

    def allgather_object(self, obj):
        return [obj]

    def broadcast_tensor(self, tensor, root=0):
        pass


@pytest.mark.parametrize("reduction", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("stage", ["optimizer", "gradients"])
def test_one_rank_sharded_steps_equal_plain_torch_also_when_the_model_is_trained_again(stage, reduction):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())
    for _ in range(2):  # a second ShardedOptimizer over the same model (a second fit)
        opt = ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1), model, OneRank(), stage,
                               accumulation=2, reduction=reduction)
        plain = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
        for _ in range(3):
            xs = [torch.randn(4, 3) for _ in range(2)]  # two micro-batches
            for x in xs:
                model(x).pow(2).sum().backward()
                ref(x).pow(2).sum().backward()
            opt.synchronize()
            assert opt.grads_finite()
            norm = opt.clip_grad_norm(0.5)
            assert norm == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])),
                                         rel=1e-5)
            # torch sums the squares in float32, the sharded optimizer in float64 (across ranks): the
            # norms agree to rounding, and with one norm for both the clipped steps agree bit for bit
            torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.5, torch.tensor(norm, dtype=torch.float64))
            opt.step()
            plain.step()
            opt.zero_grad()
            plain.zero_grad()
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("stage", ["optimizer", "gradients"])
def test_one_rank_sharded_parameter_groups_keep_their_own_settings(stage):
    import torch

    from hpctrain.training.optimizers import decay_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())

    def groups(m):  # decayed matrices; undecayed 1-D tensors at a third of the learning rate
        decay, plain = decay_groups(m, 0.5)
        return [decay, dict(plain, lr=0.1 / 3)]

    opt = ShardedOptimizer(torch.optim.AdamW(groups(model), lr=0.1), model, OneRank(), stage)
    plain = torch.optim.AdamW(groups(ref), lr=0.1)
    assert [len(g) for g in opt.group_names()] == [2, 4]
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.5, 0.1), (0.0, 0.1 / 3)]
    for _ in range(3):
        x = torch.randn(5, 3)
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        opt.synchronize()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(model[1].bias, torch.zeros(4))  # the norm's parameters were updated too


def test_gradient_buckets_cover_the_flat_buffer_from_its_end():
    from hpctrain.training.sharding import gradient_buckets

    sizes = [5, 3, 8, 2, 7]
    buckets = gradient_buckets(sizes, 9)
    assert [b[2] for b in buckets] == [[4, 3], [2, 1], [0]]  # the order backward makes them
    assert [(lo, hi) for lo, hi, _ in buckets] == [(16, 25), (5, 16), (0, 5)]
    assert sorted(i for _, _, m in buckets for i in m) == list(range(5))
    assert gradient_buckets([4], 100) == [(0, 4, [0])]


def test_allreduce_buckets_start_during_the_last_backward_pass_in_a_fixed_order():
    """With accumulation 2, no bucket starts in the first backward pass; in the second, the
    bucket of the last layer starts before the first layer's gradient exists."""
    import torch

    from hpctrain.training import sharding

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    backend = OneRank()
    seen = []  # the buckets started when the first layer's weight gradient is complete (before its own hook)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(list(backend.started)))
    old = sharding.BUCKET_BYTES
    sharding.BUCKET_BYTES = 4 * 10  # 10 elements: the last layer (8 + 2) is one bucket
    try:
        opt = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, backend, "optimizer",
                               accumulation=2, reduction="allreduce")
    finally:
        sharding.BUCKET_BYTES = old
    assert len(opt.buckets) == 2
    x = torch.randn(2, 3)
    model(x).sum().backward()
    assert backend.started == [] and seen == [[]]
    model(x).sum().backward()
    assert seen[-1] == ["hpctrain.shard.reduce.0"]  # started while the backward pass went on
    opt.synchronize()
    assert backend.started == ["hpctrain.shard.reduce.0", "hpctrain.shard.reduce.1"]



def test_an_optimizer_no_longer_used_is_freed_with_its_buffers():
    """The gradient hooks live in autograd, where the collector cannot see a cycle through
    them: they must not keep the optimizer (and its flat buffers) alive."""
    import gc
    import weakref

    import torch

    model = torch.nn.Linear(50, 40)
    for stage in ("optimizer", "gradients"):
        opt = ShardedOptimizer(torch.optim.AdamW(model.parameters()), model, OneRank(), stage, reduction="allreduce")
        model(torch.randn(2, 50)).sum().backward()
        opt.synchronize()
        opt.step()
        opt.zero_grad()
        gone = weakref.ref(opt)
        del opt
        gc.collect()
        assert gone() is None, stage
