"""Single-process logic of the user's code by import path: keyword-argument overrides, the
checks validate() runs, what an evaluation scores. The real runs: tests/test_user_code_mpi.py."""
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from hpctrain.config import usercode
from hpctrain.config import TrainConfig, apply_override, load_config, validate
from hpctrain.data import as_dataset
from hpctrain.errors import ConfigError
from hpctrain.training import evaluation
from hpctrain.training.losses import build_loss

TESTS = str(Path(__file__).resolve().parent)


def user_config(**model):
    cfg = TrainConfig()
    cfg.run.python_path = [TESTS]
    cfg.model.factory = "userpkg.models:classifier"
    cfg.model.kwargs = dict(model)
    cfg.data.factory = "userpkg.data:blobs"
    return cfg


def test_kwargs_overrides_are_toml_literals_and_round_trip(tmp_path):
    cfg = user_config(width=8)
    for text in ["model.kwargs.width=1024", "model.kwargs.act=gelu", "model.kwargs.sizes=[1, 2]",
                 'model.kwargs.name="a b"', "model.kwargs.bias=false", "run.python_path=src,lib"]:
        apply_override(cfg, text)
    assert cfg.model.kwargs == {"width": 1024, "act": "gelu", "sizes": [1, 2], "name": "a b", "bias": False}
    assert cfg.run.python_path == ["src", "lib"]
    assert TrainConfig.from_dict(tomllib.loads(cfg.to_toml())) == cfg  # config.toml reads back the same


def test_kwargs_override_of_a_plain_setting_is_an_error():
    with pytest.raises(ConfigError, match=r"train.lr is not a table of keyword arguments(.|\n)*model.kwargs"):
        apply_override(TrainConfig(), "train.lr.x=3")


def test_kwargs_must_be_a_table():
    with pytest.raises(ConfigError, match="is not a table of keyword arguments"):
        TrainConfig.from_dict({"model": {"kwargs": 3}})


def test_validate_imports_and_binds_without_calling():
    cfg = validate(user_config(width=8))
    assert cfg.model.kwargs == {"width": 8} and TESTS in sys.path


@pytest.mark.parametrize("change,message", [
    ({"factory": "userpkg.nothere:f"}, "no module named 'userpkg.nothere'"),
    ({"factory": "userpkg.models:nothere"}, "has no attribute 'nothere'"),
    ({"factory": "userpkg.models"}, "is not an import path"),
    ({"kwargs": {"depth": 2}}, r"unexpected keyword argument 'depth'; its signature is classifier\(in_features=16"),
    ({"factory": "", "kwargs": {"width": 2}}, "model.factory is not: nothing to pass them to"),
])
def test_validate_names_what_failed(change, message):
    cfg = user_config()
    for key, value in change.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ConfigError, match=message) as info:
        validate(cfg)
    assert "HINT:" in str(info.value)


def test_a_missing_dependency_of_the_users_module_is_named(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import not_installed_anywhere\ndef f():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig()
    cfg.model.factory = "needs_dep:f"
    with pytest.raises(ConfigError, match="it imports 'not_installed_anywhere', which is not installed"):
        validate(cfg, need_data=False)


def test_unknown_loss_name_and_builtin_losses():
    cfg = TrainConfig()
    cfg.train.loss = "crossentropy"
    with pytest.raises(ConfigError, match="neither a built-in loss"):
        validate(cfg, need_data=False)
    loss = build_loss("cross_entropy")
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), tokens.reshape(10))
    assert torch.allclose(loss(logits, tokens), expected)  # per-token logits (B, T, C)


def test_call_errors_name_the_factory_and_the_line():
    with pytest.raises(ConfigError, match=r"model.factory = 'userpkg.models:smoother': calling it with "
                                          r"\{'kernel': 'x'\} raised TypeError(.|\n)*models.py:\d+"):
        usercode.make_importable([TESTS])
        usercode.call("userpkg.models:smoother", {"kernel": "x"}, "model.factory")


def test_scores_accuracy_only_for_class_logits():
    ce, mse = build_loss("cross_entropy"), build_loss("mse")
    two_d = evaluation.score_batch(torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 0, 0]), ce)
    assert two_d["accuracy"] == (2.0, 3)
    per_token = evaluation.score_batch(torch.randn(2, 4, 3), torch.zeros(2, 4, dtype=torch.long), ce)
    assert per_token["accuracy"][1] == 8  # counted in tokens
    regression = evaluation.score_batch(torch.zeros(3, 2), torch.ones(3, 2), mse)
    assert set(regression) == {"loss"} and regression["loss"] == (3.0, 3)


def test_metrics_pairs_and_means_add_up_exactly_over_ranks():
    def metrics(output, target):
        return {"hits": (float(output.sum()), 10), "mean": 0.5}

    ranks = []
    for n in (3, 1):  # two ranks with different numbers of samples
        totals = {}
        evaluation.add(totals, evaluation.score_batch(torch.ones(n, 1), torch.ones(n, 1), lambda o, t: o.sum() * 0,
                                                      metrics))
        ranks.append(totals)
    result = evaluation.means(evaluation.combine(ranks))
    assert list(result) == ["val_loss", "val_hits", "val_mean"]
    assert result["val_hits"] == 4 / 20 and result["val_mean"] == 0.5


def test_map_style_dataset_with_sequence_targets():
    data = [(torch.ones(3), torch.arange(3)), (torch.zeros(3), torch.arange(3) + 1)]
    x, y = as_dataset(data).read([1, 0])
    assert x.shape == (2, 3) and y.tolist() == [[1, 2, 3], [0, 1, 2]]
    _, labels = as_dataset([(torch.ones(2), 4), (torch.ones(2), 7)]).read([0, 1])
    assert labels.tolist() == [4, 7] and labels.dtype == torch.int64


def test_load_config_with_kwargs_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nfactory = "a:b"\n[model.kwargs]\nwidth = 3\n')
    assert load_config(path, ["model.kwargs.width=5"]).model.kwargs == {"width": 5}


def test_a_script_given_as_configuration_says_how_to_run_it():
    with pytest.raises(ConfigError, match=r"is a Python script(.|\n)*python examples/train_script.py"):
        load_config("examples/train_script.py")
