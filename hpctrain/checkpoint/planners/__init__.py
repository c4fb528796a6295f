"""Who writes and reads which part of a checkpoint file, per kind of state: a planner makes a save's
WritePlan and a load's ReadPlan, which ``io.reader.read`` carries out. The manager is handed one; split models' is
``hpctrain.parallel.checkpoint.SplitPlanner``. Lowest first:

    consistency whether the replicas of a model still agree, checked before a save (``checkpoint.consistency``)
    sharded     ``comm.shard`` states: ShardedPlanner; each rank writes and reads the rows of its optimizer slice
    replicated  data-parallel states: ReplicatedPlanner, DataParallelPlanner (the default: sharded or replicated
                by the state), save_checkpoint, load_checkpoint, verify_checkpoint
"""
