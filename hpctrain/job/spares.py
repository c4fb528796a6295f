"""Warm spare ranks: ``hpctrain launch`` keeps the next launch's ranks started ahead of need.

A relaunch after a failure used to pay every rank's start-up again (the interpreter and torch, MPI, the
imports of the first optimizer step: 2-3 s here, far more from a parallel file system). A spare set is that
next launch, started once the running one trains: its ranks import, start MPI, then wait for a file (the
*call*) without using a core, and only then go on as any relaunch does (backend, run directory and its lock,
data, model, resume from the newest state). On a failure the supervisor calls the set instead of starting
ranks, and starts the next set once the called one trains.

Rank side: :func:`wait_until_called` (``HPCTRAIN_SPARE_CALL`` names the file; unset, it returns at once).
Supervisor side: :class:`Spares`. A set that ended before it was needed is replaced, never called; one that
does not match the relaunch (other ranks or nodes) is ended and the relaunch starts cold. The spares hold
about the memory of the ranks before their model is built; each set says what it holds once it is up.
Under ``srun`` a set is a step of the allocation beside the running one (``--overlap``), its ranks told
their call through the environment srun passes on, as mpirun's are with ``-x``."""
import contextlib
import json
import os
import shutil
import socket
import threading
import time

from .. import settings
from ..errors import BackendUnavailable
from ..runtime import startup
from . import preemption
from .launchers import Launch, Srun, end, kill_processes_with

CALL_POLL_SECONDS = 0.02  # how often a waiting spare looks for its call (a stat: no core used)
OWNER_SECONDS = 1.0  # how often it checks that its supervisor still runs
READY_WAIT_SECONDS = 60  # how long a relaunch waits for a set still starting, rather than start cold
GIVE_UP_AFTER = 3  # sets in a row that end before being called: spares are then left off, and it is said
# A set starts beside the training, on its cores (a relaunch's new set right after the restart): at the lowest
# priority its start-up yields the CPU to the training (memory bandwidth and caches it still shares: measured on 2
# cores, a starting set still costs the training about a second); a called rank goes back to the supervisor's.
# Ranks forked from the warm pool have no imports left to do: their set starts at the supervisor's priority (at
# the lowest, on cores the training fills, its few launch steps took 30-90 s) and waits at the lowest.
SET_NICENESS = 19


# ---------------------------------------------------------------- in the ranks
def warm_imports():
    # What a rank would otherwise import after the call: torch's compiler front end, which the first
    # optimizer step imports (about 0.9 s here), and Horovod's torch module (not started: its idle thread spins).
    with contextlib.suppress(ImportError):
        import torch._dynamo  # noqa: F401
    from ..backends import horovod_backend
    with contextlib.suppress(BackendUnavailable):  # the mpi backend, or a broken build: said when it is chosen
        horovod_backend.import_horovod()


def resident_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _owner_gone(owner):
    """Whether the supervisor ``host:pid`` is known to have ended (only checkable on its own host)."""
    host, _, pid = (owner or "").rpartition(":")
    if not pid.isdigit() or host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def wait_until_called(world):
    """In a spare rank (``HPCTRAIN_SPARE_CALL`` set): warm the imports, tell the supervisor the set is up
    (rank 0 writes ``CALL.ready``: ranks and resident bytes), then wait for ``CALL`` to exist. Ends the
    process quietly if the supervisor is gone or a stop signal came. The start-up from here on is what the
    restart costs (:func:`hpctrain.runtime.startup.called`). Returns whether this process was a spare."""
    call = settings.get("SPARE_CALL")
    if not call:
        return False
    warm_imports()
    back = settings.get("SPARE_NICENESS")
    if back is not None:  # waits at the lowest priority (where it started, or now: forked from the warm pool)
        _set_niceness(SET_NICENESS)
    held = world.comm.allreduce(resident_bytes())
    if world.is_root:
        _write_json(call + ".ready", {"ranks": world.size, "bytes": held, "pid": os.getpid()})
    owner, checked = settings.get("SPARE_OWNER"), time.monotonic()
    while not os.path.exists(call):
        if preemption.stop_requested() or (time.monotonic() - checked > OWNER_SECONDS and _owner_gone(owner)):
            os._exit(0)  # not needed: nothing was written, and the whole set ends alike
        if time.monotonic() - checked > OWNER_SECONDS:
            checked = time.monotonic()
        time.sleep(CALL_POLL_SECONDS)
    if back is not None:  # the training's own priority, now that it trains
        _set_niceness(int(back))
    startup.called()
    return True


