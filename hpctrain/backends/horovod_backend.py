"""Horovod backend: ``hvd.DistributedOptimizer`` (ring all-reduce, tensor fusion, overlap of communication
with the backward pass). The only module of hpctrain that imports horovod."""
import itertools

from .. import settings
from ..errors import BackendUnavailable, ConfigError
from .base import Backend, allgather_in_place


# Horovod's background thread gathers ready tensors once per cycle (Horovod's default: 1 ms): a floor under
# every small all-reduce. Measured here (2 ranks, one core each, docs/performance.md): 0.2 ms cut a 256 KiB
# all-reduce from about 1 ms to 0.2-0.5 ms and 1-4 MiB by a third, and left the training step unchanged.
CYCLE_MS = 0.2
_cycle = None  # what the cycle is and who chose it, as the run's first lines say it


def horovod_defaults(environ=None):
    """Set hpctrain's Horovod settings in ``environ`` (the process's) where the user has
    not, before Horovod starts; returns a phrase for the run's first lines."""
    import os

    env = os.environ if environ is None else environ
    if "HOROVOD_CYCLE_TIME" in env:
        return f"cycle {env['HOROVOD_CYCLE_TIME']} ms (HOROVOD_CYCLE_TIME)"
    env["HOROVOD_CYCLE_TIME"] = f"{CYCLE_MS:g}"
    return f"cycle {CYCLE_MS:g} ms (hpctrain's default; Horovod's is 1 ms; HOROVOD_CYCLE_TIME sets it)"


def _init(hvd, comm, **kw):
    """``hvd.init`` with hpctrain's defaults, once per process."""
    global _cycle
    _cycle = horovod_defaults()
    hvd.init(comm=comm, **kw)


def import_horovod():
    try:
        import horovod.torch as hvd
    except Exception as exc:  # ImportError, or a broken build (undefined symbol: OSError)
        raise BackendUnavailable(
            f"the horovod backend was asked for, but Horovod cannot be imported here ({type(exc).__name__}: {exc})",
            hint='run `make setup` (builds Horovod against this MPI and PyTorch), or train with '
                 'the mpi4py backend: comm.backend = "mpi" (or HPCTRAIN_BACKEND=mpi)') from None
    return hvd


def build_info():
    """What this Horovod was built with, as ``hpctrain doctor`` reports it::

        {"frameworks": ["PyTorch"], "controllers": ["MPI", "Gloo"], "tensor_operations": [...],
         "cuda": False, "nccl": False}

    Raises what importing ``horovod.torch`` raises (``ImportError``, or ``OSError`` for a build that no longer
    loads), so that the doctor can show the import error itself."""
    import horovod.torch as hvd

    return {
        "frameworks": ["PyTorch"],
        "controllers": [n for n, f in (("MPI", hvd.mpi_built), ("Gloo", hvd.gloo_built)) if f()],
        "tensor_operations": [n for n, f in (("NCCL", hvd.nccl_built), ("DDL", hvd.ddl_built),
                                             ("CCL", hvd.ccl_built), ("MPI", hvd.mpi_built),
                                             ("Gloo", hvd.gloo_built)) if f()],
        "cuda": bool(hvd.cuda_built()), "nccl": bool(hvd.nccl_built()),
    }


def _compressor(hvd, name):
    compressors = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    if name not in compressors:
        raise ConfigError(f"unknown compression {name!r}; expected one of {', '.join(compressors)}",
                          hint='comm.compression = "none" or "fp16"')
    return compressors[name]


def gpu_identity(device):
    """The physical GPU behind ``device`` ("cuda:1"), the same whatever CUDA_VISIBLE_DEVICES
    renumbers: its UUID where torch reports one, else its PCI address."""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return ":".join(str(getattr(props, k, "?")) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))


def ranks_sharing_a_gpu(placements):
    """``placements``: (node, GPU identity) per rank, in rank order. Returns the groups of
    ranks (lists of two or more) that run on the same GPU of the same node (pure)."""
    groups = {}
    for rank, where in enumerate(placements):
        groups.setdefault(tuple(where), []).append(rank)
    return [ranks for ranks in groups.values() if len(ranks) > 1]


def nccl_sharing_error(groups, nodes):
    """The error for ranks that share a GPU under NCCL, which holds one rank of a
    communicator per GPU ("Duplicate GPU detected"); ``nodes``: node name per rank."""
    shown = "; ".join(f"ranks {', '.join(map(str, g))} on {nodes[g[0]]}" for g in groups[:3])
    return ConfigError(
        f"the horovod backend averages GPU tensors with NCCL, which needs one GPU per rank, but "
        f"some ranks share a GPU ({shown}{'; ...' if len(groups) > 3 else ''})",
        hint="start one rank per GPU (e.g. srun --ntasks-per-node=<GPUs per node>, or mpirun -n <GPUs>), "
             'or let ranks share GPUs with the mpi4py backend: comm.backend = "mpi" (it averages through host memory)')


