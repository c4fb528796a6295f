"""``[parallel]`` in the configuration, the layer stack and the replica groups: pure logic,
one process. The runs themselves are in test_parallel_cli.py."""
import pytest
import torch

from hpctrain.config import TrainConfig, is_split, load_config, validate
from hpctrain.errors import ConfigError


def cfg_with(**sections):
    cfg = TrainConfig.from_dict({"data": {"path": "x.h5"}, **sections})
    return cfg


def test_default_is_data_parallel():
    cfg = cfg_with()
    assert not is_split(cfg)
    assert validate(cfg, 4).train.batch_size == 32


def test_split_layout_and_global_batch_over_replicas():
    cfg = cfg_with(parallel={"stages": 2, "micro_batches": 4}, train={"global_batch_size": 64})
    assert is_split(cfg)
    # 4 ranks = 2 stages x 2 replicas: the global batch is shared by the 2 replicas.
    assert validate(cfg, 4).train.batch_size == 32


def test_example_config_is_valid_on_4_ranks():
    cfg = validate(load_config("examples/pipeline_mlp.toml"), 4)
    assert is_split(cfg) and cfg.model.name == "transformer"


@pytest.mark.parametrize("sections,message,hint", [
    ({"parallel": {"stages": 3}}, "4 ranks cannot be divided into replicas of 3 stage(s)", "mpirun -n"),
    ({"parallel": {"schedule": "1f1c"}}, "parallel.schedule = '1f1c' is not one of 1f1b, gpipe", "'1f1b'"),
    ({"parallel": {"balance": "memory"}}, "parallel.balance = 'memory' is not one of params, time", "parallel.balance"),
    ({"parallel": {"tensor": 0}}, "parallel.tensor = 0 must be >= 1", "parallel.tensor=2"),
    ({"parallel": {"stages": 2}, "train": {"accumulation": 2}}, "train.accumulation = 2 is not used",
     "parallel.micro_batches=2"),
    ({"parallel": {"stages": 2, "micro_batches": 8}, "train": {"batch_size": 4}},
     "cannot be cut into parallel.micro_batches = 8", "train.batch_size >= 8"),
    ({"parallel": {"tensor": 4}, "model": {"name": "transformer", "hidden": 24}},
     "model.hidden = 24 does not split into 4 attention heads over parallel.tensor = 4", "multiple of 16"),
    ({"parallel": {"stages": 2}, "checkpoint": {"async_save": True}}, "checkpoint.async_save is not supported",
     "async_save=false"),
    ({"parallel": {"stages": 2}, "monitor": {"consistency_every": 5}}, "monitor.consistency_every compares",
     "consistency_every=0"),
])
def test_bad_parallel_settings_name_what_to_set(sections, message, hint):
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(**sections), 4)
    assert message in str(err.value)
    assert hint in str(err.value)


def test_layer_stack_builds_each_layer_alike_in_any_order():
    from torch import nn

    from hpctrain.models.stack import LayerStack

    stack = LayerStack(4, lambda i: nn.Linear(3, 3), seed=5)
    whole = stack.sequential()
    part = stack.sequential(2, 4)  # built without layers 0 and 1
    assert list(part.state_dict()) == ["2.weight", "2.bias", "3.weight", "3.bias"]
    for name, t in part.state_dict().items():
        assert torch.equal(t, whole.state_dict()[name])
    before = torch.random.get_rng_state()
    stack.build(1)
    assert torch.equal(before, torch.random.get_rng_state())  # the caller's generator untouched
    assert stack.parameter_counts() == [12, 12, 12, 12]
    assert stack.build(0, device="meta").weight.is_meta


def test_builtin_transformer_equals_its_stack():
    from hpctrain.models import build_model
    from hpctrain.training.split import model_stack

    cfg = cfg_with(model={"name": "transformer", "in_features": 16, "hidden": 8, "depth": 1, "num_classes": 3},
                   run={"seed": 7})
    torch.manual_seed(7)  # as the trainer does before build_model
    dense = build_model(cfg.model)
    stack = model_stack(cfg)
    assert len(stack) == 6
    for name, t in stack.sequential().state_dict().items():
        assert torch.equal(t, dense.state_dict()[name])
    assert dense(torch.randn(5, 16)).shape == (5, 3)


def test_replica_groups():
    from hpctrain.parallel.hybrid import replica_groups
    from hpctrain.parallel.layout import Layout

    assert replica_groups(Layout(2, 2, 1)) == [[0, 2], [1, 3]]
    assert replica_groups(Layout(1, 2, 2)) == [[0, 2], [1, 3]]
    assert replica_groups(Layout(4, 1, 1)) == [[0], [1], [2], [3]]
