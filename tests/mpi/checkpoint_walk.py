"""Which checkpoint module calls which during real saves and a resume: every call between two
modules of ``hpctrain.checkpoint``, caller and callee (the nearest checkpoint frame above the
callee counts as the caller, so a call through ``on_root`` is the module that handed it on).

    mpirun -n 2 python tests/mpi/checkpoint_walk.py DIR

Rank 0 prints one ``EDGE caller callee`` line per pair and one ``ENTERED`` line naming, in
order, the modules entered (consecutive repeats merged).
"""
import os
import sys
import threading

import ckpt_common as cc
from hpctrain.checkpoint import CheckpointManager

PACKAGE = "hpctrain.checkpoint"
edges, entered = set(), []


def tracer(frame, event, arg):
    if event != "call":
        return
    callee = frame.f_globals.get("__name__", "")
    if not callee.startswith(PACKAGE + ".") and callee != PACKAGE:
        return
    caller = frame.f_back
    while caller is not None and not caller.f_globals.get("__name__", "").startswith(PACKAGE):
        caller = caller.f_back
    if caller is not None and caller.f_globals["__name__"] != callee:
        edges.add((caller.f_globals["__name__"], callee))
    if not entered or entered[-1] != callee:
        entered.append(callee)


def main(directory):
    cc.W = world = cc.world()
    state = cc.make_state()
    for async_save in (False, True):  # the foreground save, then the writer thread's
        mgr = CheckpointManager(os.path.join(directory, f"async-{async_save}"), world,
                                cc.config(async_save=async_save), run_config={})
        cc.step_once(state, 0)
        threading.setprofile(tracer)
        sys.setprofile(tracer)
        mgr.maybe_save(state, requested=True)
        mgr.resume(state)
        mgr.close()
        sys.setprofile(None)
        threading.setprofile(None)
    if world.rank == 0:
        for caller, callee in sorted(edges):
            print(f"EDGE {caller} {callee}")
        print("ENTERED " + " ".join(m.rsplit(".", 1)[-1] for m in entered), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
