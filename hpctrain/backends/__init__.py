"""Communication backends: the one place where one is chosen. ``horovod`` (default, :mod:`.horovod_backend`):
Horovod's ``DistributedOptimizer`` (ring all-reduce with tensor fusion, overlapping the backward pass). ``mpi``
(:mod:`.mpi_backend`): plain mpi4py all-reduce of fused gradient buffers, for machines without Horovod, its
gradients compressed on the wire by :mod:`.compression`. Both implement :class:`hpctrain.backends.base.Backend`.

>>> backend = get_backend("mpi", world, compression="fp16")     # doctest: +SKIP
"""
from ..config.schema import BACKENDS
from ..errors import ConfigError
from .base import Backend

__all__ = ["Backend", "backend_class", "get_backend"]


def get_backend(name, world, compression="none", gradient_predivide_factor=1.0, start=True):
    """Create and initialise the backend called ``name`` for ``world`` (``start=False``: its
    :meth:`~hpctrain.backends.base.Backend.start` is left to the caller, collective on every rank). Raises
    :class:`~hpctrain.errors.BackendUnavailable` when it is not installed, and
    :class:`~hpctrain.errors.ConfigError` for an unknown name."""
    from ..runtime.coordination import all_or_none

    # Agree first that every rank can load it: one without Horovod must not leave the others in hvd.init().
    cls = all_or_none(lambda: backend_class(name), world.comm)
    backend = cls(world, compression=compression, gradient_predivide_factor=gradient_predivide_factor)
    if start:
        backend.start()
    return backend


def backend_class(name):
    """The backend class called ``name``, importable on this rank (Horovod loaded: its build works)."""
    if name == "horovod":
        from .horovod_backend import HorovodBackend, import_horovod

        import_horovod()
        return HorovodBackend
    if name == "mpi":
        from .mpi_backend import MPIBackend

        return MPIBackend
    raise ConfigError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}",
                      hint='set comm.backend = "horovod" or "mpi" (or HPCTRAIN_BACKEND)')
