"""What a planner outside this package (``hpctrain.parallel.checkpoint``, for split models) uses of it, and
all it may use: the file format, the conversion of tensors, the write and read plans, the save pipeline that
writes a :class:`WritePlan` (:func:`begin`, :func:`write_into_place`) and the read path that carries out a
:class:`ReadPlan` (:func:`read`). The structure test holds ``hpctrain.parallel`` to this module."""
from . import format as fmt
from . import snapshot
from .commit import begin, write_into_place
from .consistency import check_consistency
from .plan import DatasetPlan, WritePlan
from .reader import read, read_header
from .readplan import ReadPlan, RegionRead, plan_checksums
from .writer import h5py_parallel

__all__ = ["fmt", "snapshot", "begin", "write_into_place", "check_consistency", "DatasetPlan", "WritePlan",
           "read", "read_header", "ReadPlan", "RegionRead", "plan_checksums", "h5py_parallel"]
