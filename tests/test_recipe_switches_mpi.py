"""The recipe switches of [train] on 2 real ranks: a checkpoint of a compiled model resumes into an eager one
and back (the names are the eager model's); early stopping ends the run after its patience, says so in the log
and the report, and keeps the best checkpoint; activation checkpointing trains the very same steps."""
import re

import pytest

from mpi_harness import ROOT, command, hpctrain

pytestmark = pytest.mark.mpi

DONE = re.compile(r"done at step (\d+).* val_loss (\S+)")


def digits_run(run_dir, digits, *more):
    return hpctrain(2, "train", "examples/digits.toml", f"data.path={digits}", f"run.run_dir={run_dir}",
                    "monitor.progress=log", "train.epochs=0", *more, cwd=ROOT, timeout=300).check().output


def test_a_compiled_models_checkpoint_resumes_eager_and_back(tmp_path, digits):
    run = tmp_path / "run"
    first = digits_run(run, digits, "train.compile=true", "train.max_steps=4", "checkpoint.every_steps=4")
    assert "compiled with torch.compile" in first and "done at step 4" in first, first[-3000:]
    eager = digits_run(run, digits, "train.max_steps=8", "checkpoint.every_steps=4")
    assert re.search(r"resumed from \S+ckpt-0*4.h5 at step 4", eager) and "torch.compile" not in eager, eager[-3000:]
    again = digits_run(run, digits, "train.compile=true", "train.max_steps=12", "checkpoint.every_steps=4")
    assert re.search(r"resumed from \S+ckpt-0*8.h5 at step 8", again) and "done at step 12" in again, again[-3000:]
    plain = digits_run(tmp_path / "plain", digits, "train.max_steps=12")
    assert float(DONE.search(again).group(2)) == pytest.approx(float(DONE.search(plain).group(2)), abs=1e-3)


def test_early_stop_after_its_patience_keeps_the_best_checkpoint(tmp_path, digits):
    """val_loss falls as the digits train, so with best_mode = "max" the first evaluation stays the best: the
    run stops at the second evaluation after it."""
    run = tmp_path / "run"
    out = digits_run(run, digits, "train.max_steps=40", "train.eval_every=2", "train.early_stop_patience=2",
                     "checkpoint.best_mode=max", "checkpoint.every_steps=2", "checkpoint.keep_last=1")
    assert "early stopping keeps the best checkpoint (checkpoint.keep_best = 1)" in out, out[-3000:]
    assert re.search(r"early stop at step 6: val_loss has not improved for 2 evaluations "
                     r"\(train.early_stop_patience = 2; best \S+ at step 2\)", out), out[-3000:]
    assert "done at step 6" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.h5")) == ["ckpt-00000002.h5", "ckpt-00000006.h5"]
    report = command("report", run, cwd=ROOT).check().output
    assert re.search(r"early stop at step 6: val_loss not improved for 2 evaluations \(patience 2; best \S+ at "
                     r"step 2\)", report), report


def test_activation_checkpointing_trains_the_same_steps(tmp_path, digits):
    plain = digits_run(tmp_path / "plain", digits, "train.max_steps=6", "model.depth=3", "model.residual=true")
    recomputed = digits_run(tmp_path / "ac", digits, "train.max_steps=6", "model.depth=3", "model.residual=true",
                            "train.activation_checkpointing=true")
    assert "activation checkpointing: each of" in recomputed, recomputed[-3000:]
    assert DONE.search(plain).groups() == DONE.search(recomputed).groups()
