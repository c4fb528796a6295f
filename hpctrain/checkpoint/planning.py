"""What a planner outside this package (``hpctrain.parallel.checkpoint``, for split models) uses of it, and
all it may use: the file format, the conversion of tensors, the write and read plans, the save pipeline that
writes a :class:`WritePlan` (:func:`begin`, :func:`write_into_place`) and the read path that carries out a
:class:`ReadPlan` (:func:`read`). The structure test holds ``hpctrain.parallel`` to this module."""
from .commit import begin, write_into_place
from .content import format as fmt
from .content import snapshot
from .content.plan import DatasetPlan, WritePlan
from .content.readplan import ReadPlan, RegionRead, plan_checksums
from .io.reader import read, read_header
from .io.writer import h5py_parallel
from .planners.consistency import check_consistency

__all__ = ["fmt", "snapshot", "begin", "write_into_place", "check_consistency", "DatasetPlan", "WritePlan",
           "read", "read_header", "ReadPlan", "RegionRead", "plan_checksums", "h5py_parallel"]
