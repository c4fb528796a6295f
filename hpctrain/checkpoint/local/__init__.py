"""The node-local checkpoint level (``checkpoint.local``): frequent snapshots into storage on each node
between the HDF5 files, a copy on the next node, and recovery that writes the newest complete snapshot as an
ordinary checkpoint file through the save pipeline. Lowest first:

    files      the part files (checksummed; complete or not taken), where copies go, which snapshot a
               recovery takes (no MPI)
    transfer   the level's messages: a part to its partner on the next node, a snapshot's parts to rank 0
    level      LocalLevel: when a snapshot is due, taking it, recovering from it
"""
