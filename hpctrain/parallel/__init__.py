"""Model-splitting parallelism: pipeline stages x data-parallel replicas x tensor-parallel ranks, over MPI
sub-communicators (``docs/parallelism.md``). Names load on first use, so importing this does not load torch.

>>> from hpctrain.parallel import HybridParallel, Layout                # doctest: +SKIP
>>> hp = HybridParallel(layers, Layout(stages=2), loss_fn, optimizer)   # mpirun -n 4: 2 x 2  # doctest: +SKIP
>>> loss = hp.train_step(x, y)                                           # doctest: +SKIP
"""
import importlib

_EXPORTS = {
    "Layout": "layout", "ReplicaBackend": "hybrid", "ProcessGrid": "layout",
    "Pipeline": "pipeline", "partition": "pipeline", "schedule_ops": "pipeline",
    "ColumnParallelLinear": "tensor", "RowParallelLinear": "tensor", "ParallelMLP": "tensor",
    # the dense parts a split model is made of (hpctrain.models), offered here beside their split versions
    "LayerStack": "hpctrain.models.stack", "MLPBlock": "hpctrain.models.blocks",
    "SelfAttention": "hpctrain.models.blocks", "ParallelSelfAttention": "tensor", "tensor_parallelize": "tensor",
    "HybridParallel": "hybrid",
    "save_parallel_checkpoint": "checkpoint", "load_parallel_checkpoint": "checkpoint", "gather_state": "checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpctrain.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module if "." in module else f".{module}", __name__), name)
    globals()[name] = value
    return value
