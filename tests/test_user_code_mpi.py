"""The user's own code, trained by hpctrain on 2 real ranks: a package outside hpctrain
(tests/userpkg) named by import path in the configuration, imported from the working directory
or from run.python_path; keyword-argument overrides; a sequence model scored without an
accuracy; bad paths and arguments failing alike on every rank; a Python script as the job."""
import json
import math
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mpi_harness import PYTHON, ROOT, hpctrain, mpi_env, mpirun

pytestmark = pytest.mark.mpi

USERPKG = ROOT / "tests" / "userpkg"

BLOBS = """
[run]
name = "user"
root = "{root}"

[model]
factory = "userpkg.models:classifier"
kwargs = {{ in_features = 16, width = 32, classes = 4 }}

[data]
factory = "userpkg.data:blobs"

[data.kwargs]
samples = 512

[train]
loss = "userpkg.losses:smooth_ce"
epochs = 2
batch_size = 16
optimizer = "adam"
lr = 0.01

[monitor]
log_every = 100
"""


def parameters(output):
    return int(re.search(r"model ([\d,]+) parameters", output).group(1).replace(",", ""))


def last_eval(output):
    return dict((k, float(v)) for k, v in re.findall(r"(val_\w+) ([-\d.e+naif]+)", output.split("eval at step")[-1]))


def run_dir_of(output):
    return Path(re.search(r"run directory: (\S+)", output).group(1))


def test_config_names_a_package_in_the_working_directory(tmp_path):
    """`hpctrain train my.toml` from the directory that holds the user's package: model, data and
    loss are theirs; model.kwargs.width=8 on the command line reaches the factory."""
    shutil.copytree(USERPKG, tmp_path / "userpkg")
    (tmp_path / "my.toml").write_text(BLOBS.format(root=tmp_path / "runs"))
    out = hpctrain(2, "train", "my.toml", "model.kwargs.width=8", cwd=tmp_path, timeout=150).check().output
    assert parameters(out) == (16 * 8 + 8) + (8 * 4 + 4), out  # the width the override gave
    scores = last_eval(out)
    assert scores["val_accuracy"] >= 0.9, out
    written = (run_dir_of(out) / "config.toml").read_text()  # the resolved arguments, for a resume
    assert 'kwargs = {"in_features" = 16, "width" = 8, "classes" = 4}' in written, written


