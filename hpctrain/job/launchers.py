"""How ``hpctrain launch`` starts the ranks: the ``mpirun`` and ``srun`` command lines, and one
launch run to its end with its output passed through and its tail kept to read what failed."""
import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .. import settings
from ..runtime import slurm
from ..runtime.coordination import read_records
from . import diagnosis, survivor

PROGRAM = "hpctrain launch"  # the name its messages begin with
TAIL_BYTES = 64 * 1024  # of the launcher's output, kept to read which rank it says failed


def say(text):
    sys.stderr.write(f"{PROGRAM}: {text}\n")
    sys.stderr.flush()


# Open MPI ends the other ranks of a failed launch with SIGTERM, then SIGKILL after odls_base_sigkill_timeout
# (1 s) if they live on. They do: SIGTERM only sets hpctrain's stop flag (Slurm's end-of-job signal), and a rank
# waiting in a collective for the dead one never reaches the step that reads it. So each relaunch waited for
# that grace (measured: 6.2-6.5 s from a kill to mpirun's exit with it, 4.2 s without); nothing is lost
# without it, as a rank may be killed at any point (the checkpoints are atomic).
SIGKILL_TIMEOUT = "odls_base_sigkill_timeout"


class Mpirun:
    """``mpirun -n RANKS [--host h:k,...] -x HPCTRAIN_FAILURE_FILE [--mca odls_base_sigkill_timeout 0] [ARGS]
    CMD``. Open MPI's settings for root and oversubscription come from the environment (``OMPI_*``) or
    ``ARGS``; a grace of the user's own (``OMPI_MCA_odls_base_sigkill_timeout``, or in ``ARGS``) is kept."""

    name = "mpirun"

    def __init__(self, extra=()):
        self.extra = list(extra)

    def command(self, ranks, hosts, rank_cmd, exports=()):
        """``hosts``: ``{host: slots}`` to use (``None``: mpirun's own default); ``exports``: more
        ``HPCTRAIN_*`` settings the ranks get on every host."""
        cmd = ["mpirun", "-n", str(ranks)]
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{k}" for h, k in hosts.items())]
        for key in ("FAILURE_FILE", *exports):
            cmd += ["-x", settings.name(key)]
        if settings.mca(SIGKILL_TIMEOUT) is None and SIGKILL_TIMEOUT not in self.extra:
            cmd += ["--mca", SIGKILL_TIMEOUT, "0"]
        return cmd + self.extra + list(rank_cmd)


class Srun:
    """``srun --mpi=pmix --kill-on-bad-exit=1 -n RANKS [--exclude=... -N NODES] [--overlap] [ARGS] CMD``:
    one task that fails ends the step, as mpirun does."""

    name = "srun"

    def __init__(self, extra=()):
        self.extra = list(extra)

    def command(self, ranks, hosts, rank_cmd, excluded=(), overlap=False):
        """``overlap``: the step may share the allocation's CPUs with another (a warm spare set beside the
        running step, a relaunch beside the spares or a step still listed)."""
        cmd = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-n", str(ranks)]
        if excluded:
            cmd += [f"--exclude={','.join(excluded)}"]
            if hosts:
                cmd += ["-N", str(len(hosts))]
        if excluded or overlap:
            # Slurm keeps a step that ran on a node it lost cut off (not killed) "running" until
            # that node answers again, holding the CPUs of the other nodes too: without --overlap
            # the relaunch waits for them ("Requested nodes are busy"). The old ranks are gone.
            cmd.append("--overlap")
        return cmd + self.extra + list(rank_cmd)


def processes_with(*variables):
    """``{pid: environment}`` of every process of this host (but this one) whose environment holds all
    ``variables`` (``NAME=value`` each). Linux."""
    wanted, found = {v.encode() for v in variables}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = set(f.read().split(b"\0"))
            if wanted <= entries:
                found[int(name)] = dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)
    return found


def kill_processes_with(*variables):
    """SIGKILL to every process of this host (but this one) whose environment holds all ``variables``."""
    for pid in processes_with(*variables):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class StepEnder:
    """Watches an srun's error output. Once a task died of a signal (SIGKILL, a crash), its step is lost, and
    Slurm ends the other tasks, most waiting in a collective for the dead one, with SIGTERM (a stop request
    to hpctrain's ranks, which they never reach) and SIGKILL only after its KillWait (30 s by default), and
    will not signal a step it is ending any sooner. Those on this node are SIGKILLed at once instead, as
    mpirun ends its ranks (odls_base_sigkill_timeout 0). A task that exited with a status (a stop's save, an
    error) or of SIGTERM (a job's end, which the others may be saving for) leaves its step to Slurm. Before the
    kill, one task that survives is asked for the state of its last step (:func:`.survivor.ask_step`): what it
    answered is :attr:`survivors`."""

    CRASHES = {6, 7, 9, 11}  # SIGABRT, SIGBUS, SIGKILL, SIGSEGV, as srun names them
    STEP = re.compile(r"Terminating (?:StepId=|job step )(\d+)\.(\d+)\s")

    def __init__(self, active=True):
        self.text, self.step, self.active = "", None, active  # inactive: a spare set's step, until it is called
        self.survivors = ([], None)  # what to say of the survivor asked, the step it wrote (or None)

    def __call__(self, chunk):
        if self.step is not None or not self.active:
            return
        self.text = (self.text + chunk.decode(errors="replace"))[-16384:]
        step = self.STEP.search(self.text)
        crashed = [e for e in diagnosis.launcher_events(self.text) if e["source"] == "srun"
                   and e["signal"] in self.CRASHES]
        if step and crashed:
            self.step = f"{step.group(1)}.{step.group(2)}"
            say(f"task {crashed[0]['rank']} of step {self.step} died of signal {crashed[0]['signal']}: the step's "
                f"other tasks on this node are ended now, not after Slurm's KillWait")
            tasks = processes_with(*slurm.step_task_variables(step.group(1), step.group(2)))
            alive = {key[0] for key in map(slurm.task, tasks.values()) if key and key[0] is not None}
            self.survivors = survivor.ask_step(step.group(1), step.group(2), alive - {e["rank"] for e in crashed})
            for pid in tasks:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@dataclass