def _set_niceness(niceness):
    for thread in os.listdir("/proc/self/task"):  # Linux keeps a niceness per thread
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(thread), niceness)


def _lowered(cmd, forked):
    """``cmd`` run at the lowest priority (``forked``: its ranks come from the warm pool, and lower themselves
    once started), and the niceness its ranks return to when called; or ``(cmd, None)`` under srun (its tasks are
    slurmd's children, not the launcher's) or where a rank could not return to it."""
    import resource

    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if (os.path.basename(cmd[0]) == Srun.name or niceness >= SET_NICENESS
            or not (os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - niceness)):
        return cmd, None
    return (cmd if forked else ["nice", "-n", str(SET_NICENESS - niceness), *cmd]), niceness


def _write_json(path, record):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


# ---------------------------------------------------------------- in the supervisor
def training_started(metrics_file):
    """A test, cheap to repeat, of whether a launch started now has begun training: a ``start`` record
    appended to ``metrics_file`` (rank 0 writes it before the first step)."""
    try:
        position = os.path.getsize(metrics_file)
    except OSError:
        position = 0
    seen = False

    def started():
        nonlocal position, seen
        if not seen:
            try:
                with open(metrics_file, "rb") as f:
                    f.seek(position)
                    lines = f.read().split(b"\n")
            except OSError:
                return False
            position += sum(len(line) + 1 for line in lines[:-1])  # a partly written last line: read again
            seen = any(b'"kind": "start"' in line for line in lines[:-1])
        return seen
    return started


class SpareSet:
    """One started set: its launcher process, the command it was started with, and the file that calls it."""

    def __init__(self, cmd, env, call):
        self.cmd, self.call, self.said, self.started = cmd, call, False, time.monotonic()
        env = dict(env, **{settings.name("SPARE_CALL"): call})
        run, niceness = _lowered(cmd, settings.name("WARM_POOL") in env)  # its start-up yields to the training
        if niceness is not None:
            env[settings.name("SPARE_NICENESS")] = str(niceness)
        self.launch = Launch(run, env, quiet=True)

    @property
    def child(self):
        return self.launch.child

    @property
    def alive(self):
        return self.child.poll() is None

    def ready(self):
        """``{"ranks", "bytes"}`` once every rank waits for the call, else None."""
        try:
            with open(self.call + ".ready") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wake(self):
        """Call the set: its ranks go on from here, and its output is passed through from now on."""
        _write_json(self.call, {"called": time.time()})
        self.launch.pass_on()

    def finish(self):
        return self.launch.finish()

    @property
    def survivors(self):
        return self.launch.survivors

    def stop(self):
        child = self.child
        if child.poll() is None:
            end(child)
        # Ranks the launcher was still starting when told to end (or all of them, had it to be killed) live on,
        # importing, holding memory: those on this host are found by their call (srun's on other nodes end at
        # the stop signal it passed on, once their imports are done)
        kill_processes_with(f"{settings.name('SPARE_CALL')}={self.call}")
        self.launch.finish()


