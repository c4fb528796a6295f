"""Rank 0's part of monitoring: the progress display, ``<run_dir>/metrics.jsonl`` (and TensorBoard), the
statistics of each logging interval, and the slow-rank and diverged-replica reports. Only rank 0 builds a
:class:`RunLog`. :class:`~.monitor.Monitor` holds it as ``monitor.root`` (``None`` on every other rank) and
hands it what its collectives gathered, so nothing here communicates."""
import json
import math
import time
import zlib
from pathlib import Path

import numpy as np

from ..job.rundir import METRICS_FILE
from ..runtime.replicas import divergent_ranks
from ..runtime.startup import forked, process_started, was_called
from .display import ProgressDisplay
from .slownodes import SlowRankDetector, work_seconds
from .timing import PHASES, PhaseTotals as T


def _number(value):
    """A JSON-safe float (tensors read here, NaN and inf become None)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _shown(value):
    """A float for display (NaN and inf kept), or the value itself if it is no number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class MetricsWriter:
    """One JSON object per line in ``metrics.jsonl``, TensorBoard optionally."""

    def __init__(self, run_dir, tensorboard=False, warn=print):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.file = open(self.path, "a", buffering=1)  # appended: a resumed run continues it
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                warn(f"monitor: tensorboard = true, but TensorBoard cannot be imported ({exc}); "
                     f"writing metrics.jsonl only.\nHINT: pip install tensorboard")
            else:
                self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def write(self, record):
        self.file.write(json.dumps(record, allow_nan=False, default=str) + "\n")

    def scalars(self, prefix, values, step):
        if self.tb is None:
            return
        for name, value in values.items():
            if isinstance(value, (int, float)):
                self.tb.add_scalar(f"{prefix}/{name}", value, step)

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def timing_fields(table, hosts, gather_seconds):
    """From one gather of every rank's :class:`~.timing.PhaseTotals` (a ``(ranks, FIELDS)`` array): the
    ``phases``, ``ranks`` and ``gather`` fields of the next ``train`` record, and the ``(ranks, phases)``
    seconds per step for the slow-rank rule (pure)."""
    steps = np.maximum(table[:, T.STEPS], 1)
    phase_means = table[:, T.PHASE0:T.OTHER] / steps[:, None]
    step_time = table[:, T.WALL] / steps
    work = work_seconds(phase_means)
    ranks = []
    for r in range(len(table)):
        row = {"rank": r, "host": hosts[r], "step_time": float(step_time[r]),
               "step_time_max": float(table[r, T.WALL_MAX]), "work": float(work[r])}
        row.update({p: float(phase_means[r, i]) for i, p in enumerate(PHASES)})
        row["other"] = float(table[r, T.OTHER] / steps[r])
        row["peak_rss_mib"] = float(table[r, T.PEAK_RSS]) / 2 ** 20
        ranks.append(row)
    top = int(np.argmax(table[:, T.PEAK_RSS]))
    interval_seconds = float(table[0, T.WALL])
    return {
        "phases": {p: {"mean": float(phase_means[:, i].mean()), "max": float(phase_means[:, i].max())}
                   for i, p in enumerate(PHASES)},
        "ranks": ranks,
        # the highest resident memory any rank has reached so far: what a memory limit meets
        "memory": {"peak_rss_mib_max": ranks[top]["peak_rss_mib"], "rank": top, "host": hosts[top]},
        "gather": {"seconds": gather_seconds, "max_seconds_prev": float(table[:, T.GATHER].max()),
                   "steps": int(table[0, T.STEPS]),
                   # the gather's cost against the steps it covers
                   "fraction": gather_seconds / interval_seconds if interval_seconds > 0 else None,
                   "mean_step_time": float(step_time.mean())},
    }, phase_means


