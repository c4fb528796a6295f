"""Monitoring logic in one process: slow-rank rules, per-rank timing sums, the replica
comparison and rank 0's records, progress output, and the Monitor itself on a one-rank
communicator (real MPI, COMM_SELF)."""
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.monitoring import slownodes
from hpctrain.monitoring.display import ProgressDisplay, format_line, resolve_mode
from hpctrain.monitoring.monitor import Monitor
from hpctrain.runtime.replicas import parameter_fingerprints as replica_fingerprints
from hpctrain.monitoring.runlog import RunLog
from hpctrain.monitoring.slownodes import SlowRankDetector, slow_ranks_now
from hpctrain.monitoring.timing import PHASES, PhaseTotals


def table(work_ms, wait_ms=None):
    """(ranks, phases) seconds per step: work put in the data phase, 1 ms forward/backward."""
    rows = []
    for i, w in enumerate(work_ms):
        row = dict.fromkeys(PHASES, 0.0)
        row["data"] = w / 1e3
        row["forward_backward"] = 1e-3
        row["allreduce_wait"] = (wait_ms[i] if wait_ms else 0.0) / 1e3
        rows.append([row[p] for p in PHASES])
    return np.array(rows)


def test_a_consistently_slow_rank_is_reported_once_with_its_phase_and_host():
    detector = SlowRankDetector(factor=1.3, window=3, min_seconds=0.005)
    hosts = ["n1", "n1", "n2", "n2"]
    slow = table([5, 40, 5, 5], wait_ms=[35, 0, 35, 35])
    assert detector.update(slow, hosts, step=10) == []
    assert detector.update(slow, hosts, step=20) == []
    (finding,) = detector.update(slow, hosts, step=30)
    assert (finding.rank, finding.host, finding.phase, finding.step) == (1, "n1", "data", 30)
    assert "#SBATCH --exclude=n1" in finding.message() and "rank 1 on n1" in finding.message()
    # persisting: quiet until the reminder, then said again
    later = [detector.update(slow, hosts) for _ in range(3 * 10)]
    assert sum(len(x) for x in later) == 1 and later[-1][0].gathers == 33


def test_a_rank_that_recovers_starts_its_count_again():
    detector = SlowRankDetector(factor=1.3, window=2, min_seconds=0.0)
    hosts = ["a", "b", "c"]
    assert detector.update(table([5, 20, 5]), hosts) == []
    assert detector.update(table([5, 5, 5]), hosts) == []
    assert detector.update(table([5, 20, 5]), hosts) == []
    assert [f.rank for f in detector.update(table([5, 20, 5]), hosts)] == [1]


def test_no_report_for_balanced_ranks_jitter_or_all_reduce_wait():
    # 40% slower but only 0.4 ms: below min_seconds; and a large wait is not work
    assert slow_ranks_now(table([1.0, 1.4, 1.0, 1.0]), 1.3, 0.005) == {}
    assert slow_ranks_now(table([5, 5, 5, 5], wait_ms=[0, 80, 0, 0]), 1.3, 0.005) == {}
    assert slow_ranks_now(table([5, 6, 5, 5]), 1.3, 0.0) == {}
    # the slow phase is the one with the largest excess
    means = table([5, 5, 5])
    means[2, PHASES.index("optimizer")] = 0.05
    assert slow_ranks_now(means, 1.3, 0.005)[2][0] == "optimizer"


def test_phase_totals_add_up_one_ranks_steps():
    totals = PhaseTotals()
    times = {"data": 0.001, "forward_backward": 0.002, "step": 0.004, "eval": 0.0005}
    totals.add(times, now=10.0)  # the first step: its phases are all there is to go by
    totals.last_end = 10.1
    totals.add(times, now=10.3)  # later ones: the time since the previous step's end
    row = dict(zip(("steps", "wall_sum", "wall_max") + tuple(PHASES) + ("other", "gather"), totals.values))
    assert row["steps"] == 2 and row["wall_sum"] == pytest.approx(0.0035 + 0.2)
    assert row["wall_max"] == pytest.approx(0.2) and row["data"] == pytest.approx(0.002)
    assert row["other"] == pytest.approx(0.001)  # "eval" is no phase; the "step" total is not counted
    totals.reset(0.03)
    assert totals.values[PhaseTotals.STEPS] == 0 and totals.values[PhaseTotals.GATHER] == 0.03
    assert slownodes.PHASES is PHASES  # one schema


def test_replica_fingerprints_see_one_changed_element():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    b = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 2))
    b.load_state_dict(a.state_dict())
    assert replica_fingerprints(a) == replica_fingerprints(b) and len(replica_fingerprints(a)) == 4
    with torch.no_grad():
        b[0].weight[17, 5] += 1e-4  # not in the strided sample: the sum sees it
    assert replica_fingerprints(a) != replica_fingerprints(b)


