"""Watching a run: progress on rank 0, per-rank phase timings, slow nodes, parameter consistency across ranks,
and ``<run_dir>/metrics.jsonl`` for ``hpctrain report``. :class:`Monitor` is a trainer callback (``on_step``,
``on_eval``, ``on_checkpoint``, ``on_end``) built on every rank. Each rank adds up its own step times
(:class:`~.timing.PhaseTotals`); every ``gather_every`` steps one ``Gather`` of those sums (a fixed-size
float64 row) goes to rank 0, and every ``consistency_every`` steps one gather of each rank's
:func:`~hpctrain.runtime.replicas.parameter_fingerprints`. Nothing is communicated in the other steps; every
rank must call ``on_step`` at the same steps. ``monitor.root`` is rank 0's :class:`~.runlog.RunLog`, which
alone prints and writes files (``None`` on the other ranks). What the trainer does::

    callbacks = build_callbacks(cfg.monitor, run_dir, comm=world.comm, total_steps=max_steps,
                                samples_per_step=global_batch)
    for cb in callbacks:
        cb.on_step(state, {"loss": loss, "lr": lr}, timer.times())   # every step, every rank
    ...
    for cb in callbacks:
        cb.on_end(state)                                              # every rank

The ``metrics`` keys read by ``on_step``: ``loss`` (float or 0-d tensor, this rank's), ``lr`` and ``samples``
(global samples in this step; else ``samples_per_step``). Saved checkpoints arrive through
``on_checkpoint(state, path, seconds)``."""
import time

import numpy as np

from ..runtime.replicas import parameter_fingerprints
from ..runtime.world import node_name
from .runlog import RunLog
from .slownodes import SlowRankDetector
from .timing import FIELDS, PhaseTotals, peak_rss_bytes


class Monitor:
    """The monitoring callback; see the module docstring. Constructing it is collective."""

    def __init__(self, run_dir, comm=None, *, log_every=50, progress="auto", gather_every=0,
                 slow_rank_factor=1.3, slow_rank_window=3, slow_rank_min_seconds=0.005,
                 consistency_every=0, tensorboard=False, total_steps=None, samples_per_step=None,
                 node=None, stream=None, startup=None, start_step=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        # A private communicator: our gathers can never match another module's collectives.
        self.comm = comm.Dup()
        log_every = max(1, int(log_every))
        self.gather_every = int(gather_every) if gather_every else log_every
        self.consistency_every = int(consistency_every or 0)
        self.totals = PhaseTotals()
        hosts = self.comm.allgather(node or node_name())  # once: names for the reports
        self.root = None
        if self.comm.Get_rank() == 0:
            self.root = RunLog(run_dir, hosts, log_every=log_every, gather_every=self.gather_every,
                               total_steps=total_steps, samples_per_step=samples_per_step, progress=progress,
                               detector=SlowRankDetector(slow_rank_factor, slow_rank_window, slow_rank_min_seconds),
                               tensorboard=tensorboard, stream=stream, startup=startup, start_step=start_step)

    # ------------------------------------------------------------------ callbacks
    def on_step(self, state, metrics, phase_times):
        """Collective at gather and consistency steps."""
        now = time.perf_counter()
        step = state.progress.step
        self.totals.add(phase_times, now)
        timings = self._gather_timings() if step % self.gather_every == 0 else None
        fingerprints = None
        if self.consistency_every and step % self.consistency_every == 0:
            fingerprints = self.comm.gather(parameter_fingerprints(state.model), root=0)
        if self.root is not None:
            self.root.on_step(state.progress, metrics, phase_times, now, timings, fingerprints)
        # The monitor's own time (gathers, writing) is measured apart, not as step time.
        self.totals.last_end = time.perf_counter()

    def on_eval(self, state, metrics):
        if self.root is not None:
            self.root.on_eval(state.progress, metrics)

    def on_checkpoint(self, state, path, seconds):
        """A checkpoint was saved (at a step, an epoch end, the end, or on request)."""
        if self.root is not None:
            self.root.on_checkpoint(state.progress, path, seconds)

    def on_nonfinite(self, state, event):
        """A step's averaged gradients were not finite; ``event``: step, action (skip, rollback,
        stop), tensor (the first parameter whose gradient is not finite), ..."""
        if self.root is not None:
            self.root.on_nonfinite(state.progress, event)

    def on_early_stop(self, state, event):
        """``train.early_stop_patience`` evaluations without improving: the run ends (``event``: step, metric,
        best, best_step, evaluations, patience)."""
        if self.root is not None:
            self.root.on_early_stop(state.progress, event)

    def on_end(self, state):
        """Collective: gathers the steps since the last gather; rank 0 writes the last lines."""
        timings = self._gather_timings() if self.totals.values[PhaseTotals.STEPS] else None
        if self.root is not None:
            self.root.end(state.progress, timings)
        self.comm.Free()

    def _gather_timings(self):
        """Collective: every rank's totals to rank 0, as ``(table, seconds)`` there, else None."""
        table = np.empty((self.comm.Get_size(), len(FIELDS))) if self.root is not None else None
        self.totals.values[PhaseTotals.PEAK_RSS] = peak_rss_bytes()
        start = time.perf_counter()
        self.comm.Gather(self.totals.values, table, root=0)
        seconds = time.perf_counter() - start
        self.totals.reset(seconds)  # each rank's gather time travels with its next gather
        return None if table is None else (table, seconds)


def build_callbacks(cfg, run_dir, comm=None, total_steps=None, samples_per_step=None, startup=None, start_step=None):
    """The monitoring callbacks for the trainer, from the ``[monitor]`` config section
    (:class:`hpctrain.config.MonitorConfig`; ``horovod_timeline`` is the trainer's)."""
    names = ("log_every", "progress", "gather_every", "slow_rank_factor", "slow_rank_window",
             "slow_rank_min_seconds", "consistency_every", "tensorboard")
    return [Monitor(run_dir, comm, total_steps=total_steps, samples_per_step=samples_per_step, startup=startup,
                    start_step=start_step, **{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})]
