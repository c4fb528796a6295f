"""``hpctrain report`` on hand-written records (pure): series, summary, odd inputs."""
import json

import numpy as np
import pytest

from hpctrain.commands import report as report_command
from hpctrain.monitoring import report


def run_records(ranks=3, slow=2):
    out = [{"kind": "start", "timestamp": 1000.0, "ranks": ranks, "hosts": [f"n{r}" for r in range(ranks)]}]
    for i, step in enumerate((10, 20, 30)):
        out.append({"kind": "train", "step": step, "epoch": 0, "timestamp": 1000.0 + 60 * (i + 1), "steps": 10,
                    "loss": 1.0 / step, "lr": 0.1, "step_time": 0.1, "steps_per_s": 10.0,
                    "samples_per_s": 320.0 + i,
                    "ranks": [{"rank": r, "host": f"n{r}", "work": 0.05 if r == slow else 0.01}
                              for r in range(ranks)],
                    "gather": {"seconds": 0.001, "fraction": 0.001}})
    out.append({"kind": "eval", "step": 20, "epoch": 0, "timestamp": 1130.0, "val_loss": 0.2, "val_accuracy": 0.9})
    out.append({"kind": "checkpoint", "step": 20, "timestamp": 1131.0, "seconds": 1.5, "path": "a"})
    out.append({"kind": "checkpoint", "step": 30, "timestamp": 1190.0, "seconds": 2.5, "path": "b"})
    out.append({"kind": "slow_rank", "rank": slow, "host": f"n{slow}", "phase": "data", "ratio": 5.0, "step": 30})
    out.append({"kind": "end", "step": 30, "timestamp": 1200.0})
    return out


def test_plots_hold_the_series():
    records = run_records()
    loss = report.plot_loss(records)
    lines = {line.get_label(): line.get_xydata().tolist() for ax in loss.axes for line in ax.get_lines()}
    assert lines["train loss"] == [[10, 0.1], [20, 0.05], [30, 1 / 30]]
    assert lines["val_loss"] == [[20, 0.2]] and lines["val_accuracy"] == [[20, 0.9]]
    (line,) = report.plot_throughput(records).axes[0].get_lines()
    assert line.get_xydata().tolist() == [[1.0, 320.0], [2.0, 321.0], [3.0, 322.0]]  # minutes
    heat = report.plot_rank_heatmap(records).axes[0].get_images()[0].get_array()
    assert heat.shape == (3, 3) and np.argmax(heat.mean(axis=1)) == 2
    (saves,) = report.plot_checkpoints(records).axes[0].get_lines()
    assert saves.get_xydata().tolist() == [[20, 1.5], [30, 2.5]]


def test_summary_names_the_slowest_rank_and_host():
    s = report.summarize(run_records())
    assert s["steps"] == 30 and s["wall_seconds"] == 200.0
    assert s["samples_per_s"] == pytest.approx(321.0)
    assert s["slowest"]["rank"] == 2 and s["slowest"]["host"] == "n2" and s["slowest"]["ratio"] == pytest.approx(5)
    assert s["checkpoints"] == 2 and s["checkpoint_mean_seconds"] == 2.0
    text = report.format_summary(s)
    assert "slowest rank: 2 on n2" in text and "#SBATCH --exclude=n2" in text
    assert "checkpoints: 2, mean save time 2.000 s" in text and "mean throughput: 321.0 samples/s" in text


def test_resumed_run_adds_up_its_segments_and_skips_a_cut_line(tmp_path):
    first, second = run_records(), run_records()
    for r in second:
        r["timestamp"] = r.get("timestamp", 0) + 5000
    lines = [json.dumps(r) for r in first + second] + ['{"kind": "train", "step": 4']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = report.read_metrics(tmp_path)
    assert len(records) == 2 * len(first)
    assert report.summarize(records)["wall_seconds"] == 400.0


def test_missing_or_empty_runs(tmp_path, capsys):
    assert report_command.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    # a run with a start record only: no plots, still a summary
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "start", "timestamp": 1.0}) + "\n")
    assert report_command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "summary.txt").read_text().startswith("steps: 0")
    assert not list((tmp_path / "report").glob("*.png"))


def test_nonfinite_steps_are_summarized_and_marked_on_the_loss_plot():
    records = run_records()
    records.insert(-1, {"kind": "nonfinite", "step": 17, "action": "skip", "tensor": "net.0.weight (NaN)"})
    records.insert(-1, {"kind": "nonfinite", "step": 25, "action": "rollback", "tensor": "net.2.bias (inf)"})
    records.insert(-1, {"kind": "eval", "step": 30, "epoch": 0, "timestamp": 1195.0, "val_loss": None,
                        "val_accuracy": 0.1})
    text = report.format_summary(report.summarize(records))
    assert ("non-finite steps: 2 (1 skip, 1 rollback): step 17 skip (net.0.weight (NaN)); "
            "step 25 rollback (net.2.bias (inf))") in text
    assert "last evaluation (step 30): val_loss nan, val_accuracy 0.1" in text
    marks = [line for ax in report.plot_loss(records).axes for line in ax.get_lines()
             if line.get_label() in ("non-finite step", "_child2", "_child3") or line.get_xydata()[0][0] in (17, 25)]
    assert sorted({int(line.get_xydata()[0][0]) for line in marks}) == [17, 25]
    assert "non-finite" not in report.format_summary(report.summarize(run_records()))


def test_restart_events_count_the_steps_lost_from_the_step_the_relaunch_resumed():
    from hpctrain.monitoring.report import restart_events

    records = [{"kind": "start", "timestamp": 1.0, "step": 0},
               {"kind": "restart", "timestamp": 10.0, "restart": 1, "failed_step": 700, "resume_step": 512,
                "steps_lost": 188},
               {"kind": "start", "timestamp": 14.0, "step": 690},  # a node-local snapshot newer than the file
               {"kind": "restart", "timestamp": 30.0, "restart": 2, "failed_step": 900, "resume_step": 512,
                "steps_lost": 388}]  # no start after it: the supervisor's count stands
    first, second = restart_events(records)
    assert (first["resume_step"], first["steps_lost"]) == (690, 10)
    assert (second["resume_step"], second["steps_lost"]) == (512, 388)
