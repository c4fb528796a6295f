"""Run under mpirun: what hpctrain set before MPI started, and what Open MPI itself then holds.

    python mpi_settings_probe.py [mpi-first]

``mpi-first``: the script starts MPI itself before hpctrain is imported. Rank 0 prints one
JSON line with every rank's view: hpctrain's phrase, and Open MPI's ``mpi_yield_when_idle``
as MPI's tool interface (MPI_T) reads it inside the running library.
"""
import ctypes
import json
import sys

if sys.argv[1:] == ["mpi-first"]:
    from mpi4py import MPI  # noqa: F401  (starts MPI before hpctrain can set anything)

from hpctrain.runtime.world import init_world, mpi_settings


def open_mpi_variable(name):
    """An integer or boolean control variable of the running MPI library, through MPI_T."""
    from mpi4py import MPI

    lib = ctypes.CDLL(MPI.__file__)  # the module links libmpi: its symbols resolve through it
    provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    handle, value = ctypes.c_void_p(), ctypes.c_int64(0)
    assert lib.MPI_T_init_thread(0, ctypes.byref(provided)) == 0
    assert lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) == 0, f"no MPI_T variable {name}"
    assert lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) == 0
    assert lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0
    lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    lib.MPI_T_finalize()
    return int(value.value & 0xFF)  # a bool is one byte; the rest of the 8 stay zero


world = init_world(pin=False)
mine = {"rank": world.rank, "said": mpi_settings(), "yield_when_idle": open_mpi_variable("mpi_yield_when_idle")}
ranks = world.comm.gather(mine)
if world.rank == 0:
    print(json.dumps(ranks), flush=True)
