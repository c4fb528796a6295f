"""The recipes users bring, under a real mpirun: a learning-rate schedule that a resume, a relaunch on
another rank count and a non-finite rollback continue exactly; parameter groups without weight decay and the
user's own optimizer, through checkpoints and resume; a model that computes its own loss."""
import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpi_harness import ROOT, hpctrain, mpirun

pytestmark = pytest.mark.mpi

SCHEDULE = ROOT / "tests" / "mpi" / "schedule_run.py"
NONFINITE = ROOT / "tests" / "mpi" / "nonfinite_train.py"
TIMEOUT = 120


def learning_rates(run_dir):
    """{step: lr} of every step in metrics.jsonl (each launch of the run appends to it)."""
    rates = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            assert record["steps"] == 1, record  # monitor.log_every=1: one record per step
            rates[record["step"]] = record["lr"]
    return rates


# ---------------------------------------------------------------- learning-rate schedules
@pytest.mark.parametrize("ranks, stop_at", [(2, 11), (4, 5)])
def test_a_cosine_schedule_resumes_and_relaunches_on_one_rank_with_every_steps_learning_rate(tmp_path, ranks,
                                                                                            stop_at):
    # train.epochs = 2 is the budget: 256 samples / (8 x ranks) steps an epoch; on one rank an epoch is
    # 32 steps, yet the relaunch keeps the decay the run started with
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    per_epoch = 256 // (8 * ranks)
    mpirun(ranks, [SCHEDULE, whole, 0, "train.epochs=2"], timeout=TIMEOUT).check()
    first = mpirun(ranks, [SCHEDULE, parts, stop_at, "train.epochs=2"], timeout=TIMEOUT).check()
    second = mpirun(1, [SCHEDULE, parts, 0, "train.epochs=2"], timeout=TIMEOUT).check()
    said = f"learning rate: warm-up over 4 steps to 0.2, then cosine to 0.02 at step {2 * per_epoch}"
    assert said in first.stdout and said in second.stdout, first.stdout + second.stdout
    assert "resumed from" in second.output, second.output[-3000:]

    # on one rank: what is left of the epoch the stop was in, at 8 samples a step, then whole epochs of 32
    epoch, done = divmod(stop_at, per_epoch)
    last = stop_at + (256 - done * 8 * ranks) // 8 + (1 - epoch) * 32
    assert f"until step {last} (train.epochs = 2)" in second.stdout, second.stdout
    expected, got = learning_rates(whole), learning_rates(parts)
    assert sorted(expected) == list(range(1, 2 * per_epoch + 1)) and sorted(got) == list(range(1, last + 1))
    for step, lr in expected.items():
        assert got[step] == lr, (step, got[step], lr)  # the same float, not a close one
    assert [expected[s] for s in (1, 4)] == [0.05, 0.2]
    n = 2 * per_epoch
    assert expected[n] == pytest.approx(0.02 + 0.18 * 0.5 * (1 + np.cos(np.pi * (n - 5) / (n - 4))))
    assert all(got[s] == pytest.approx(0.02) for s in range(n + 1, last + 1))  # past the decay: the floor
    assert all(expected[s] > expected[s + 1] for s in range(5, n))


def test_a_rollback_continues_the_schedule_from_the_step_it_went_back_to(tmp_path):
    schedule = ["train.lr_schedule=linear", "train.warmup_steps=2", "train.lr_min_ratio=0.0"]

    def rates(out, bad):
        args = [NONFINITE, out] + (["--bad", bad] if bad else []) + ["--checkpoints", "train.on_nonfinite=rollback",
                                                                     *schedule]
        result = mpirun(2, args, timeout=TIMEOUT)
        assert result.returncode == 0, result.output[-3000:]
        return np.load(out / "rank0.npz")

    clean, rolled = rates(tmp_path / "clean", None), rates(tmp_path / "rolled", "5")
    assert list(clean["steps"]) == list(range(1, 13)) == list(rolled["steps"])
    # steps 1-4, then step 5 rolls back to the checkpoint of step 4: from there the schedule of step 5 on,
    # times the rollback's 0.5
    assert list(rolled["lrs"][:4]) == list(clean["lrs"][:4])
    assert list(rolled["lrs"][4:]) == [lr * 0.5 for lr in clean["lrs"][4:]]
    assert clean["lrs"][1] == 0.3 and clean["lrs"][11] < clean["lrs"][4] < clean["lrs"][2]  # it decays