class Spares:
    """Keeps ``count`` (0 or 1) set of spare ranks for the supervisor's next launch.

    ``command(ranks)``: the relaunch's launcher command for ``ranks``; ``env``: its environment;
    ``say(text)``: the supervisor's voice; ``max_bytes``: the resident memory a set may hold once up (0: any)."""

    def __init__(self, count, run_dir, env, command, say, max_bytes=0):
        self.count, self.env, self.command, self.say, self.max_bytes = count, env, command, say, max_bytes
        self.over = False  # a set held more than max_bytes: no more sets
        self.folder = os.path.join(run_dir, ".spares")
        self.current, self.made, self.ended_early = None, 0, 0
        self._lock = threading.Lock()
        self._watch = None
        self._stop_watching = threading.Event()
        self._stopping = []  # sets not used, ending beside the relaunch

    def keep_ready(self, ranks, training_started):
        """Start a set for a relaunch on ``ranks`` once ``training_started()`` (the running launch's ranks
        train: spares started beside their own start-up would slow it), replacing a set that ended; in a
        thread, until :meth:`pause`."""
        if not self.count:
            return
        self.pause()
        self._stop_watching = stop = threading.Event()
        self._watch = threading.Thread(target=self._keep, args=(ranks, training_started, stop), daemon=True)
        self._watch.start()

    def _keep(self, ranks, training_started, stop):
        while not stop.wait(0.25):
            if not training_started():
                continue
            with self._lock:
                if stop.is_set() or self.ended_early >= GIVE_UP_AFTER or self.over:
                    return
                current = self.current
                if current is not None and current.alive:
                    self._said_ready(current)
                    continue
                if current is not None:  # ended before it was needed: replaced, never called
                    self.ended_early += 1
                    self.say(f"warm spares: the set ended before it was needed (status "
                             f"{current.child.returncode}); "
                             + ("starting another" if self.ended_early < GIVE_UP_AFTER else
                                f"{GIVE_UP_AFTER} in a row: no more spares, relaunches start cold"))
                    current.stop()
                    self.current = None
                    if self.ended_early >= GIVE_UP_AFTER:
                        return
                self.made += 1
                os.makedirs(self.folder, exist_ok=True)
                call = os.path.join(self.folder, f"call-{os.getpid()}-{self.made}")
                self.current = SpareSet(self.command(ranks), self.env, call)

    def _said_ready(self, current):
        """Say once that a set is up; end it if it holds more than ``max_bytes``. Whether it may be called."""
        up = None if current.said else current.ready()
        if up is None:
            return True
        current.said = True
        held = f"{up['ranks']} rank(s) holding {up['bytes'] / 2**20:.0f} MiB resident"
        if self.max_bytes and up["bytes"] > self.max_bytes:
            self.over = True
            self.say(f"warm spares: {held}, more than --spares-memory {self.max_bytes / 2**20:g} MiB: ended, and no "
                     f"more sets (relaunches start cold)")
            current.stop()
            self.current = None if self.current is current else self.current
            return False
        self.ended_early = 0
        self.say(f"warm spares ready: {held}, {time.monotonic() - current.started:.1f} s to start (--spares 0: none)")
        return True

    def pause(self):
        """Start no set until :meth:`keep_ready` again (a set already started is kept)."""
        self._stop_watching.set()
        if self._watch is not None:
            self._watch.join()
            self._watch = None

    def take(self, ranks):
        """The set to call for a relaunch on ``ranks`` (its command must match), or None: then the relaunch
        starts cold, and a set that does not match is ended."""
        self.pause()
        with self._lock:
            current, self.current = self.current, None
        if current is None:
            return None
        fits = current.cmd == self.command(ranks)
        if fits:
            # a set still starting is further on than a cold launch would be: wait for it
            deadline = time.monotonic() + READY_WAIT_SECONDS
            while current.alive and current.ready() is None and time.monotonic() < deadline:
                time.sleep(CALL_POLL_SECONDS)
            if current.alive and current.ready() is not None:
                # up since the watch last looked: still said (and weighed) before the call
                return current if self._said_ready(current) else None
        why = ("the relaunch runs on other ranks or nodes" if not fits else
               "it ended before it was needed" if not current.alive else "it is not up yet")
        self.say(f"warm spares not used ({why}): starting the relaunch cold")
        # ended beside the relaunch, not before it: a set with a rank on a lost node may take its launcher's
        # whole grace to end (srun waiting on that node)
        stopping = threading.Thread(target=current.stop, daemon=True)
        stopping.start()
        self._stopping.append(stopping)
        return None

    def close(self):
        self.pause()
        with self._lock:
            current, self.current = self.current, None
        if current is not None:
            current.stop()
        for stopping in self._stopping:
            stopping.join()
        shutil.rmtree(self.folder, ignore_errors=True)