def test_python_path_sequence_model_scored_by_loss_and_custom_metrics(tmp_path):
    """run.python_path makes tests/ importable; a (B, T) -> (B, T) regressor from a map-style
    dataset has no accuracy: val_loss (mse) and the metrics function's sums, exact over ranks."""
    cfg = tmp_path / "seq.toml"
    cfg.write_text(f"""
[run]
root = "{tmp_path / 'runs'}"
python_path = ["{ROOT / 'tests'}"]
[model]
factory = "userpkg.models:smoother"
kwargs = {{ kernel = 3 }}
[data]
factory = "userpkg.data:sequences"
kwargs = {{ samples = 256, length = 12 }}
[train]
loss = "mse"
metrics = "userpkg.metrics:abs_error"
epochs = 3
batch_size = 8
optimizer = "adam"
lr = 0.05
[monitor]
log_every = 100
""")
    out = hpctrain(2, "train", str(cfg), "comm.backend=mpi", cwd=tmp_path, timeout=150).check().output
    scores = last_eval(out)
    assert "mpi backend" in out and set(scores) == {"val_loss", "val_abs_error", "val_max_error_mean"}, out
    assert "val_accuracy" not in out
    assert scores["val_loss"] < 0.2 and 0 < scores["val_abs_error"] < scores["val_max_error_mean"], out
    # metrics.jsonl has the same names
    records = [json.loads(line) for line in (run_dir_of(out) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert evals and "val_abs_error" in evals[-1] and "val_accuracy" not in evals[-1], evals[-1:]


@pytest.mark.parametrize("override,expected", [
    ("model.factory=userpkg.nomodule:net", "no module named 'userpkg.nomodule'"),
    ("model.factory=userpkg.models:clasifier", "has no attribute 'clasifier'"),
    ("model.kwargs.depth=3", "unexpected keyword argument 'depth'; its signature is "
                             "classifier(in_features=16, width=32, classes=4)"),
    ("model.factory=userpkg.models:not_a_model", "returned a str, not a torch nn.Module"),
    ("data.kwargs.sample=5", "got an unexpected keyword argument 'sample'"),
    ("train.loss=userpkg.losses:missing", "train.loss = 'userpkg.losses:missing'"),
])
def test_bad_import_paths_and_arguments_fail_alike_on_every_rank(tmp_path, override, expected):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(BLOBS.format(root=tmp_path / "runs"))
    result = hpctrain(2, "train", str(cfg), f"run.python_path={ROOT / 'tests'}", override, cwd=tmp_path,
                      timeout=90)
    out = result.output
    assert result.returncode == 2, out
    assert out.count(expected) == 1, out  # said once (rank 0), raised on both ranks alike
    assert "HINT:" in out and "Traceback" not in out, out
    assert not any((tmp_path / "runs").glob("*/checkpoints/ckpt-*.h5"))


def test_byte_gpt_bf16_and_fp16_compression_report_exact_bits_per_byte(tmp_path):
    """The language-model example, tiny, with bf16 autocast and fp16 gradients: token accuracy
    for (B, T, C) logits, and the custom metric summed exactly over ranks (bits = nats / ln 2)."""
    out = hpctrain(2, "train", "examples/byte_gpt.toml", f"run.root={tmp_path}/runs",
                   f"data.kwargs.path={tmp_path}/bytes.h5", "data.kwargs.max_bytes=300000",
                   "model.kwargs.width=32", "model.kwargs.layers=1", "model.kwargs.heads=2",
                   "train.max_steps=12", "train.eval_every=12", "checkpoint.every_steps=0",
                   "train.precision=bf16", "comm.compression=fp16", cwd=ROOT, timeout=150).check().output
    scores = last_eval(out)
    assert set(scores) == {"val_loss", "val_accuracy", "val_bits_per_byte"}, out
    assert 0 < scores["val_accuracy"] < 1 and scores["val_loss"] < math.log(256), out
    assert scores["val_bits_per_byte"] == pytest.approx(scores["val_loss"] / math.log(2), rel=1e-3), out


# ---------------------------------------------------------------- a Python script as the job
def test_script_takes_overrides_stops_on_the_warning_signal_and_resumes(tmp_path):
    """examples/train_script.py: its own model and data, section.key=value overrides; SIGUSR1 to
    mpirun makes it save and exit 3 (what the job scripts requeue on); run again, it resumes."""
    run_dir = tmp_path / "run"
    args = ["mpirun", "-n", "2", "--timeout", "150", PYTHON, "examples/train_script.py", f"run.run_dir={run_dir}",
            "train.epochs=40", "monitor.log_every=5", "monitor.progress=log", "checkpoint.on_epoch_end=false"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                            cwd=ROOT)
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.match(r"step \d+/", line):
            proc.send_signal(signal.SIGUSR1)  # as Slurm's warning, forwarded by mpirun to the ranks
            break
    try:
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the script did not stop after SIGUSR1:\n" + "".join(lines))
    assert proc.returncode == 3, out
    stopped = int(re.search(r"stopped at step (\d+)", out).group(1))
    assert (run_dir / "checkpoints" / "latest").exists(), out
    total = 40 * (3584 // 64)
    assert stopped < total, out
    again = mpirun(2, ["examples/train_script.py", f"run.run_dir={run_dir}", "checkpoint.resume=auto",
                       "train.epochs=40", "train.max_steps=" + str(stopped + 10)], cwd=ROOT, timeout=150)
    out2 = again.check().output
    assert f"at step {stopped}" in out2 and f"done at step {stopped + 10}" in out2, out2


def test_launch_supervises_a_script(tmp_path):
    """`hpctrain launch -n 2 SCRIPT.py overrides`: the supervisor starts the script itself (not
    `hpctrain train`), with the overrides and the run directory it chose."""
    result = subprocess.run([PYTHON, "-m", "hpctrain", "launch", "-n", "2", "--spares", "0",
                             "--launcher-args=--oversubscribe",
                             "examples/train_script.py", "train.epochs=1", f"run.run_dir={tmp_path}/run"],
                            capture_output=True, text=True, timeout=180, env=mpi_env(), cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(r"starting 2 rank\(s\): mpirun .*examples/train_script.py train.epochs=1 run.run_dir=", out), out
    assert (tmp_path / "run" / "checkpoints" / "latest").exists() and 'name = "spirals"' in \
        (tmp_path / "run" / "config.toml").read_text()


# ---------------------------------------------------------------- the language-model example
STEPS = 40  # enough to learn something; the stated target (600 steps) is make bench's (example_targets.py)


@pytest.mark.slow
def test_byte_gpt_as_shipped_learns_resumes_on_one_rank_and_exports(tmp_path):
    """examples/byte_gpt.toml as shipped but for its step budget, on 2 ranks: it learns (below ln 256, what a
    model that learnt nothing scores); then 10 more steps resumed on 1 rank (the same global batch); then the
    exported weights, loaded into the example's own model in a process of their own, score what the run
    reported. That the shipped 600 steps reach the stated 1.65 nats is measured by `make bench`."""
    run_dir, data = tmp_path / "gpt", tmp_path / "bytes.h5"
    common = ["examples/byte_gpt.toml", f"run.run_dir={run_dir}", f"data.kwargs.path={data}", "monitor.progress=log",
              f"train.eval_every={STEPS}"]
    out = hpctrain(2, "train", *common, f"train.max_steps={STEPS}", cwd=ROOT, timeout=600).check().output
    reached = last_eval(out)["val_loss"]
    assert f"done at step {STEPS}" in out and reached < math.log(256) - 1, out[-3000:]

    out = hpctrain(1, "train", *common, f"train.max_steps={STEPS + 10}", cwd=ROOT, timeout=300).check().output
    assert re.search(rf"resumed from \S+ckpt-0*{STEPS}.h5 at step {STEPS}", out) and \
        f"done at step {STEPS + 10}" in out, out[-3000:]
    reported = float(re.search(rf"done at step {STEPS + 10}.* val_loss (\S+)", out).group(1))
    assert reported < reached  # ten more steps on one rank went on learning

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    exported = tmp_path / "gpt.pt"
    subprocess.run([PYTHON, "-m", "hpctrain", "ckpt", "export", str(latest), "--to", str(exported)], check=True,
                   timeout=120, cwd=ROOT)
    check = subprocess.run([PYTHON, "-c", f"""
import sys, torch
sys.path.insert(0, "examples")
import byte_gpt
torch.set_num_threads(1)
model = byte_gpt.gpt(block=64, width=128, layers=4, heads=4)
model.load_state_dict(torch.load({str(exported)!r}))
model.eval()
_, val = byte_gpt.corpus({str(data)!r}, val_fraction=0.02)
total, n = 0.0, 0
with torch.no_grad():
    for lo in range(0, len(val), 128):
        x, y = val.read(range(lo, min(lo + 128, len(val))))
        total += float(torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))) * len(y)
        n += len(y)
print("exported val_loss", total / n)
"""], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert check.returncode == 0, check.stderr
    assert float(check.stdout.split()[-1]) == pytest.approx(reported, abs=1e-3), check.stdout
