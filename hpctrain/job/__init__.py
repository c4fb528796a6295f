"""Job control: a run on the cluster, from its run directory to its relaunch.

* :mod:`.rundir`: the run directory, and the names of its files;
* :mod:`.runlock`: one job per run (and checkpoint) directory: the lock file, its owner, its takeover;
* :mod:`.preemption`: Slurm's warning signal becomes a checkpoint and exit status 3; its command
  ``python -m hpctrain.job.preemption requeue`` requeues the job (``slurm/preemptible.sbatch`` runs it);
* :mod:`.watchdog`: hang detection: a step or collective phase that runs far too long aborts the job;
* :mod:`.launchers`: the ``mpirun`` and ``srun`` command lines of ``hpctrain launch``, and one launch run;
* :mod:`.diagnosis`: what failed in a launch (the ranks' records, the launcher's output), and if a relaunch helps;
* :mod:`.plan`: what every launch of an ``hpctrain launch`` job runs, checked before anything starts;
* :mod:`.relaunch`: ``hpctrain launch``'s supervision: launch, read what failed, relaunch or stop;
* :mod:`.spares`: warm spare ranks: the next launch started ahead of need, called on a failure;
* :mod:`.warmpool`: the warm pool: one process with a rank's imports done, from which ``hpctrain launch`` forks
  the ranks of its host (``python -m hpctrain`` asks it first);
* :mod:`.survivor`: when a rank dies, a rank that survives it writes the state of its last step (the pool asks, or
  the supervisor under srun);
* :mod:`.poolsocket`: the messages between the warm pool, its ranks and the supervisor;
* :mod:`.standby`: ``python -m hpctrain.job.standby``, a supervisor on a second node that takes the job over
  when Slurm loses its first node (``slurm/resilient.sbatch`` starts it).
"""
