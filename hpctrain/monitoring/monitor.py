"""Watching a run: progress on rank 0, per-rank phase timings, slow nodes, parameter
consistency across ranks, and ``<run_dir>/metrics.jsonl`` for ``hpctrain report``.

:class:`Monitor` is a trainer callback (``on_step``, ``on_eval``, ``on_end``). It is built on
every rank, and every rank must call it at the same steps: every ``gather_every`` steps it
does one ``Gather`` of a fixed-size float64 array (a few numbers per phase) to rank 0, and
every ``consistency_every`` steps one more of two numbers. Nothing is communicated in the
other steps. Rank 0 alone prints and writes files.

Example (what the trainer does)::

    from hpctrain.monitoring.monitor import build_callbacks
    callbacks = build_callbacks(cfg.monitor, run_dir, comm=world.comm, total_steps=max_steps,
                                samples_per_step=global_batch)
    for cb in callbacks:
        cb.on_step(state, {"loss": loss, "lr": lr}, timer.last)   # every step, every rank

The ``metrics`` keys read by ``on_step``: ``loss`` (float or 0-d tensor, this rank's),
``lr``, ``samples`` (global samples in this step; else ``samples_per_step``), and
``checkpoint`` (present only in a step that saved one: a dict with ``seconds`` and ``path``,
or just the path; the save time then comes from the ``checkpoint`` phase).
"""
import json
import math
import os
import socket
import time
import zlib
from pathlib import Path

import numpy as np

from .display import ProgressDisplay
from .slownodes import PHASES, WORK_PHASES, SlowRankDetector

# Per-rank numbers gathered every ``gather_every`` steps, in this order.
FIELDS = ("steps", "wall_sum", "wall_max") + tuple(f"{p}_sum" for p in PHASES) + ("other_sum", "gather_s")
_STEPS, _WALL, _WALL_MAX = 0, 1, 2
_PHASE0 = 3
_OTHER = _PHASE0 + len(PHASES)
_GATHER = _OTHER + 1

METRICS_FILE = "metrics.jsonl"
TIMELINE_FILE = "horovod_timeline.json"


def timeline_env(run_dir, cfg):
    """Environment to set before ``hvd.init()`` when ``horovod_timeline = true``.

    Horovod reads ``HOROVOD_TIMELINE`` once, at init, so the backend applies this first::

        os.environ.update(timeline_env(run_dir, cfg.monitor))
        hvd.init()
    """
    if not getattr(cfg, "horovod_timeline", False):
        return {}
    return {"HOROVOD_TIMELINE": str(Path(run_dir) / TIMELINE_FILE)}


