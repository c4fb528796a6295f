"""The survivors' state. When a rank of a data-parallel launch dies, every rank that survives it holds the
whole state of the last step it finished, and would lose it when the launcher ends them: the relaunch would
compute again every step since the newest snapshot. A rank forked from the warm pool (:mod:`.warmpool`)
offers to keep it. The pool, whose children the ranks of its host are, sees one of them end first: it asks one
survivor of that launch (the lowest rank that offered), holds its kill back while it writes (at most
:data:`SAVE_SECONDS`), and tells the supervisor before the relaunch. In the survivor a thread does the
writing (the main thread waits in a collective for the dead rank, where no Python runs): it takes the state
between two steps (``settling``: the trainer holds it while a step's update and its count change the state),
and writes it alone to the node-local level as a snapshot of one part, checksummed, refused if not finite
(:func:`~hpctrain.checkpoint.local.level.write_alone`). The relaunch's recovery takes it as any snapshot: the
failure costs the step in flight.

Offered where one rank's state is the run's: ``comm.mode = "sync"``, no sharded optimizer state, no split
model, and no buffers in the model (BatchNorm's running statistics change in the forward pass of the step in
flight, before its update). Elsewhere a failure resumes from the newest snapshot, and the run says why.
"""
import contextlib
import threading
import time

from .. import settings
from .poolsocket import connect, receive, send

SAVE_SECONDS = 2.0  # a survivor asked for its state is ended this long after its launch at most
LOCK_SECONDS = 1.0  # how long the writing thread waits for a step's update to end
OFFER_SECONDS = 10.0  # a pool that does not take the offer this soon is passed over


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
    name = (settings.get("WARM_POOL") or "").partition(":")[2]
    channel = connect(name, {"offer": True}, OFFER_SECONDS) if name else None
    if channel is None:
        return False
    channel.settimeout(None)
    threading.Thread(target=_keep, args=(channel, level, state, settling, run_config), name="hpctrain-survivor",
                     daemon=True).start()
    return True


def _keep(channel, level, state, settling, run_config):
    from ..checkpoint.local.level import write_alone

    try:
        record, _ = receive(channel)
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
    with contextlib.suppress(OSError):
        send(channel, answer)


# ---------------------------------------------------------------- in the warm pool
class Saves:
    """The pool's side of the survivors' state : the launch each rank belongs to, the ranks
    that offered to keep their state, the one asked (the lowest rank that offered) when a rank of its launch ends
    abnormally or the launch is torn down, its kill held back until it answers (at most :data:`SAVE_SECONDS`),
    and the supervisor's wait for the answers (:meth:`.warmpool.Pool.settle`)."""

    def __init__(self, kill):
        self.kill = kill  # ends a rank (the pool's SIGKILL)
        self.launch = {}  # rank pid -> (the launch's PMIx namespace, rank)
        self.offers = {}  # offer connection -> rank pid
        self.asked = {}  # launch -> {"pid", "rank", "deadline", "answer"}
        self.doomed = {}  # asked rank pid -> deadline: its stand-in is gone, its kill waits for its answer
        self.waiting, self.said, self.kept = [], [], None  # the supervisor's connections, what to tell it

    def joined(self, pid, env):
        from ..runtime.world import launch_of

        launch, rank = launch_of(env)
        self.launch[pid] = (launch, -1 if rank is None else rank)

    def ended(self, pid, alive):
        """Rank ``pid``'s launch is failing (it ended abnormally, or its stand-in is gone): ask a survivor."""
        launch = self.launch.get(pid, ("", -1))[0]
        if not launch or launch in self.asked:
            return
        offered = sorted((self.launch[p][1], p, c) for c, p in self.offers.items()
                         if self.launch.get(p, ("",))[0] == launch and (alive or p != pid))
        for rank, survivor, conn in offered:
            with contextlib.suppress(OSError):
                send(conn, {"save": True})
                self.asked[launch] = {"pid": survivor, "rank": rank, "answer": None,
                                      "deadline": time.monotonic() + SAVE_SECONDS}
                return

    def spared(self, pid):
        """``pid``'s stand-in is gone: True if its kill waits for its answer."""
        self.ended(pid, alive=True)
        for a in self.asked.values():
            if a["pid"] == pid and a["answer"] is None:
                self.doomed[pid] = a["deadline"]
                return True
        return False

    def answered(self, conn):
        pid, record = self.offers.pop(conn), None
        with contextlib.suppress(OSError, ValueError):
            record, _ = receive(conn)
        conn.close()
        self._settled(pid, record or {"why": "it ended before it answered"})

    def _settled(self, pid, answer):
        for a in self.asked.values():
            if a["pid"] == pid and a["answer"] is None:
                a["answer"] = answer
                if answer.get("written"):
                    self.kept = max(self.kept or 0, answer["step"])
                step = f"the state of step {answer['step']}" if "step" in answer else "its state"
                self.said.append(f"rank {a['rank']}, a survivor, wrote {step} to the node-local level in "
                                 f"{answer['seconds']:.2f} s" if answer.get("written") else
                                 f"rank {a['rank']}, a survivor, did not keep {step}: {answer['why']}")
        if self.doomed.pop(pid, None) is not None:
            self.kill(pid)

    def tick(self):
        now = time.monotonic()
        for a in self.asked.values():
            if a["answer"] is None and now >= a["deadline"]:
                self._settled(a["pid"], {"why": f"no answer in {SAVE_SECONDS:g} s"})
        if self.waiting and all(a["answer"] is not None for a in self.asked.values()):
            for conn in self.waiting:
                with contextlib.suppress(OSError):
                    send(conn, {"said": self.said, "kept": self.kept})
                conn.close()
            self.waiting, self.said, self.kept = [], [], None

    def timeout(self):
        pending = [a["deadline"] for a in self.asked.values() if a["answer"] is None]
        return max(0.01, min([1.0] + [d - time.monotonic() for d in pending]))