def refuse_shared_gpus(hvd, world, identity=gpu_identity):
    """Under NCCL, stop every rank with the fix where ranks share a GPU. Collective: every rank raises the
    same error, before NCCL would fail in Horovod's background thread at the first all-reduce."""
    if not (world.device.startswith("cuda") and hvd.nccl_built()):
        return
    placements = world.comm.allgather((world.node, identity(world.device)))
    groups = ranks_sharing_a_gpu(placements)
    if groups:
        raise nccl_sharing_error(groups, [node for node, _ in placements])


class HorovodBackend(Backend):
    name = "horovod"

    def __init__(self, world, compression="none", gradient_predivide_factor=1.0):
        super().__init__(world, compression, gradient_predivide_factor)
        self._hvd, self._started = import_horovod(), False
        self._compressor = _compressor(self._hvd, compression)

    def start(self):
        """``hvd.init`` on MPI's world (once per process), checked. From here Horovod's background thread keeps
        MPI busy every cycle, which slows other MPI work of the process (MPI-IO: docs/performance.md)."""
        hvd, world = self._hvd, self.world
        if self._started:
            return
        self._started = True
        if not hvd.is_initialized():
            # mpi4py has already initialised MPI (THREAD_MULTIPLE); Horovod joins that world.
            _init(hvd, world.comm)
        if hvd.size() != world.size or hvd.rank() != world.rank:
            raise BackendUnavailable(
                f"Horovod sees rank {hvd.rank()} of {hvd.size()} but MPI says rank {world.rank} "
                f"of {world.size}", hint="rebuild Horovod against the MPI that mpi4py uses (`make setup`)")
        refuse_shared_gpus(hvd, world)

    @property
    def hvd(self):
        """``horovod.torch``, started: a collective used before :meth:`start` starts it (every rank reaches it)."""
        self.start()
        return self._hvd

    process_set = None  # gradients average over the whole world (a process set: a group)

    def describe(self):
        return super().describe() + (f", {_cycle}" if _cycle else "")

    def distributed_optimizer(self, optimizer, model, accumulation=1):
        extra = {} if self.process_set is None else {"process_set": self.process_set}
        return self.hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=self._compressor,
            backward_passes_per_step=accumulation, op=self.hvd.Average,
            gradient_predivide_factor=self.gradient_predivide_factor, **extra)

    def broadcast_state(self, model, optimizer, root=0):
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        # A fresh optimizer has no state; Horovod would create it with a dummy step, which
        # changes the weights under weight decay. Broadcast only state that exists.
        with_state = self.world.comm.allreduce(1 if len(optimizer.state) else 0)
        if with_state:
            hvd.broadcast_optimizer_state(optimizer, root_rank=root)
        if 0 < with_state < self.size:  # some ranks took that dummy step: undo it
            hvd.broadcast_parameters(model.state_dict(), root_rank=root)

    def synchronize(self, optimizer):
        optimizer.synchronize()

    def step(self, optimizer, scaler=None):
        # Gradients are already averaged by synchronize(); do not wait for them twice.
        with optimizer.skip_synchronize():
            super().step(optimizer, scaler)

    def allreduce_mean(self, value):
        import torch

        if isinstance(value, torch.Tensor):
            return self.hvd.allreduce(value.detach().cpu(), op=self.hvd.Average).to(value.device)
        return float(self.hvd.allreduce(torch.tensor([float(value)], dtype=torch.float64), op=self.hvd.Average)[0])

    def broadcast_object(self, obj, root=0):
        return self.hvd.broadcast_object(obj, root_rank=root)

    def allgather_object(self, obj):
        return self.hvd.allgather_object(obj)

    def barrier(self):
        self.hvd.barrier()

    def start_timeline(self, path):
        # Every rank calls it; Horovod's coordinator (rank 0) writes the file.
        self.hvd.start_timeline(path, mark_cycles=False)

    def close(self):
        """Nothing: Horovod shuts down at exit; shutting down here would break a second Trainer in the same process."""

    # ---- averaging of flat buffers (comm.mode local_sgd and stale)
    def start_average(self, flat, compress=True, name=None):
        import torch

        hvd = self.hvd
        cast = compress and self.compression == "fp16" and flat.dtype.is_floating_point and flat.dtype != torch.float16
        wire = flat.to(torch.float16) if cast else flat
        # Averaged by Horovod's background thread: it travels while this rank computes.
        return hvd.allreduce_async_(wire, op=hvd.Average, name=name), wire, flat

    def wait_average(self, handle):
        handle, wire, flat = handle
        self.hvd.synchronize(handle)
        if wire is not flat:
            flat.copy_(wire)
        return flat

    # ---- sharded training (comm.shard, hpctrain.training.sharding)
    # hvd.reducescatter splits dimension 0 into near-equal parts of its own choosing: each rank's part travels
    # padded to the longest, as one row of a (ranks x longest) tensor, so the parts can be cut anywhere.
    def _padded(self, flat, counts):
        padded = flat.new_zeros(len(counts), max(max(counts), 1))
        for r, (lo, n) in enumerate(zip(itertools.accumulate(counts, initial=0), counts)):
            padded[r, :n] = flat[lo:lo + n]
        return padded

    def reduce_scatter_mean(self, flat, counts):
        hvd = self.hvd
        f = self.gradient_predivide_factor
        out = hvd.reducescatter(self._padded(flat, counts), compression=self._compressor, op=hvd.Sum,
                                prescale_factor=1.0 / f, postscale_factor=f / self.size)
        return out.reshape(-1)[:counts[self.rank]].clone()

    def allgather_flat(self, flat, counts):
        # hvd.allgather returns a new tensor (a whole-model temporary, then a copy back): 58 ms for 100 MB on
        # 2 ranks, against 16 ms for the broadcasts below and 3-7 ms for MPI's in-place Allgatherv on the
        # world communicator (CPU tensors; Horovod runs its own duplicate of it, so the two never meet).
        if flat.device.type == "cpu" and self.process_set is None:
            allgather_in_place(self.world.comm, flat, counts)
        else:
            self.allgather_by_broadcasts(flat, counts)

    def allgather_by_broadcasts(self, flat, counts):
        """GPU tensors (NCCL): one in-place broadcast per part from the rank that holds it, all
        in flight at once: no padded copy and no gathered temporary."""
        hvd = self.hvd
        handles = [hvd.broadcast_async_(flat[lo:lo + n], root_rank=r, name=f"hpctrain.shard.gather.{r}")
                   for r, (lo, n) in enumerate(zip(itertools.accumulate(counts, initial=0), counts)) if n]
        for handle in handles:
            hvd.synchronize(handle)

    def broadcast_tensor(self, tensor, root=0):
        self.hvd.broadcast_(tensor, root_rank=root)


