"""Who writes and reads which part of a checkpoint file, per kind of state: a planner makes a save's
WritePlan and a load's ReadPlan, which ``io.reader.read`` carries out. The manager is handed one; split models' is
``hpctrain.parallel.checkpoint.SplitPlanner``, which uses this package through the names below, and only
those (the structure test holds ``hpctrain.parallel`` to them): the file format, the conversion of tensors,
the write and read plans, the save pipeline that writes a WritePlan (``begin``, ``write_into_place``) and
the read path that carries out a ReadPlan (``read``). Lowest first:

    consistency whether the replicas of a model still agree, checked before a save (``checkpoint.consistency``)
    sharded     ``comm.shard`` states: ShardedPlanner; each rank writes and reads the rows of its optimizer slice
    replicated  data-parallel states: ReplicatedPlanner, DataParallelPlanner (the default: sharded or replicated
                by the state), save_checkpoint, load_checkpoint, verify_checkpoint
"""
from ..commit import begin, write_into_place
from ..content import format as fmt
from ..content import snapshot
from ..content.plan import DatasetPlan, WritePlan
from ..content.readplan import ReadPlan, RegionRead, plan_checksums
from ..io.reader import read, read_header
from ..io.writer import h5py_parallel
from .consistency import check_consistency

__all__ = ["fmt", "snapshot", "begin", "write_into_place", "check_consistency", "DatasetPlan", "WritePlan",
           "read", "read_header", "ReadPlan", "RegionRead", "plan_checksums", "h5py_parallel"]