def test_diverged_ranks_are_named_with_their_hosts_once_per_new_set(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path, ["n0", "n0", "n1", "n1"], log_every=100, gather_every=100, progress="log",
                 stream=out)
    same, other = [(5, 7), (1, 2)], [(5, 7), (1, 3)]
    for step, fingerprints in ((5, [same, same, other, same]), (10, [same, same, other, same]),
                               (15, [same] * 4), (20, [same, same, other, same]), (25, [same, other] * 2)):
        log.on_step(SimpleNamespace(step=step, epoch=0), {}, {}, 0.0, fingerprints=fingerprints)
    log.end(SimpleNamespace(step=25, epoch=0))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in records if r["kind"] == "divergence"]
    # said at 5, not again at 10; said again after a healthy check; a tie: rank 0's side is the reference
    assert [(r["step"], r["ranks"], r["reference_ranks"]) for r in found] == [
        (5, [2], [0, 1, 3]), (20, [2], [0, 1, 3]), (25, [1, 3], [0, 2])]
    checksums = found[0]["checksums"]
    assert len(checksums) == 4 and checksums[0] == checksums[1] == checksums[3] != checksums[2]
    text = out.getvalue()
    assert text.count("parameters differ across ranks") == 3
    assert "at step 5: rank(s) 2 (n1) disagree with ranks [0, 1, 3]" in text
    assert "rank(s) 1 (n0), 3 (n1) disagree with ranks [0, 2]" in text and "HINT: restart" in text


def test_progress_modes_and_lines():
    assert resolve_mode("auto", io.StringIO()) == "log"  # not a terminal: a batch job
    assert resolve_mode("bar", io.StringIO()) == "bar"
    line = format_line(200, 1000, 1, loss=0.4312, lr=1e-3, samples_per_s=5120.3, step_time=0.05, eta=40)
    assert line == "step 200/1000 epoch 1 loss 0.4312 lr 1.00e-03 5120.3 samples/s 0.050 s/step ETA 0:00:40"
    out = io.StringIO()
    bar = ProgressDisplay("bar", total_steps=10, stream=out)
    for step in range(1, 6):
        bar.step(step, 0, loss=0.5)
    bar.message("hpctrain: warning: something")
    bar.close()
    assert "5/10" in out.getvalue() and "hpctrain: warning: something" in out.getvalue()
    quiet = io.StringIO()
    off = ProgressDisplay("off", stream=quiet)
    off.step(1, 0)
    off.interval(1, 0, loss=1.0)
    assert quiet.getvalue() == ""
    off.message("still said")
    assert quiet.getvalue() == "still said\n"