class HorovodProcessSetBackend(HorovodBackend):
    """Gradient averaging among a group of ranks (a Horovod process set), e.g. the replicas of one pipeline
    stage. ``groups``: every group of the job as lists of world ranks, the same on every rank (Horovod
    registers process sets collectively); this rank averages within its own group. Small collectives
    (``allreduce_mean``, ...) still span the whole world. Registered at ``hvd.init(comm=...,
    process_sets=...)`` when Horovod is first used in the process; if Horovod is already running, the sets can
    only be added with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (set before the first ``hvd.init``)."""

    def __init__(self, world, groups, compression="none", gradient_predivide_factor=1.0):
        Backend.__init__(self, world, compression, gradient_predivide_factor)
        hvd, self._started = import_horovod(), True  # the sets are registered as Horovod starts: now
        self._hvd = hvd
        groups = [sorted(int(r) for r in g) for g in groups]
        if not hvd.is_initialized():
            sets = [hvd.ProcessSet(g) for g in groups]
            _init(hvd, world.comm, process_sets=sets)
        else:
            from ..runtime.coordination import everywhere

            if settings.horovod("DYNAMIC_PROCESS_SETS") != "1":  # the same on every rank
                raise everywhere(BackendUnavailable(
                    "Horovod is already initialised in this process without the process sets that the "
                    "replicas of a split model average over",
                    hint="set HOROVOD_DYNAMIC_PROCESS_SETS=1 before starting the job, or use the mpi backend "
                         "(comm.backend = \"mpi\") for split models"))
            sets = [hvd.add_process_set(g) for g in groups]  # collective: every rank, same order
        mine = [s for s, g in zip(sets, groups) if world.rank in g]
        if len(mine) != 1:
            raise ConfigError(f"rank {world.rank} is in {len(mine)} of the process sets {groups}; expected one")
        self.process_set = mine[0]
        self.group = groups[sets.index(self.process_set)]
        self._compressor = _compressor(hvd, compression)
        refuse_shared_gpus(hvd, world)

    def broadcast_state(self, model, optimizer, root=0):
        raise NotImplementedError("broadcast within a process set goes over the group's MPI communicator "
                                  "(hpctrain.parallel.hybrid.ReplicaBackend.broadcast_state)")

    def describe(self):
        return (f"horovod backend over process sets of {len(self.group)} rank(s), compression "
                f"{self.compression}, gradient_predivide_factor {self.gradient_predivide_factor:g}"
                + (f", {_cycle}" if _cycle else ""))