class RunLog:
    """What rank 0 shows and writes. ``hosts``: the node of every rank. Writes the ``start``
    record when built; :meth:`end` writes the last records and closes the files."""

    def __init__(self, run_dir, hosts, *, log_every, gather_every, total_steps=None,
                 samples_per_step=None, progress="auto", detector=None, tensorboard=False, stream=None,
                 startup=None, start_step=None):
        self.hosts, self.log_every, self.samples_per_step = hosts, log_every, samples_per_step
        self.display = ProgressDisplay(progress, total_steps, stream)
        self.writer = MetricsWriter(run_dir, tensorboard, warn=self.display.message)
        self.detector = detector or SlowRankDetector()
        self.started = time.time()
        self.interval = self._new_interval(start=None)  # the first starts with its first step
        self.timings = None  # the latest gather's fields, for the next train record
        self.diverged = []  # the ranks last reported as diverged
        self.writer.write({"kind": "start", "timestamp": self.started, "ranks": len(hosts),
                           "hosts": hosts, "phases": list(PHASES), "gather_every": gather_every,
                           "log_every": log_every, "total_steps": total_steps,
                           # rank 0's start-up, part by part (hpctrain.runtime.startup): what a relaunch pays
                           "process_started": process_started(), "startup": dict(startup or {}),
                           "spare": was_called(),  # a warm spare set, called: started before it was needed
                           "forked": forked(),  # from the warm pool (hpctrain.job.warmpool): imports done there
                           "step": start_step})  # where it starts: after a restart, the step it resumed

    def _times(self):
        now = time.time()
        return {"time": now - self.started, "timestamp": now}

    @staticmethod
    def _new_interval(start):
        return {"steps": 0, "loss_sum": 0.0, "loss_n": 0, "samples": 0.0, "lr": None, "start": start}

    # ------------------------------------------------------------------ the callbacks' rank-0 share
    def on_step(self, progress, metrics, phase_times, now, timings=None, fingerprints=None):
        """A step ended, its callbacks began at ``now``. ``timings`` (``(table, gather_seconds)``)
        and ``fingerprints`` (every rank's): what was gathered at this step, if anything."""
        iv = self.interval
        if iv["start"] is None:  # when the first step began (not construction: data and model come between)
            own = phase_times.get("step") or sum(float(v or 0.0) for k, v in phase_times.items() if k != "step")
            iv["start"] = now - float(own)
        iv["steps"] += 1
        loss = metrics.get("loss")
        if loss is not None:
            # a tensor stays on its device until the interval is written: no sync per step
            loss = loss.detach() if hasattr(loss, "detach") else loss
            iv["loss_sum"] = iv["loss_sum"] + loss
            iv["loss_n"] += 1
        if metrics.get("lr") is not None:
            iv["lr"] = metrics["lr"]
        samples = metrics.get("samples", self.samples_per_step)
        if samples is not None:
            iv["samples"] += float(samples)
        self.display.step(progress.step, progress.epoch, loss)
        if timings is not None:
            self._digest(progress.step, *timings)
        if fingerprints is not None:
            self._compare_replicas(progress.step, fingerprints)
        if progress.step % self.log_every == 0:
            self._write_interval(progress.step, progress.epoch)

    def on_eval(self, progress, metrics):
        # A non-finite metric stays: shown as nan, written as null (JSON has no NaN).
        shown = {k: _shown(v) for k, v in metrics.items() if k not in ("step", "epoch", "kind")}
        values = {k: _number(v) for k, v in shown.items()}
        self.writer.write({"kind": "eval", "step": progress.step, "epoch": progress.epoch, **self._times(),
                           **values})
        self.writer.scalars("eval", values, progress.step)
        text = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        self.display.message(f"eval at step {progress.step} epoch {progress.epoch}: {text}")

    def on_nonfinite(self, progress, event):
        """The trainer found non-finite averaged gradients (see ``train.on_nonfinite``)."""
        self.writer.write({"kind": "nonfinite", "epoch": progress.epoch, **self._times(),
                           **{k: _number(v) if isinstance(v, float) else v for k, v in event.items()}})
        action = {"skip": f"update skipped ({event.get('consecutive')} in a row)",
                  "rollback": f"rolled back to step {event.get('to_step')}, learning rate x "
                              f"{event.get('lr_factor', 1.0):g} (rollback {event.get('rollbacks')})",
                  "stop": "training stops"}.get(event.get("action"), event.get("action"))
        self.display.message(f"hpctrain: warning: step {event.get('step')}: non-finite gradients (first: "
                             f"{event.get('tensor')}); {action}")

    def on_early_stop(self, progress, event):
        self.writer.write({"kind": "early_stop", "epoch": progress.epoch, **self._times(),
                           **{k: _number(v) if isinstance(v, float) else v for k, v in event.items()}})

    def on_checkpoint(self, progress, path, seconds):
        self.writer.write({"kind": "checkpoint", "step": progress.step, "epoch": progress.epoch,
                           **self._times(), "path": str(path), "seconds": _number(seconds)})

    def end(self, progress, timings=None):
        """The last gather's timings (if any steps were left), the last interval, ``end``."""
        if timings is not None:
            self._digest(progress.step, *timings)
        if self.interval["steps"]:
            self._write_interval(progress.step, progress.epoch)
        self.writer.write({"kind": "end", "step": progress.step, "epoch": progress.epoch, **self._times()})
        self.display.close()
        self.writer.close()

    # ------------------------------------------------------------------ parts
    def _write_interval(self, step, epoch):
        iv, now = self.interval, time.perf_counter()
        elapsed = now - iv["start"]
        steps = iv["steps"]
        shown_loss = _shown(iv["loss_sum"] / iv["loss_n"]) if iv["loss_n"] else None  # nan stays nan
        record = {"kind": "train", "step": step, "epoch": epoch, **self._times(), "steps": steps,
                  "loss": _number(shown_loss), "lr": _number(iv["lr"]),
                  "step_time": elapsed / steps if steps else None,
                  "steps_per_s": steps / elapsed if elapsed > 0 else None,
                  "samples_per_s": iv["samples"] / elapsed if elapsed > 0 and iv["samples"] else None}
        if self.timings is not None:
            record.update(self.timings)
            self.timings = None
        self.writer.write(record)
        self.writer.scalars("train", {k: record[k] for k in ("loss", "lr", "samples_per_s", "step_time")}, step)
        self.writer.scalars("phase_mean", {p: stats["mean"] for p, stats in record.get("phases", {}).items()}, step)
        self.display.interval(step, epoch, shown_loss, record["lr"], record["samples_per_s"], record["step_time"],
                              record.get("memory", {}).get("peak_rss_mib_max"))
        self.interval = self._new_interval(start=time.perf_counter())

    def _digest(self, step, table, gather_seconds):
        self.timings, phase_means = timing_fields(table, self.hosts, gather_seconds)
        for finding in self.detector.update(phase_means, self.hosts, step):
            self.display.message(f"hpctrain: warning: {finding.message()}")
            self.writer.write({"kind": "slow_rank", **self._times(), **finding.as_dict()})

    def _compare_replicas(self, step, fingerprints):
        reference, diverged = divergent_ranks(fingerprints)
        if diverged and diverged != self.diverged:  # said once per new set of ranks
            where = ", ".join(f"{r} ({self.hosts[r]})" for r in diverged)
            self.display.message(
                f"hpctrain: warning: parameters differ across ranks at step {step}: rank(s) {where} "
                f"disagree with ranks {reference}. Data-parallel replicas must stay identical; training "
                f"on diverged replicas averages gradients of different models.\n"
                f"HINT: restart from the last checkpoint; if it happens again, look for a rank that "
                f"skipped the initial broadcast or a non-deterministic parameter update")
            self.writer.write({"kind": "divergence", "step": step, **self._times(), "ranks": diverged,
                               "reference_ranks": reference,
                               # per rank, [sum, crc] over its tensors' (sum, crc) fingerprints
                               "checksums": [[sum(s for s, _ in f), zlib.crc32(np.asarray(f, np.int64).tobytes())]
                                             for f in fingerprints]})
        self.diverged = diverged
