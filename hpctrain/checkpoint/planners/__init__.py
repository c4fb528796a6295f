"""Who writes and reads which part of a checkpoint file, per kind of state: a planner makes a save's
WritePlan and loads a file back. The manager is handed one; split models' is
``hpctrain.parallel.checkpoint.SplitPlanner``. Lowest first:

    sharded     ``comm.shard`` states: each rank writes the rows of its optimizer slice, in the ordinary format
    replicated  data-parallel states: ReplicatedPlanner (the default), save_checkpoint, load_checkpoint,
                verify_checkpoint
"""