def test_monitor_on_one_rank_writes_metrics(tmp_path):
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    from hpctrain.state import TrainState

    model = torch.nn.Linear(4, 1)
    state = TrainState(model, None)
    out = io.StringIO()
    monitor = Monitor(tmp_path, MPI.COMM_SELF, log_every=4, gather_every=2, progress="log",
                      consistency_every=4, total_steps=8, samples_per_step=32, stream=out, node="node07")
    assert monitor.root is not None  # rank 0 of COMM_SELF
    for step in range(1, 9):
        state.progress.step, state.progress.epoch = step, step // 5
        metrics = {"loss": torch.tensor(1.0 / step), "lr": 0.1}
        phases = {"data": 0.001, "forward_backward": 0.002, "allreduce_wait": 0.0, "optimizer": 0.0005,
                  "step": 0.0035, "eval": 0.001}  # as PhaseTimer.times() gives, plus an unknown phase
        if step == 6:  # as the trainer does: the save, inside the step's checkpoint phase
            monitor.on_checkpoint(state, tmp_path / "ckpt-6.h5", 0.25)
            phases["checkpoint"] = 0.25
        monitor.on_step(state, metrics, phases)
    monitor.on_eval(state, {"val_loss": 0.5, "accuracy": torch.tensor(0.75)})
    monitor.on_end(state)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["start", "train", "checkpoint", "train", "eval", "end"]
    first = records[1]
    assert first["step"] == 4 and first["loss"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    assert first["samples_per_s"] > 0 and first["lr"] == 0.1
    assert first["phases"]["data"]["mean"] == pytest.approx(0.001)
    assert first["ranks"][0]["host"] == "node07"
    assert first["ranks"][0]["work"] == pytest.approx(0.0035)
    assert first["ranks"][0]["other"] == pytest.approx(0.001)  # the timer's "step" total is not a phase
    assert first["gather"]["seconds"] >= 0
    assert records[2] == {**records[2], "step": 6, "epoch": 1, "path": str(tmp_path / "ckpt-6.h5"),
                          "seconds": 0.25}
    assert records[4]["accuracy"] == 0.75
    text = out.getvalue()
    assert "step 4/8 epoch 0 loss" in text and "step 8/8" in text and "eval at step 8" in text


def test_monitor_config_is_validated():
    from hpctrain.config import TrainConfig, apply_override, validate
    from hpctrain.errors import ConfigError

    cfg = apply_override(TrainConfig(), "monitor.slow_rank_factor=1.5")
    assert validate(cfg, need_data=False).monitor.slow_rank_factor == 1.5
    for override, words in (("monitor.progress=bars", "did you mean monitor.progress = 'bar'"),
                            ("monitor.slow_rank_factor=0.9", "must be > 1"),
                            ("monitor.slow_rank_window=0", "must be > 0"),
                            ("monitor.gather_every=-1", "must be >= 0")):
        with pytest.raises(ConfigError, match=words):
            validate(apply_override(TrainConfig(), override), need_data=False)
    # every field is one the Monitor reads (horovod_timeline: the trainer, via backend.start_timeline)
    from dataclasses import fields

    from hpctrain.config import MonitorConfig
    assert {f.name for f in fields(MonitorConfig)} == {
        "log_every", "progress", "gather_every", "slow_rank_factor", "slow_rank_window",
        "slow_rank_min_seconds", "consistency_every", "tensorboard", "horovod_timeline"}


def test_tensorboard_when_asked(tmp_path):
    """Events when TensorBoard is installed; otherwise one warning and metrics.jsonl alone."""
    pytest.importorskip("torch")
    from mpi4py import MPI

    from hpctrain.state import TrainState

    try:
        import torch.utils.tensorboard  # noqa: F401
        available = True
    except ImportError:
        available = False
    out = io.StringIO()
    monitor = Monitor(tmp_path, MPI.COMM_SELF, log_every=1, progress="log", tensorboard=True, stream=out)
    state = TrainState(None, None)
    state.progress.step = 1
    monitor.on_step(state, {"loss": 0.5}, {"data": 0.001})
    monitor.on_end(state)
    assert (tmp_path / "metrics.jsonl").read_text().count('"kind": "train"') == 1
    if available:
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    else:
        assert "TensorBoard cannot be imported" in out.getvalue() and "pip install tensorboard" in out.getvalue()


def _strict(line):
    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl: {line}")

    return json.loads(line, parse_constant=refuse)


def test_nonfinite_metrics_are_shown_as_nan_and_written_as_null(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path, ["n0"], log_every=2, gather_every=100, progress="log", stream=out)
    for step, loss in ((1, 0.5), (2, float("nan"))):
        log.on_step(SimpleNamespace(step=step, epoch=0), {"loss": loss, "lr": 0.1}, {"step": 0.01}, 1.0)
    log.on_eval(SimpleNamespace(step=2, epoch=0), {"val_loss": float("inf"), "val_accuracy": float("nan")})
    log.on_nonfinite(SimpleNamespace(step=2, epoch=0), {"step": 2, "action": "skip", "tensor": "0.weight (NaN)",
                                                        "policy": "auto", "consecutive": 1, "rollbacks": 0})
    log.end(SimpleNamespace(step=2, epoch=0))
    records = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] is None and "loss" in train[-1]
    (ev,) = [r for r in records if r["kind"] == "eval"]
    assert ev["val_loss"] is None and ev["val_accuracy"] is None
    (nf,) = [r for r in records if r["kind"] == "nonfinite"]
    assert (nf["step"], nf["action"], nf["tensor"]) == (2, "skip", "0.weight (NaN)")
    text = out.getvalue()
    assert "eval at step 2 epoch 0: val_loss inf val_accuracy nan" in text
    assert "step 2 epoch 0 loss nan" in text
    assert "step 2: non-finite gradients (first: 0.weight (NaN)); update skipped (1 in a row)" in text


def test_progress_line_and_record_carry_the_highest_peak_memory_of_any_rank():
    import numpy as np

    from hpctrain.monitoring.display import format_line
    from hpctrain.monitoring.runlog import timing_fields
    from hpctrain.monitoring.timing import FIELDS, PhaseTotals

    table = np.zeros((3, len(FIELDS)))
    table[:, PhaseTotals.STEPS] = 1
    table[:, PhaseTotals.PEAK_RSS] = [100 * 2 ** 20, 300 * 2 ** 20, 200 * 2 ** 20]
    fields, _ = timing_fields(table, ["a", "b", "c"], 0.0)
    assert fields["memory"] == {"peak_rss_mib_max": 300.0, "rank": 1, "host": "b"}
    assert [r["peak_rss_mib"] for r in fields["ranks"]] == [100.0, 300.0, 200.0]
    assert "peak mem 300 MiB/rank" in format_line(10, 100, 0, memory_mib=300.4)