def param_checksum(model, sample=1024):
    """``[float64 sum of all parameters, crc32 of a strided sample of their bytes]``.

    Replicas of a data-parallel model are bitwise equal, so both numbers must be equal on
    every rank. The sum sees every element (a change anywhere moves it); the crc catches
    changes that keep the sum, in the sampled elements. One device-to-host copy in all.
    """
    import torch

    sums, pieces = [], []
    with torch.no_grad():
        for p in model.parameters():  # the same order on every rank
            flat = p.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            sums.append(torch.sum(flat, dtype=torch.float64))
            stride = max(1, flat.numel() // sample)
            pieces.append(flat[::stride].contiguous().view(torch.uint8))
    if not sums:
        return np.zeros(2)
    total = float(torch.stack(sums).sum())
    crc = zlib.crc32(torch.cat(pieces).cpu().numpy().tobytes())
    return np.array([total, float(crc)])


def divergent_ranks(checksums):
    """``(reference_ranks, divergent_ranks)``: the largest group of equal checksums is the
    reference (ties: the group of rank 0); every other rank diverged (pure)."""
    groups = {}
    for rank, row in enumerate(np.asarray(checksums)):
        groups.setdefault(tuple(float(x) for x in row), []).append(rank)
    reference = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    return reference, sorted(r for ranks in groups.values() if ranks is not reference for r in ranks)


def _number(value):
    """A JSON-safe float (tensors read here, NaN and inf become None)."""
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricsWriter:
    """Rank 0's sink: one JSON object per line in ``metrics.jsonl``, TensorBoard optionally."""

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
            if isinstance(value, (int, float)) and value is not None:
                self.tb.add_scalar(f"{prefix}/{name}", value, step)

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Monitor:
    """The monitoring callback; see the module docstring. Constructing it is collective."""

    def __init__(self, run_dir, comm=None, *, log_every=50, progress="auto", gather_every=0,
                 slow_rank_factor=1.3, slow_rank_window=3, slow_rank_min_seconds=0.005,
                 consistency_every=0, tensorboard=False, total_steps=None, samples_per_step=None,
                 node=None, stream=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        # A private communicator: our gathers can never match another module's collectives.
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.log_every = max(1, int(log_every))
        self.gather_every = int(gather_every) if gather_every else self.log_every
        self.consistency_every = int(consistency_every or 0)
        self.samples_per_step = samples_per_step
        node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.hosts = self.comm.allgather(node)  # once: names for the slow-rank reports
        self.acc = np.zeros(len(FIELDS))
        self.last_step_end = None
        self.started = time.time()
        self.is_root = self.rank == 0
        # Rank-0 role: the others have no progress, detector or files.
        self.progress = self.writer = self.detector = None
        if self.is_root:
            self.progress = ProgressDisplay(progress, total_steps, stream)
            self.writer = MetricsWriter(run_dir, tensorboard, warn=self.progress.message)
            self.detector = SlowRankDetector(slow_rank_factor, slow_rank_window, slow_rank_min_seconds)
            self.interval = self._new_interval()
            self.latest_gather = None
            self.diverged = []
            self.writer.write({"kind": "start", "timestamp": self.started, "ranks": self.size,
                               "hosts": self.hosts, "phases": list(PHASES),
                               "gather_every": self.gather_every, "log_every": self.log_every,
                               "total_steps": total_steps})

    @classmethod
    def from_config(cls, cfg, run_dir, comm=None, **kwargs):
        """Build from a ``[monitor]`` config section (:class:`hpctrain.config.MonitorConfig`)."""
        names = ("log_every", "progress", "gather_every", "slow_rank_factor", "slow_rank_window",
                 "slow_rank_min_seconds", "consistency_every", "tensorboard")
        options = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        options.update(kwargs)
        return cls(run_dir, comm, **options)

    # ------------------------------------------------------------------ callbacks
    def on_step(self, state, metrics, phase_times):
        now = time.perf_counter()
        step, epoch = state.progress.step, state.progress.epoch
        known = [float(phase_times.get(p, 0.0) or 0.0) for p in PHASES]
        # "step" (the timer's own wall time) is a total, not a phase
        other = sum(float(v or 0.0) for k, v in phase_times.items() if k not in PHASES and k != "step")
        # Between two calls is the whole step as this rank lived it; the first call has
        # only the phases to go by.
        wall = now - self.last_step_end if self.last_step_end is not None else sum(known) + other
        self.acc[_STEPS] += 1
        self.acc[_WALL] += wall
        self.acc[_WALL_MAX] = max(self.acc[_WALL_MAX], wall)
        self.acc[_PHASE0:_OTHER] += known
        self.acc[_OTHER] += other
        if self.is_root:
            if self.last_step_end is None:
                # the first interval starts when its first step did, not at construction
                # (data loading, model build and broadcast come in between)
                self.interval["start"] = now - float(phase_times.get("step") or wall)
            self._root_step(step, epoch, metrics, phase_times)
        if step % self.gather_every == 0:
            self._gather(step)
        if self.consistency_every and step % self.consistency_every == 0:
            self._check_consistency(state.model, step)
        if self.is_root and step % self.log_every == 0:
            self._write_interval(step, epoch)
        # The monitor's own time (gathers, writing) is measured apart, not as step time.
        self.last_step_end = time.perf_counter()

    def on_eval(self, state, metrics):
        if not self.is_root:
            return
        values = {k: _number(v) for k, v in metrics.items()}
        values = {k: v for k, v in values.items() if v is not None and k not in ("step", "epoch", "kind")}
        step = state.progress.step
        self.writer.write({"kind": "eval", "step": step, "epoch": state.progress.epoch,
                           "time": time.time() - self.started, "timestamp": time.time(), **values})
        self.writer.scalars("eval", values, step)
        text = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        self.progress.message(f"eval at step {step} epoch {state.progress.epoch}: {text}")

    def on_checkpoint(self, state, path, seconds):
        """A checkpoint was saved (at a step, an epoch end, the end, or on request)."""
        if self.is_root:
            self._write_checkpoint(state.progress.step, state.progress.epoch,
                                   {"path": str(path), "seconds": seconds}, {})

    def on_end(self, state):
        """Collective: gathers the steps since the last gather, writes the last lines."""
        step = state.progress.step
        if self.acc[_STEPS] > 0:
            self._gather(step)
        if self.is_root:
            if self.interval["steps"]:
                self._write_interval(step, state.progress.epoch)
            self.writer.write({"kind": "end", "step": step, "epoch": state.progress.epoch,
                               "time": time.time() - self.started, "timestamp": time.time()})
            self.progress.close()
            self.writer.close()
        self.comm.Free()

    # ------------------------------------------------------------------ rank 0
    @staticmethod
    def _new_interval():
        return {"steps": 0, "loss_sum": 0.0, "loss_n": 0, "samples": 0.0, "lr": None,
                "start": time.perf_counter()}

    def _root_step(self, step, epoch, metrics, phase_times):
        iv = self.interval
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
        if metrics.get("checkpoint") is not None:
            self._write_checkpoint(step, epoch, metrics["checkpoint"], phase_times)
        self.progress.step(step, epoch, loss)

    def _write_checkpoint(self, step, epoch, info, phase_times):
        record = {"kind": "checkpoint", "step": step, "epoch": epoch,
                  "time": time.time() - self.started, "timestamp": time.time()}
        if isinstance(info, dict):
            record.update({k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                           for k, v in info.items()})
        else:
            record["path"] = str(info)
        if record.get("seconds") is None:
            record["seconds"] = _number(phase_times.get("checkpoint"))
        self.writer.write(record)

    def _write_interval(self, step, epoch):
        iv, now = self.interval, time.perf_counter()
        elapsed = now - iv["start"]
        steps = iv["steps"]
        loss = _number(iv["loss_sum"] / iv["loss_n"]) if iv["loss_n"] else None
        record = {"kind": "train", "step": step, "epoch": epoch, "time": time.time() - self.started,
                  "timestamp": time.time(), "steps": steps, "loss": loss, "lr": _number(iv["lr"]),
                  "step_time": elapsed / steps if steps else None,
                  "steps_per_s": steps / elapsed if elapsed > 0 else None,
                  "samples_per_s": iv["samples"] / elapsed if elapsed > 0 and iv["samples"] else None}
        if self.latest_gather is not None:
            record.update(self.latest_gather)
            self.latest_gather = None
        self.writer.write(record)
        self.writer.scalars("train", {k: record[k] for k in ("loss", "lr", "samples_per_s", "step_time")}, step)
        for phase, stats in record.get("phases", {}).items():
            self.writer.scalars("phase_mean", {phase: stats["mean"]}, step)
        self.progress.interval(step, epoch, loss, record["lr"], record["samples_per_s"], record["step_time"])
        self.interval = self._new_interval()

    # ------------------------------------------------------------------ collectives
    def _gather(self, step):
        table = np.empty((self.size, len(FIELDS))) if self.is_root else None
        start = time.perf_counter()
        self.comm.Gather(self.acc, table, root=0)
        seconds = time.perf_counter() - start
        # each rank's gather time travels with its next gather
        self.acc[:] = 0.0
        self.acc[_GATHER] = seconds
        if self.is_root:
            self._digest(table, step, seconds)

    def _digest(self, table, step, gather_seconds):
        steps = np.maximum(table[:, _STEPS], 1)
        phase_means = table[:, _PHASE0:_OTHER] / steps[:, None]
        step_time = table[:, _WALL] / steps
        work = phase_means[:, [PHASES.index(p) for p in WORK_PHASES]].sum(axis=1)
        ranks = []
        for r in range(self.size):
            row = {"rank": r, "host": self.hosts[r], "step_time": float(step_time[r]),
                   "step_time_max": float(table[r, _WALL_MAX]), "work": float(work[r])}
            row.update({p: float(phase_means[r, i]) for i, p in enumerate(PHASES)})
            row["other"] = float(table[r, _OTHER] / steps[r])
            ranks.append(row)
        mean_step = float(step_time.mean())
        interval_seconds = float(table[0, _WALL])
        self.latest_gather = {
            "phases": {p: {"mean": float(phase_means[:, i].mean()), "max": float(phase_means[:, i].max())}
                       for i, p in enumerate(PHASES)},
            "ranks": ranks,
            "gather": {"seconds": gather_seconds, "max_seconds_prev": float(table[:, _GATHER].max()),
                       "steps": int(table[0, _STEPS]),
                       # the gather's cost against the steps it covers
                       "fraction": gather_seconds / interval_seconds if interval_seconds > 0 else None,
                       "mean_step_time": mean_step},
        }
        for finding in self.detector.update(phase_means, self.hosts, step):
            self.progress.message(f"hpctrain: warning: {finding.message()}")
            self.writer.write({"kind": "slow_rank", "timestamp": time.time(),
                               "time": time.time() - self.started, **finding.as_dict()})

    def _check_consistency(self, model, step):
        mine = param_checksum(model)
        table = np.empty((self.size, 2)) if self.is_root else None
        self.comm.Gather(mine, table, root=0)
        if not self.is_root:
            return
        reference, diverged = divergent_ranks(table)
        if diverged and diverged != self.diverged:  # said once per new set of ranks
            where = ", ".join(f"{r} ({self.hosts[r]})" for r in diverged)
            self.progress.message(
                f"hpctrain: warning: parameters differ across ranks at step {step}: rank(s) {where} "
                f"disagree with ranks {reference}. Data-parallel replicas must stay identical; training "
                f"on diverged replicas averages gradients of different models.\n"
                f"HINT: restart from the last checkpoint; if it happens again, look for a rank that "
                f"skipped the initial broadcast or a non-deterministic parameter update")
            self.writer.write({"kind": "divergence", "step": step, "timestamp": time.time(),
                               "time": time.time() - self.started, "ranks": diverged,
                               "reference_ranks": reference,
                               "checksums": [[float(x) for x in row] for row in table]})
        self.diverged = diverged


def build_callbacks(cfg, run_dir, comm=None, total_steps=None, samples_per_step=None):
    """The monitoring callbacks for the trainer, from the ``[monitor]`` config section."""
    return [Monitor.from_config(cfg, run_dir, comm, total_steps=total_steps,
                                samples_per_step=samples_per_step)]
