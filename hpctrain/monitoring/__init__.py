"""Watching a run: per-step phase timings (``timing``), the monitor callback that gathers
them across ranks (``monitor``), the slow-rank rule (``slownodes``), what rank 0 shows
(``display``), and the plots of a finished run (``report``)."""
