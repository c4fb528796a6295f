"""Job control: the run directory and its lock (one job per run), Slurm's warning signals
and requeue (``preemption``), and hang detection (``watchdog``)."""
