"""Watching a run: per-step phase timings and their per-rank sums (``timing``), the monitor callback that
gathers them across ranks (``monitor``), rank 0's records and display (``runlog``, ``display``), the slow-rank
rule (``slownodes``), and the plots of a finished run (``report``)."""