class Attempt:
    returncode: int
    tail: str  # the end of the launcher's output (stdout and stderr)
    records: list  # the ranks' failure records of this launch
    metrics: list  # the metrics.jsonl records this launch wrote
    seconds: float
    ended: float = 0.0  # when the launcher had exited (seconds since the epoch)
    stalled: float = 0.0  # the start-up timeout it was ended by (the ranks never got through start-up), or 0
    survivors: tuple = ([], None)  # under srun: what to say of the survivor asked, the step it wrote (or None)


class _Tee(threading.Thread):
    """Copies one pipe of the launcher to ours, keeping its last bytes to read. A warm spare set's output is
    held back until it is called (:meth:`pass_on`): one that is never called is never heard."""

    def __init__(self, pipe, out, passing=True, watch=None):
        super().__init__(daemon=True)
        self.pipe, self.out, self.tail = pipe, out, collections.deque()
        self.size, self.passing, self.held = 0, passing, []
        self.lock = threading.Lock()
        self.watch = watch  # told every chunk read

    def run(self):
        for chunk in iter(lambda: self.pipe.read1(65536), b""):
            if self.watch is not None:
                self.watch(chunk)
            with self.lock:
                if self.passing:
                    self._write(chunk)
                else:
                    self.held.append(chunk)
            self.tail.append(chunk)
            self.size += len(chunk)
            while self.size > TAIL_BYTES and len(self.tail) > 1:
                self.size -= len(self.tail.popleft())

    def _write(self, chunk):
        with contextlib.suppress(OSError, ValueError):
            self.out.write(chunk)
            self.out.flush()

    def pass_on(self):
        with self.lock:
            for chunk in self.held:
                self._write(chunk)
            self.held, self.passing = [], True

    def text(self):
        return b"".join(self.tail).decode(errors="replace")


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class Launch:
    """A started launcher: its process, and its output passed through (``quiet``: held back until
    :meth:`pass_on`) with the tail kept; srun's watched by a :class:`StepEnder`."""

    def __init__(self, cmd, env, quiet=False):
        self.child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.ender = StepEnder(active=not quiet) if os.path.basename(cmd[0]) == Srun.name else None
        self.tees = [_Tee(self.child.stdout, sys.stdout.buffer, not quiet),
                     _Tee(self.child.stderr, sys.stderr.buffer, not quiet, self.ender)]
        for t in self.tees:
            t.start()

    def pass_on(self):
        if self.ender is not None:
            self.ender.active = True
        for t in self.tees:
            t.pass_on()

    @property
    def survivors(self):
        """Under srun, after a task died: what to say of the survivor asked, the step it wrote (or None)."""
        return self.ender.survivors if self.ender else ([], None)

    def finish(self):
        """After the launcher ended: its output read to the end; the tail."""
        for t in self.tees:
            t.join(timeout=10)
        return self.tees[0].text() + "\n" + self.tees[1].text()


def changed(path):
    """A test (pure but for one ``stat``) of whether ``path`` was written since this call: its inode, size or
    modification time differs (so the clocks of other nodes do not matter)."""
    def stamp():
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns
    before = stamp()
    return lambda: stamp() not in (None, before)


def end(child, grace=10.0):
    """End a launcher: SIGTERM, which both launchers pass on to the ranks (mpirun ends them at once:
    odls_base_sigkill_timeout 0), SIGKILL after ``grace`` seconds; returns once it has exited."""
    child.terminate()
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _wait_started(child, up, timeout):
    """Wait for ``child`` while ``up()`` is false for at most ``timeout`` seconds. Returns whether that ran out:
    the launcher is then ended (:func:`end`)."""
    deadline = time.monotonic() + timeout
    while child.poll() is None and not up():
        if time.monotonic() >= deadline:
            end(child)
            return True
        time.sleep(0.5)
    return False


def run_launch(cmd, env, failure_file, metrics_file, started_child=lambda child: None, launch=None,
               up=None, start_timeout=0.0):
    """Run one launch to its end (``launch``: one started ahead, a warm spare set, called here);
    ``started_child(child)`` is told the process (to forward signals to), then ``None``. The records are
    those the launch appended. ``up()``, once true, says the ranks got through start-up (imports, MPI): a
    launch that has not within ``start_timeout`` seconds (0: no limit) is ended, ``stalled`` in the result."""
    offsets = _size(failure_file), _size(metrics_file)
    started = time.monotonic()
    if launch is None:
        launch = Launch(cmd, env)
    else:
        launch.wake()
    started_child(launch.child)
    stalled = start_timeout if up and start_timeout and _wait_started(launch.child, up, start_timeout) else 0.0
    returncode = launch.child.wait()
    ended = time.time()
    tail = launch.finish()
    started_child(None)
    return Attempt(returncode, tail, read_records(failure_file, offsets[0]),
                   read_records(metrics_file, offsets[1]), time.monotonic() - started, ended, stalled,
                   launch.survivors)
