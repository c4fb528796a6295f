"""Hybrid parallelism: pipeline stages x data-parallel replicas (x tensor-parallel ranks
within a stage). Each replica runs the whole pipeline on its own share of the batch; the
gradients of a stage are then averaged among that stage's replicas only, over
``grid.dp_comm``, by the mpi4py backend (:mod:`hpctrain.backends.mpi_backend`) with its
fused buffers and optional fp16 compression.

Why not Horovod here: Horovod's optimizer reduces over the whole job (or a process set
registered by every rank at ``hvd.init``); hpctrain's Horovod backend is built for the
whole world, so hybrid layouts use the mpi backend. Pure data parallelism (one stage, one
tensor rank) is what :class:`hpctrain.Trainer` does with either backend.

Launch (4 ranks: 2 stages x 2 replicas)::

    mpirun -n 4 python examples/hybrid_mlp.py --stages 2 --compression fp16

In code::

    hp = HybridParallel(layers, Layout(stages=2), loss_fn=nn.MSELoss(),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                        micro_batches=4, schedule="1f1b", compression="fp16")
    for x, y in batches:                      # the global batch; each replica takes its share
        loss = hp.train_step(x, y)
    hp.save("run/ckpt-00000100.h5", progress) # one HDF5 file, global tensors
"""
from ..errors import ConfigError
from .layout import Layout, ProcessGrid
from .pipeline import Pipeline


def sub_world(comm):
    """A :class:`~hpctrain.world.World` for a sub-communicator, so that the existing
    backends can run over it."""
    from ..world import World, node_name

    return World(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=0, local_size=1,
                 node=node_name(), launcher="mpirun", comm=comm)


class DataParallelGroup:
    """Averages the gradients of this stage's parameters among its replicas (``grid.dp_comm``).

    >>> dp = DataParallelGroup(grid, pipe.module, optimizer, compression="fp16")   # doctest: +SKIP
    >>> dp.broadcast()        # replica 0's parameters and optimizer state to the others
    >>> ...; loss.backward(); dp.synchronize(); optimizer.step()
    """

    def __init__(self, grid, module, optimizer, backend="mpi", compression="none", gradient_predivide_factor=1.0):
        if backend != "mpi":
            raise ConfigError(
                f"comm.backend is {backend!r}, but pipeline and tensor-parallel layouts average gradients "
                f"within each stage's replicas with the mpi backend",
                hint='set comm.backend = "mpi" for layouts with more than one stage or tensor rank')
        from ..backends.mpi_backend import MPIBackend

        self.grid = grid
        self.module = module
        self.backend = MPIBackend(sub_world(grid.dp_comm), compression=compression,
                                  gradient_predivide_factor=gradient_predivide_factor)
        self.optimizer = self.backend.distributed_optimizer(optimizer, module)

    def broadcast(self):
        self.backend.broadcast_state(self.module, self.optimizer, root=0)

    def synchronize(self):
        if self.grid.dp_comm.Get_size() > 1:
            self.backend.synchronize(self.optimizer)

    def close(self):
        self.backend.close()


class HybridParallel:
    """A model trained as pipeline x data parallel (x tensor parallel): the pieces wired up.

    ``optimizer``: a function of this stage's parameters returning the optimizer (the same
    hyperparameters on every rank). ``train_step(x, y)`` takes the *global* batch (the same
    on every rank, or None where it is not read) and gives replica ``r`` rows
    ``[r*b, (r+1)*b)`` of it; use :meth:`replica_slice` to load only those rows yourself.
    """

    def __init__(self, model, layout, loss_fn, optimizer, micro_batches=1, schedule="1f1b", balance="params",
                 sample=None, compression="none", backend="mpi", comm=None, gradient_predivide_factor=1.0):
        self.grid = ProcessGrid.build(layout if isinstance(layout, Layout) else Layout(**layout), comm)
        self.pipeline = Pipeline(model, self.grid, loss_fn, micro_batches, schedule, balance, sample)
        self.module = self.pipeline.module
        self.optimizer = optimizer(self.module.parameters())
        self.dp = DataParallelGroup(self.grid, self.module, self.optimizer, backend, compression,
                                    gradient_predivide_factor)
        # Replicas start equal even if a rank's generator differed when the model was built.
        self.dp.broadcast()

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
        self.dp.synchronize()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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
        self.dp.close()
        self.grid.free()

