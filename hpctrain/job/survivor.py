"""The survivors' state. When a rank of a data-parallel launch dies, every rank that survives it holds the
whole state of the last step it finished, and would lose it when the launcher ends them: the relaunch would
compute again every step since the newest snapshot. A rank forked from the warm pool (:mod:`.warmpool`)
offers to keep it. The pool, whose children the ranks of its host are, sees one of them end first: it asks one
survivor of that launch (the lowest rank that offered), holds its kill back while it writes (at most
:data:`~.warmpool.SAVE_SECONDS`), and tells the supervisor before the relaunch. In the survivor a thread does the
writing (the main thread waits in a collective for the dead rank, where no Python runs): it takes the state
between two steps (``settling``: the trainer holds it while a step's update and its count change the state),
and writes it alone to the node-local level as a snapshot of one part, checksummed, refused if not finite
(:func:`~hpctrain.checkpoint.local.level.write_alone`). The relaunch's recovery takes it as any snapshot: the
failure costs the step in flight.

Offered where one rank's state is the run's: ``comm.mode = "sync"``, no sharded optimizer state, no split
model, and no buffers in the model (BatchNorm's running statistics change in the forward pass of the step in
flight, before its update). Elsewhere a failure resumes from the newest snapshot, and the run says why.
"""
import threading
import time

from ..checkpoint.local.level import write_alone
from . import warmpool

LOCK_SECONDS = 1.0  # how long the writing thread waits for a step's update to end


def unsuited(cfg, model, whole):
    """Why this run's ranks cannot keep their state alone, or None. ``whole``: a rank holds the whole model and
    optimizer state (no sharding, no split)."""
    if cfg.comm.mode != "sync":
        return f'comm.mode = "{cfg.comm.mode}": the ranks hold one model only at its exchanges'
    if not whole:
        return "no rank holds the whole state (a sharded optimizer or a split model)"
    params = {name for name, _ in model.named_parameters()}
    buffers = [name for name in model.state_dict() if name not in params]
    if buffers:
        return f"the model's buffers ({buffers[0]}, ...) change in the forward pass of the step in flight"
    return None


def offer(level, state, settling, run_config=None):
    """In a rank forked from the warm pool: a thread waits for the pool to ask for this rank's state. False where
    no pool took the offer."""
    channel = warmpool.offer_channel()
    if channel is None:
        return False
    threading.Thread(target=_keep, args=(channel, level, state, settling, run_config), name="hpctrain-survivor",
                     daemon=True).start()
    return True


def _keep(channel, level, state, settling, run_config):
    try:
        record, _ = warmpool.receive(channel)
    except OSError:
        return
    if not record:
        return
    started = time.monotonic()
    if not settling.acquire(timeout=LOCK_SECONDS):
        answer = {"why": f"its step's update did not end in {LOCK_SECONDS:g} s (a collective inside it)"}
    else:
        try:
            step, why = write_alone(level, state, run_config)
            answer = {"step": step, "why": why, "written": why is None}
        except Exception as exc:  # told to the supervisor: this thread has no one else to tell
            answer = {"why": f"{type(exc).__name__}: {exc}"}
        finally:
            settling.release()
    answer["seconds"] = time.monotonic() - started
    try:
        warmpool.send(channel, answer)
    except OSError:
        pass
