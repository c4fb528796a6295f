"""``hpctrain report`` over a real 4-rank run (rank 1 slowed on purpose, checkpoints and
evaluations on): the plots hold the run's series and the PNG files are real images."""
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from mpi_harness import ROOT, mpirun
from hpctrain.monitoring import report

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    mpirun(4, ["tests/mpi/monitor_loop.py", path, "--steps", "30", "--slow-rank", "1",
               "--checkpoint-every", "10", "--eval-every", "10"], timeout=150).check()
    return path


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_figures_hold_the_runs_series(run_dir):
    records = report.read_metrics(run_dir)
    figs = report.figures(records)
    assert set(figs) == {"loss", "throughput", "ranks", "checkpoints"}
    lines = {l.get_label(): l.get_xydata() for ax in figs["loss"].axes for l in ax.get_lines()}
    assert lines["train loss"][:, 0].tolist() == [5, 10, 15, 20, 25, 30]
    assert lines["val_loss"][:, 0].tolist() == [10, 20, 30] and "val_acc" in lines
    (throughput,) = figs["throughput"].axes[0].get_lines()
    assert len(throughput.get_xydata()) == 6 and (throughput.get_xydata()[:, 1] > 0).all()
    heat = figs["ranks"].axes[0].get_images()[0].get_array()
    assert heat.shape == (4, 6)
    assert (np.argmax(heat[:, 1:], axis=0) == 1).all()  # rank 1 is the bright row
    (saves,) = figs["checkpoints"].axes[0].get_lines()
    assert saves.get_xydata()[:, 0].tolist() == [10, 20, 30]


def test_report_command_writes_pngs_and_summary(run_dir):
    result = subprocess.run([sys.executable, "-m", "hpctrain", "report", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = run_dir / "report"
    for name in ("loss", "throughput", "ranks", "checkpoints"):
        png = out / f"{name}.png"
        width, height = png_size(png)
        assert width >= 400 and height >= 250 and png.stat().st_size > 10_000, (name, width, height)
    summary = (out / "summary.txt").read_text()
    assert summary in result.stdout
    assert "steps: 30" in summary and "slowest rank: 1 on" in summary
    assert "checkpoints: 3, mean save time" in summary and "timing gather:" in summary
    assert "slow ranks reported: rank 1" in summary
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["kind"] == "end"


def test_report_of_a_real_trainer_run(tmp_path):
    """The Trainer (mpi backend, 2 ranks) with the Monitor as its callback."""
    run = tmp_path / "run"
    mpirun(2, ["tests/mpi/monitor_train.py", run], timeout=150).check()
    records = report.read_metrics(run)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end" and "divergence" not in kinds
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20, 24]
    assert all(len(r["ranks"]) == 2 and r["samples_per_s"] > 0 for r in train)
    assert set(train[-1]["phases"]) == {"data", "forward_backward", "allreduce_wait", "optimizer", "checkpoint"}
    figs = report.figures(records)
    lines = {l.get_label(): l.get_xydata() for ax in figs["loss"].axes for l in ax.get_lines()}
    assert lines["val_accuracy"][:, 0].tolist() == [8, 16, 24] and len(lines["train loss"]) == 6
    assert figs["ranks"].axes[0].get_images()[0].get_array().shape == (2, 6)
    text, paths = report.write_report(run)
    assert set(paths) == {"loss", "throughput", "ranks"}  # no checkpoints in this run
    assert all(png_size(p)[0] >= 400 for p in paths.values())
    assert "steps: 24" in text and "checkpoints: 0" in text


@pytest.mark.smoke
def test_report_of_an_hpctrain_train_run(tmp_path):
    from mpi_harness import hpctrain

    run = tmp_path / "run"
    hpctrain(2, "train", "examples/digits.toml", "comm.backend=mpi", "train.max_steps=20", "train.epochs=1",
             "monitor.log_every=5", f"run.run_dir={run}", f"data.path={tmp_path}/teacher.h5",
             "data.generate=teacher", "data.samples=2048", "data.val_samples=256", timeout=240).check()
    text, paths = report.write_report(run)
    assert "steps: 20" in text and {"loss", "throughput", "ranks", "checkpoints"} <= set(paths)
    assert "checkpoints: 1" in text  # the save at the end of training is reported
