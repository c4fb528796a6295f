"""The communication backend interface the trainer talks to. A training step with any backend::

    optimizer = backend.distributed_optimizer(optimizer, model, accumulation)
    backend.broadcast_state(model, optimizer)        # rank 0's weights and optimizer state
    for micro_batch in step:                          # ``accumulation`` backward passes
        loss.backward()
    backend.synchronize(optimizer)                    # gradients averaged over all ranks
    backend.step(optimizer)                           # apply them (every rank the same)
    optimizer.zero_grad()

The helpers (``allreduce_mean``, ``broadcast_object``, ``allgather_object``, ``barrier``)
are for metrics and small control data, not for gradients."""


class Backend:
    """One communication backend. Subclasses implement every method below."""

    name = "base"

    def __init__(self, world, compression="none", gradient_predivide_factor=1.0):
        self.world, self.compression = world, compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)

    def start(self):
        """Start what the backend runs beside the training (collective: every rank calls it, at the same
        point); :func:`~hpctrain.backends.get_backend` does, unless told to leave it for later. Nothing here."""

    @property
    def rank(self):
        return self.world.rank

    @property
    def size(self):
        return self.world.size

    # ---- gradients
    def distributed_optimizer(self, optimizer, model, accumulation=1):
        """Return the optimizer to train with (possibly a wrapper of ``optimizer``). Gradients are averaged
        over ranks once every ``accumulation`` backward passes; in between they are summed locally."""
        raise NotImplementedError

    def broadcast_state(self, model, optimizer, root=0):
        """Make every rank's parameters, buffers and optimizer state equal to ``root``'s."""
        raise NotImplementedError

    def synchronize(self, optimizer):
        """Wait until this step's gradients are averaged over all ranks."""
        raise NotImplementedError

    def step(self, optimizer, scaler=None):
        """Apply the averaged gradients (after :meth:`synchronize`)."""
        step_optimizer(optimizer, scaler)

    # ---- small collectives
    def allreduce_mean(self, value):
        """Mean over ranks of a float or a tensor (returns the same kind)."""
        raise NotImplementedError

    def broadcast_object(self, obj, root=0):
        raise NotImplementedError

    def allgather_object(self, obj):
        """List of every rank's ``obj``, in rank order."""
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def start_timeline(self, path):
        """Record a communication timeline into ``path`` (Horovod's); others only warn."""
        import warnings

        warnings.warn(f"the {self.name} backend records no timeline; monitor.horovod_timeline ignored")

    def close(self):
        """Release the backend's resources (idempotent)."""

    def describe(self):
        return (f"{self.name} backend, compression {self.compression}, "
                f"gradient_predivide_factor {self.gradient_predivide_factor:g}")

    # ---- averaging of flat buffers (comm.mode local_sgd and stale, hpctrain.training.comm_modes)
    def start_average(self, flat, compress=True, name=None):
        """Start averaging the 1-D tensor ``flat`` over all ranks, in place, without waiting; returns a handle
        for :meth:`wait_average`. ``compress``: send it as the backend's ``compression`` says (fp16 on the
        wire); False: as it is. ``name``: unique among the averages in flight (Horovod matches by name)."""
        raise NotImplementedError

    def wait_average(self, handle):
        """Wait until the average started by :meth:`start_average` is in its tensor; returns it."""
        raise NotImplementedError

    def average(self, flat, compress=True):
        """Average ``flat`` over all ranks in place (one collective); returns it."""
        return self.wait_average(self.start_average(flat, compress))

    # ---- sharded training (comm.shard, hpctrain.training.sharding)
    def reduce_scatter_mean(self, flat, counts):
        """Average the 1-D ``flat`` over ranks; return this rank's part of the result: the
        ``counts[rank]`` elements after ``sum(counts[:rank])`` (parts may differ in size)."""
        raise NotImplementedError

    def allgather_flat(self, flat, counts):
        """In place: every rank's part of the 1-D ``flat`` (as :meth:`reduce_scatter_mean`
        cuts it) becomes, on every rank, the values its own rank holds."""
        raise NotImplementedError

    def broadcast_tensor(self, tensor, root=0):
        """In place: ``tensor`` becomes ``root``'s on every rank."""
        raise NotImplementedError


def step_optimizer(optimizer, scaler=None):
    """``optimizer.step()``, or the AMP ``scaler``'s step and update: every step of a backend or a comm mode."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def allgather_in_place(comm, flat, counts):
    """``MPI_Allgatherv(MPI_IN_PLACE)`` over the float32 1-D ``flat``, cut as ``counts``: every
    rank's part to every rank, with no temporary (on a CPU tensor; a GPU one goes through a
    host copy). Measured on 2 ranks, 100 MB: 3-7 ms (Open MPI's shared-memory single copy)."""
    from mpi4py import MPI

    displs = [sum(counts[:r]) for r in range(len(counts))]
    host = flat.detach().cpu()  # the same memory on the CPU
    comm.Allgatherv(MPI.IN_PLACE, [host.numpy(), list(counts), displs, MPI.FLOAT])
    if host.data_ptr() != flat.data_ptr():
        flat.copy_(host)
