"""Run under mpirun: on_root/all_or_none hand every rank the same result or error."""

from mpi4py import MPI

from hpctrain.runtime.coordination import all_or_none, any_rank, on_root, raise_if_any
from hpctrain.errors import ConfigError, RemoteError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# A result chosen on rank 0 reaches everyone, and the step ran on rank 0 alone.
calls = []
value = on_root(lambda: calls.append(rank) or f"chosen-by-{rank}", comm)
assert value == "chosen-by-0", value
assert calls == ([0] if rank == 0 else []), calls

# A user error on rank 0 is raised, as the same class, on every rank.
try:
    on_root(lambda: (_ for _ in ()).throw(ConfigError("bad value", hint="fix it")), comm)
    raise SystemExit("on_root did not raise")
except ConfigError as exc:
    assert "HINT: fix it" in str(exc) and exc.collective

# A plain exception on the last rank only: every rank raises, the others as RemoteError.
def step():
    if rank == size - 1:
        raise KeyError("only-on-last")
    return rank

try:
    all_or_none(step, comm)
    raise SystemExit("all_or_none did not raise")
except KeyError:
    assert rank == size - 1
except RemoteError as exc:
    assert rank != size - 1 and f"rank {size - 1}" in str(exc) and "only-on-last" in str(exc)

assert all_or_none(lambda: rank * 2, comm) == rank * 2

# Errors that ranks collected on the way: every rank raises one error that names them all.
try:
    raise_if_any(["disk full"] if rank == size - 1 else [], comm,
                 lambda problems: ConfigError("writing failed: " + "; ".join(problems)))
    raise SystemExit("raise_if_any did not raise")
except ConfigError as exc:
    assert f"rank {size - 1} on " in str(exc) and "disk full" in str(exc) and exc.collective, str(exc)
assert raise_if_any([], comm, ConfigError) is None
assert any_rank(rank == size - 1, comm) is True
assert any_rank(False, comm) is False
comm.Barrier()
print(f"rank {rank}: coordination ok", flush=True)
