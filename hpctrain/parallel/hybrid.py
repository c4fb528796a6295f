"""Hybrid parallelism: pipeline stages x data-parallel replicas (x tensor-parallel ranks within a stage). Each
replica runs the whole pipeline on its share of the batch; a stage's gradients are averaged among its replicas
only, by :class:`ReplicaBackend` (``hpctrain train`` uses Horovod by default, :mod:`hpctrain.training.split`).
Pure data parallelism (one stage, one tensor rank) is what :class:`hpctrain.Trainer` does with either backend.
Launch with ``mpirun -n 4 python examples/hybrid_mlp.py --stages 2 --compression fp16`` (4 ranks: 2 stages x 2
replicas), or in code::

    hp = HybridParallel(layers, Layout(stages=2), loss_fn=nn.MSELoss(),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                        micro_batches=4, schedule="1f1b", compression="fp16")
    for x, y in batches:                      # the global batch; each replica takes its share
        loss = hp.train_step(x, y)
    hp.save("run/ckpt-00000100.h5", progress) # one HDF5 file, global tensors
"""
from ..backends.base import Backend
from ..config.schema import BACKENDS
from ..config.validation import check_choice
from ..errors import ConfigError
from .layout import Layout, ProcessGrid, rank_of
from .pipeline import Pipeline


def sub_world(comm):
    """A :class:`~hpctrain.runtime.world.World` for a sub-communicator, for the backends to run over."""
    from ..runtime.world import World, node_name

    return World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=0, local_size=1,
                 node=node_name(), launcher="mpirun", comm=comm)


def replica_groups(layout):
    """The data-parallel groups of ``layout``: the ranks of each stage and tensor rank's replicas (pure)."""
    return [[rank_of(r, s, t, layout) for r in range(layout.replicas)]
            for s in range(layout.stages) for t in range(layout.tensor)]


class ReplicaBackend(Backend):
    """The backend of a split model: gradients averaged among the replicas of each stage (and tensor rank), small
    collectives (``allreduce_mean``, ...) over the whole grid, so a trainer can use it like a data-parallel backend.
    ``name="horovod"``: one Horovod process set per stage and tensor rank, registered on every rank
    (:class:`~hpctrain.backends.horovod_backend.HorovodProcessSetBackend`), the all-reduce overlapping the backward
    pass; ``"mpi"``: the mpi4py backend (:mod:`hpctrain.backends.mpi_backend`) over ``grid.dp_comm``, with its fused
    buffers. Both take ``compression="fp16"``. Broadcasts go over ``grid.dp_comm`` either way."""

    def __init__(self, grid, name="mpi", compression="none", gradient_predivide_factor=1.0, backward_passes=1):
        from ..backends.mpi_backend import MPIBackend

        check_choice("comm.backend", name, BACKENDS)
        world = sub_world(grid.comm)
        super().__init__(world, compression, gradient_predivide_factor)
        # backward_passes: the backward passes that reach each parameter per step, one per pipeline micro-batch
        # (Horovod starts its all-reduce after the last of them).
        self.grid, self.name, self.backward_passes = grid, name, backward_passes
        self._group_mpi = MPIBackend(sub_world(grid.dp_comm), compression, gradient_predivide_factor)
        self._world_mpi = MPIBackend(world)
        # One replica: nothing to average, so no Horovod process sets either.
        if name == "horovod" and grid.layout.replicas > 1:
            from ..backends import backend_class
            from ..runtime.coordination import all_or_none

            all_or_none(lambda: backend_class("horovod"), grid.comm)  # every rank can load it, or none waits
            from ..backends.horovod_backend import HorovodProcessSetBackend

            self.group = HorovodProcessSetBackend(world, replica_groups(grid.layout), compression,
                                                  gradient_predivide_factor)
        else:
            self.group = self._group_mpi

    def distributed_optimizer(self, optimizer, model, accumulation=1):
        return self.group.distributed_optimizer(optimizer, model, accumulation * self.backward_passes)

    def broadcast_state(self, model, optimizer, root=0):
        self._group_mpi.broadcast_state(model, optimizer, root)

    def synchronize(self, optimizer):
        if self.grid.dp_comm.Get_size() > 1:
            self.group.synchronize(optimizer)

    def step(self, optimizer, scaler=None):
        # Horovod's optimizer must not wait for the gradients a second time.
        self.group.step(optimizer, scaler)

    def allreduce_mean(self, value):
        return self._world_mpi.allreduce_mean(value)

    def broadcast_object(self, obj, root=0):
        return self._world_mpi.broadcast_object(obj, root)

    def allgather_object(self, obj):
        return self._world_mpi.allgather_object(obj)

    def barrier(self):
        self._world_mpi.barrier()

    def close(self):
        for b in (self.group, self._group_mpi, self._world_mpi):
            b.close()

    def describe(self):
        if self.grid.layout.replicas == 1:
            return f"{self.grid.layout.describe()} (one replica: no gradient averaging)"
        how = "Horovod process sets" if self.group is not self._group_mpi else "mpi sub-communicators"
        return (f"{self.grid.layout.describe()}; replicas average over {how}, compression {self.compression}, "
                f"gradient_predivide_factor {self.gradient_predivide_factor:g}")


