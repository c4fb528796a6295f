"""The recipes' pure parts: the learning rate of each step, which parameters weight decay leaves out, what a
model that computes its own loss may return, and a user's optimizer function checked before it is used."""
import types

import pytest
import torch
from torch import nn

from hpctrain.config import load_config, validate
from hpctrain.config.schema import LoopConfig
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.training.losses import build_loss, forward
from hpctrain.training.optimizers import decay_groups, learning_rate, make_optimizer, set_lr


@pytest.mark.parametrize("schedule, expected", [
    ("constant", [0.25, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.25, 1.0, 0.55, 0.1, 0.1]),
    ("cosine", [0.25, 1.0, 0.55, 0.1, 0.1]),
])
def test_each_schedule_warms_up_then_decays_to_its_floor(schedule, expected):
    t = LoopConfig(warmup_steps=4, lr_schedule=schedule, lr_min_ratio=0.1)
    got = [learning_rate(t, 1.0, step, decay_steps=14) for step in (0, 3, 9, 14, 30)]
    assert got == pytest.approx(expected)


def test_the_step_schedule_and_the_old_warm_up_to_the_last_bit():
    t = LoopConfig(lr_schedule="step", lr_step_every=10, lr_step_gamma=0.5, lr_min_ratio=0.2)
    assert [learning_rate(t, 1.0, s, 0) for s in (0, 9, 10, 25, 100)] == [1.0, 1.0, 0.5, 0.25, 0.2]
    # the constant schedule is the warm-up runs had before schedules, float for float
    t = LoopConfig(warmup_steps=7)
    assert [learning_rate(t, 0.3, s, 0) for s in range(10)] == [0.3 * min(1.0, (s + 1) / 7) for s in range(10)]


@pytest.mark.parametrize("override, message", [
    ("train.lr_schedule=cos", "train.lr_schedule = 'cos' is not one of constant, cosine, linear, step"),
    ("train.lr_min_ratio=2", r"train.lr_min_ratio = 2.0 must be in \[0, 1\]"),
    ("train.lr_schedule=step", 'train.lr_schedule = "step" needs train.lr_step_every > 0'),
    ("train.weight_decay_on=biases", "train.weight_decay_on = 'biases' is not one of all, matrices"),
])
def test_bad_schedule_and_decay_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["data.path=x.h5", override], environ={}))


def test_decay_leaves_out_biases_norms_and_tied_embeddings():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.norm = nn.LayerNorm(4)
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied, as GPTs do

    model = Tiny()
    decay, plain = decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [id(p) for p in decay["params"]] == [id(model.proj.weight)]
    assert plain["weight_decay"] == 0.0
    assert {id(p) for p in plain["params"]} == {id(model.embed.weight), id(model.norm.weight), id(model.norm.bias),
                                                id(model.proj.bias)}
    assert len(plain["params"]) == 4  # the tied weight once
    t = LoopConfig(optimizer="adamw", weight_decay=0.1, weight_decay_on="matrices")
    assert [g["weight_decay"] for g in make_optimizer(model, t, 0.01).param_groups] == [0.1, 0.0]


def test_a_groups_own_learning_rate_follows_the_schedule_in_proportion():
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.ones(1))]},
                           {"params": [nn.Parameter(torch.ones(1))], "lr_scale": 0.5}], lr=1.0)
    set_lr(opt, 0.2)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.1]


def test_what_a_model_may_return_as_its_loss():
    x, y = torch.zeros(2, 3), torch.tensor([0, 1])
    loss, logits = torch.tensor(1.5), torch.ones(2, 4)
    assert build_loss("model") is None
    assert forward(lambda a, b: loss, (x, y), None)[:2] == (None, loss)
    assert forward(lambda a, b: (logits, loss), (x, y), None)[:2] == (logits, loss)
    hf = types.SimpleNamespace(loss=loss, logits=logits)
    assert forward(lambda a, b: hf, (x, y), None)[:2] == (logits, loss)
    with pytest.raises(HpctrainError, match=r"returned Tensor of shape \(2, 4\), not its loss"):
        forward(lambda a, b: logits, (x, y), None)
    with pytest.raises(HpctrainError, match="returned dict"):
        forward(lambda a, b: {"loss": loss}, (x, y), None)


def test_a_model_loss_is_refused_where_the_model_is_split():
    cfg = load_config(None, ["data.path=x.h5", "train.loss=model", "parallel.stages=2", "model.name=mlp"],
                      environ={})
    with pytest.raises(ConfigError, match=r"train.loss = 'model' \(the model computes its loss\) needs the whole "
                                          r"model on a rank"):
        validate(cfg, world_size=2)


def test_a_users_optimizer_is_checked_before_the_run(tmp_path, monkeypatch):
    (tmp_path / "myopt.py").write_text("import torch\n"
                                       "def good(model, lr, weight_decay):\n"
                                       "    return torch.optim.SGD(model.parameters(), lr=lr)\n"
                                       "def two_args(model, lr):\n"
                                       "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = validate(load_config(None, ["data.path=x.h5", "train.optimizer=myopt:good"], environ={}))
    assert ok.train.optimizer == "myopt:good"
    with pytest.raises(ConfigError, match=r"train.optimizer = 'myopt:two_args' cannot be called as function\(model, "
                                          r"lr=..., weight_decay=...\)"):
        validate(load_config(None, ["data.path=x.h5", "train.optimizer=myopt:two_args"], environ={}))
    with pytest.raises(ConfigError, match="train.weight_decay_on = 'matrices' is for the built-in optimizers"):
        validate(load_config(None, ["data.path=x.h5", "train.optimizer=myopt:good", "train.weight_decay_on=matrices"],
                             environ={}))
    with pytest.raises(ConfigError, match="is not one of sgd, adam, adamw"):
        validate(load_config(None, ["data.path=x.h5", "train.optimizer=lamb"], environ={}))
