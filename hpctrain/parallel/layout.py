"""The process grid: pipeline stages x data-parallel replicas x tensor-parallel ranks.

Tensor ranks are innermost (their all-reduces run every layer: they should share a node), then pipeline
stages (point-to-point, once per micro-batch), then data-parallel replicas (one all-reduce per step)::

    rank = (replica * stages + stage) * tensor + tensor_rank

With 4 ranks, 2 stages x 2 replicas: replica 0 is ranks 0 (stage 0) and 1 (stage 1), replica 1 is ranks 2
and 3; stage 0's gradients are averaged between ranks 0 and 2.

>>> grid = ProcessGrid.build(Layout(stages=2), comm)    # replicas = size / (stages * tensor)  # doctest: +SKIP
>>> grid.stage, grid.replica, grid.pp_comm, grid.dp_comm                                       # doctest: +SKIP
"""
from dataclasses import dataclass
from typing import Any, Optional

from ..config.budget import replicas_of
from ..errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """How many pipeline stages, data-parallel replicas and tensor-parallel ranks; ``replicas=None`` takes
    whatever the world size leaves: ``size // (stages * tensor)``."""

    stages: int = 1
    replicas: Optional[int] = None
    tensor: int = 1

    def resolve(self, size):
        """The layout with ``replicas`` filled in for ``size`` ranks; ConfigError if it cannot fit."""
        for name in ("stages", "tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name} is {value!r}; expected an integer >= 1")
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ConfigError(f"parallel.replicas is {self.replicas!r}; expected an integer >= 1 or unset")
        if self.replicas is None:
            return Layout(self.stages, replicas_of(self.stages, self.tensor, size), self.tensor)
        needed = self.stages * self.tensor * self.replicas
        if needed != size:
            raise ConfigError(
                f"the layout {self.stages} stage(s) x {self.replicas} replica(s) x {self.tensor} "
                f"tensor-parallel rank(s) needs {needed} ranks, but the job has {size}",
                hint=f"launch with mpirun -n {needed}, or leave parallel.replicas unset to use "
                     f"size // (stages * tensor) replicas")
        return self

    def describe(self):
        return f"{self.stages} stage(s) x {self.replicas} replica(s) x {self.tensor} tensor-parallel"


def coordinates(rank, layout):
    """``(replica, stage, tensor_rank)`` of ``rank`` (pure)."""
    return rank // (layout.tensor * layout.stages), (rank // layout.tensor) % layout.stages, rank % layout.tensor


def rank_of(replica, stage, tensor_rank, layout):
    return (replica * layout.stages + stage) * layout.tensor + tensor_rank


@dataclass
class ProcessGrid:
    """This rank's place in the grid and the sub-communicators it talks over. ``pp_comm``: the ranks of
    one pipeline (same replica and tensor rank), ranked by stage. ``dp_comm``: the replicas of this stage
    and tensor rank, ranked by replica. ``tp_comm``: the tensor-parallel ranks of this stage in this
    replica. ``stage_comm``: every rank that holds a part of this stage (replicas x tensor ranks)."""

    layout: Layout
    comm: Any
    rank: int
    replica: int
    stage: int
    tensor_rank: int
    pp_comm: Any
    dp_comm: Any
    tp_comm: Any
    stage_comm: Any

    @classmethod
    def build(cls, layout, comm=None):
        """Collective over ``comm`` (default COMM_WORLD). Every rank validates the same
        layout, so a bad one raises the same ConfigError everywhere before any Split."""
        from mpi4py import MPI

        from ..runtime.coordination import all_or_none
        from ..runtime.world import prepare_object_reductions

        comm = MPI.COMM_WORLD if comm is None else getattr(comm, "comm", comm)
        layout = all_or_none(lambda: layout.resolve(comm.Get_size()), comm)
        rank = comm.Get_rank()
        r, s, t = coordinates(rank, layout)
        S, T = layout.stages, layout.tensor
        # Colours are unique integers per group; keys order ranks inside it.
        pp = comm.Split(color=r * T + t, key=s)
        dp = comm.Split(color=s * T + t, key=r)
        tp = comm.Split(color=r * S + s, key=t)
        stage = comm.Split(color=s, key=r * T + t)
        prepare_object_reductions(comm, pp, dp, tp, stage)
        return cls(layout, comm, rank, r, s, t, pp, dp, tp, stage)

    @property
    def is_first_stage(self):
        return self.stage == 0

    @property
    def is_last_stage(self):
        return self.stage == self.layout.stages - 1

    def free(self):
        for c in (self.pp_comm, self.dp_comm, self.tp_comm, self.stage_comm):
            c.Free()

    def describe(self):
        return (f"rank {self.rank}: replica {self.replica}, stage {self.stage}, tensor rank "
                f"{self.tensor_rank} of {self.layout.describe()}")
