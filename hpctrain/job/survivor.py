"""The survivors' state. When a rank of a data-parallel launch dies, every rank that survives it holds the
whole state of the last step it finished, and would lose it when the launcher ends them: the relaunch would
compute again every step since the newest snapshot. So a rank offers to keep it, to whoever sees a rank die
first. Under mpirun, the warm pool (:mod:`.warmpool`), whose children the ranks of its host are: it asks one
survivor of that launch (the lowest rank that offered), holds its kill back while it writes (at most
:data:`SAVE_SECONDS`), and tells the supervisor before the relaunch. Under srun, ``hpctrain launch`` reads
srun's report of a task that died (:class:`.launchers.StepEnder`): before it ends the step's other tasks on its
node, it asks the lowest of them on the socket that task listens on (:func:`step_name`), and waits for the
answer (:func:`ask_step`). In the survivor a thread does the
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
import os
import socket
import threading
import time

from .. import settings
from ..runtime import slurm
from .poolsocket import address, connect, peer, receive, send

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


def step_name(job, step, task):
    """The socket task ``task`` of srun step ``job.step`` is asked on (in Linux's abstract namespace)."""
    return f"hpctrain-survivor-{job}.{step}.{task}"


def asked_by_srun(environ=None):
    """Whether this rank is a task of a step ``hpctrain launch`` started with srun, which asks a survivor."""
    return settings.get("SURVIVOR", environ=environ) == "srun" and slurm.task_key(environ) is not None


def offer(level, state, settling, run_config=None):
    """A thread waits for the question of whoever sees another rank die first: in a rank forked from the warm
    pool, the pool; in a task of an srun step ``hpctrain launch`` started, the supervisor. Who asks (to say
    it), or None where no one does."""
    name = (settings.get("WARM_POOL") or "").partition(":")[2]
    channel = connect(name, {"offer": True}, OFFER_SECONDS) if name else None
    if channel is not None:
        channel.settimeout(None)
        serve, who = (lambda: _keep(channel, level, state, settling, run_config)), "the warm pool asks it"
    elif asked_by_srun():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address(step_name(*slurm.task_key())))
            listener.listen(4)
        except OSError:
            listener.close()
            return None
        serve = lambda: _answer_questions(listener, level, state, settling, run_config)  # noqa: E731
        who = "hpctrain launch asks it once srun reports the failure"
    else:
        return None
    threading.Thread(target=serve, name="hpctrain-survivor", daemon=True).start()
    return who


def _answer_questions(listener, level, state, settling, run_config):
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            with contextlib.suppress(OSError):
                if peer(conn)[1] == os.getuid():  # another user's process may not make it write
                    _keep(conn, level, state, settling, run_config)


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


def describe(rank, answer):
    """What the supervisor says of survivor ``rank``'s ``answer``."""
    step = f"the state of step {answer['step']}" if "step" in answer else "its state"
    return (f"rank {rank}, a survivor, wrote {step} to the node-local level in {answer['seconds']:.2f} s"
            if answer.get("written") else f"rank {rank}, a survivor, did not keep {step}: {answer['why']}")


# ---------------------------------------------------------------- in hpctrain launch, under srun
def ask_step(job, step, tasks):
    """srun step ``job.step`` lost a task: ask the lowest of ``tasks`` (this node's that survive it) that listens
    for its state, and wait for its answer (at most :data:`SAVE_SECONDS`). ``(what to say, the step written or
    None)``."""
    for task in sorted(tasks):
        conn = connect(step_name(job, step, task), {"save": True}, SAVE_SECONDS)
        if conn is None:  # it did not offer (a run that cannot keep its state), or it is gone
            continue
        with conn:
            try:
                answer, _ = receive(conn)
            except (OSError, ValueError):
                answer = None
        answer = answer or {"why": f"no answer in {SAVE_SECONDS:g} s"}
        return [describe(task, answer)], answer["step"] if answer.get("written") else None
    return [], None


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
                self.said.append(describe(a["rank"], answer))
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