class HybridParallel:
    """A model trained as pipeline x data parallel (x tensor parallel): the pieces wired up. ``optimizer``: a function
    of this stage's parameters returning the optimizer (the same hyperparameters on every rank). ``train_step(x, y)``
    takes the *global* batch (the same on every rank, or None where it is not read) and gives replica ``r`` rows
    ``[r*b, (r+1)*b)`` of it; use :meth:`replica_slice` to load only those rows yourself."""

    def __init__(self, model, layout, loss_fn, optimizer, micro_batches=1, schedule="1f1b", balance="params",
                 sample=None, compression="none", backend="mpi", comm=None, gradient_predivide_factor=1.0):
        self.grid = ProcessGrid.build(layout if isinstance(layout, Layout) else Layout(**layout), comm)
        self.pipeline = Pipeline(model, self.grid, loss_fn, micro_batches, schedule, balance, sample)
        self.module = self.pipeline.module
        self.backend = ReplicaBackend(self.grid, backend, compression, gradient_predivide_factor, micro_batches)
        self.optimizer = self.backend.distributed_optimizer(optimizer(self.module.parameters()), self.module)
        # Replicas start equal even if a rank's generator differed when the model was built.
        self.backend.broadcast_state(self.module, self.optimizer, root=0)

    @property
    def layout(self):
        return self.grid.layout

    def replica_slice(self, n):
        """Rows of a global batch of ``n`` samples that this replica trains on."""
        replicas = self.layout.replicas
        if n % replicas:
            raise ConfigError(f"a global batch of {n} samples does not split evenly over {replicas} replicas",
                              hint=f"use a global batch size that is a multiple of {replicas}")
        b = n // replicas
        return slice(self.grid.replica * b, (self.grid.replica + 1) * b)

    def _share(self, batch):
        return None if batch is None else batch[self.replica_slice(len(batch))]

    def train_step(self, inputs=None, targets=None):
        """One optimizer step on a global batch; returns the mean loss over all replicas."""
        loss = self.pipeline.train_step(self._share(inputs), self._share(targets))
        self.backend.synchronize(self.optimizer)
        self.backend.step(self.optimizer)
        self.optimizer.zero_grad()  # (Horovod's wrapper takes no set_to_none; None is the default)
        return self.grid.dp_comm.allreduce(loss) / self.layout.replicas

    def forward(self, inputs):
        """Evaluation forward pass of this replica's share; the output on the last stage."""
        return self.pipeline.forward(self._share(inputs))

    def save(self, path, progress=None, **kwargs):
        from .checkpoint import save_parallel_checkpoint

        return save_parallel_checkpoint(path, self.module, self.optimizer, self.grid, progress, **kwargs)

    def load(self, path, progress=None):
        from .checkpoint import load_parallel_checkpoint

        return load_parallel_checkpoint(path, self.module, self.optimizer, self.grid, progress)

    def close(self):
        self.backend.close()
        self.grid.free()