def test_the_start_line_and_a_bad_schedule(tmp_path):
    result = hpctrain(2, "train", "examples/digits.toml", "train.lr_schedule=step", f"run.root={tmp_path}",
                      "comm.backend=mpi", timeout=TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    assert 'train.lr_schedule = "step" needs train.lr_step_every > 0' in result.stderr, result.stderr
    assert "HINT: e.g. train.lr_step_every=1000" in result.stderr


# ---------------------------------------------------------------- parameter groups and optimizers
USER = """
[run]
name = "recipes"
root = "{root}"
python_path = ["{tests}"]
[model]
factory = "userpkg.models:{model}"
kwargs = {{ in_features = 16, width = 32, classes = 4 {model_kwargs} }}
[data]
factory = "userpkg.data:blobs"
kwargs = {{ samples = 512 }}
[train]
batch_size = 16
optimizer = "adamw"
lr = 0.01
weight_decay = 0.1
max_steps = 12
[comm]
backend = "mpi"
[checkpoint]
every_steps = 6
[monitor]
log_every = 100
"""


def user_config(tmp_path, model="classifier", model_kwargs=""):
    path = tmp_path / "job.toml"
    path.write_text(USER.format(root=tmp_path / "runs", tests=ROOT / "tests", model=model,
                                model_kwargs=model_kwargs and f", {model_kwargs}"))
    return path


def saved_groups(checkpoint):
    with h5py.File(checkpoint, "r") as f:
        return json.loads(f["optimizer"].attrs["param_groups"])


def final_checkpoint(run_dir):
    directory = Path(run_dir) / "checkpoints"
    return directory / (directory / "latest").read_text().strip()


def parameters(checkpoint):
    with h5py.File(checkpoint, "r") as f:
        return {name: f["model"][name][()].tobytes() for name in f["model"]}


def test_weight_decay_leaves_biases_out_and_the_run_resumes(tmp_path):
    config, run_dir = user_config(tmp_path), tmp_path / "run"
    hpctrain(2, "train", config, "train.weight_decay_on=matrices", f"run.run_dir={run_dir}", "train.max_steps=6",
             timeout=TIMEOUT).check()
    groups = saved_groups(final_checkpoint(run_dir))
    assert [(g["weight_decay"], sorted(g["params"])) for g in groups] == [
        (0.1, ["0.weight", "2.weight"]), (0.0, ["0.bias", "2.bias"])], groups
    resumed = hpctrain(1, "train", config, "train.weight_decay_on=matrices", f"run.run_dir={run_dir}",
                       timeout=TIMEOUT).check()
    assert "resumed from" in resumed.output and "done at step 12" in resumed.output, resumed.output[-3000:]
    assert len(saved_groups(final_checkpoint(run_dir))) == 2


def test_the_users_optimizer_trains_checkpoints_and_resumes_with_its_groups(tmp_path):
    config = user_config(tmp_path)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = ["train.optimizer=userpkg.optim:grouped_adamw", "train.lr_schedule=cosine", "train.warmup_steps=2"]
    hpctrain(2, "train", config, *common, f"run.run_dir={whole}", timeout=TIMEOUT).check()
    first = hpctrain(2, "train", config, *common, f"run.run_dir={parts}", "train.max_steps=6", "train.lr_decay_steps=12",
                     timeout=TIMEOUT).check()
    hpctrain(2, "train", config, *common, f"run.run_dir={parts}", "train.lr_decay_steps=12", timeout=TIMEOUT).check()
    groups = saved_groups(final_checkpoint(whole))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and groups[1]["lr_scale"] == 0.5, groups
    assert groups[1]["lr"] == groups[0]["lr"] * 0.5  # the biases' rate follows the schedule at half
    # the uninterrupted run and the stopped-and-resumed one end with the same parameters, bit for bit
    assert parameters(final_checkpoint(whole)) == parameters(final_checkpoint(parts)), first.output[-2000:]


@pytest.mark.parametrize("function, said", [
    ("not_an_optimizer", "train.optimizer = 'userpkg.optim:not_an_optimizer' returned list, not a torch optimizer"),
    ("no_lr", "train.optimizer = 'userpkg.optim:no_lr' cannot be called as function(model, lr=..., "
              "weight_decay=...)"),
])
def test_a_wrong_optimizer_function_fails_on_every_rank_naming_it(tmp_path, function, said):
    result = hpctrain(2, "train", user_config(tmp_path), f"train.optimizer=userpkg.optim:{function}",
                      timeout=TIMEOUT)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    assert said in result.stderr and "HINT:" in result.stderr, result.stderr


# ---------------------------------------------------------------- a model that computes its own loss
@pytest.mark.parametrize("style", ["tuple", "object"])
def test_a_model_that_computes_its_loss_trains_as_the_named_loss_does(tmp_path, style):
    """model(x, y) -> (logits, loss), or an object with .loss and .logits: the same parameters, bit for bit,
    as the same model with train.loss = "cross_entropy"; evaluation scores its logits (val_accuracy too)."""
    config = user_config(tmp_path, "self_scoring", f'style = "{style}"')
    own = hpctrain(2, "train", config, "train.loss=model", f"run.run_dir={tmp_path}/own", "train.eval_every=6",
                   timeout=TIMEOUT).check()
    named = hpctrain(2, "train", config, "train.loss=cross_entropy", f"run.run_dir={tmp_path}/named",
                     "train.eval_every=6", timeout=TIMEOUT).check()
    assert parameters(final_checkpoint(tmp_path / "own")) == parameters(final_checkpoint(tmp_path / "named"))
    evals = [line for line in own.stdout.splitlines() if "val_loss" in line and "val_accuracy" in line]
    assert evals and evals == [line for line in named.stdout.splitlines()
                               if "val_loss" in line and "val_accuracy" in line], own.stdout[-3000:]


def test_a_model_that_returns_only_its_loss_is_scored_by_it_and_a_wrong_return_is_named(tmp_path):
    scalar = hpctrain(2, "train", user_config(tmp_path, "self_scoring", 'style = "scalar"'), "train.loss=model",
                      timeout=TIMEOUT).check()
    assert "val_loss" in scalar.stdout and "val_accuracy" not in scalar.stdout, scalar.stdout[-3000:]
    wrong = hpctrain(2, "train", user_config(tmp_path, "self_scoring", 'style = "logits"'), "train.loss=model",
                     timeout=TIMEOUT)
    assert wrong.returncode == 2 and "Traceback" not in wrong.output, wrong.output[-3000:]
    assert 'train.loss = "model": model(x, y) returned Tensor of shape (16, 4), not its loss' in wrong.stderr, \
        wrong.stderr
    assert "HINT: return a scalar loss, (output, loss), or an object with .loss" in wrong.stderr


# ---------------------------------------------------------------- the example that uses all of it
def test_the_token_gpt_example_trains_from_token_files_with_its_recipe(tmp_path):
    """examples/byte_gpt_tokens.toml, shortened: token files written by the example's prepare step, the
    model's own loss, a cosine schedule, no decay on biases, norms and the tied embedding."""
    data = tmp_path / "tokens"
    prepare = mpirun(1, [ROOT / "examples" / "byte_gpt.py", "prepare", data], timeout=TIMEOUT).check()
    assert (data / "train.bin").stat().st_size > 1_000_000, prepare.output
    run_dir = tmp_path / "run"
    out = hpctrain(2, "train", "examples/byte_gpt_tokens.toml", f"data.path={data}/train.bin",
                   f"data.val_path={data}/val.bin", f"run.run_dir={run_dir}", "train.max_steps=40",
                   "train.warmup_steps=5", "train.eval_every=40", "model.kwargs.width=64", "model.kwargs.layers=2",
                   "monitor.log_every=10", timeout=TIMEOUT).check().output
    assert "until step 40 (train.max_steps = 40)" in out, out
    assert "learning rate: warm-up over 5 steps to 0.003, then cosine to 0.0003 at step 40" in out, out
    losses = [float(v) for v in re.findall(r"step \d+/40 epoch 0 loss ([\d.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0] < 5.6, out  # below ln 256: it learns
    assert "val_loss" in out and "val_bits_per_byte" in out and "val_accuracy" in out, out
    groups = saved_groups(final_checkpoint(run_dir))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0], groups
    assert "token.weight" in groups[1]["params"] and "norm.weight" in groups[1]["params"], groups
    assert all(name.endswith("weight") and "norm" not in name for name in groups[0]["params"]), groups
