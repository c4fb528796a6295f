"""What a checkpoint holds, with no file opened: the lowest level of :mod:`hpctrain.checkpoint`, which the
writer, the reader, the planners and the node-local level all share. Lowest first:

    format     names, layout, version, dtype encoding, CRC-32, how datasets are shared out among ranks (pure)
    metadata   the attributes of ``/`` (which job wrote it, when, versions) and the process's random generators
    snapshot   a TrainState to the arrays and attributes of a file, and back into one
    plan       a file's WritePlan: who writes which region; a rank's checksums and NaN checks; a background copy
    readplan   a load's ReadPlan, the plan's mirror: which region goes into which array, with which checksum
"""
