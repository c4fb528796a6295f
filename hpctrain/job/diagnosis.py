"""What failed in a launch: the ranks' failure records (:func:`hpctrain.runtime.coordination.record`) and the
launcher's report. A rank killed by a signal writes nothing: :func:`launcher_events` reads which rank, host
and signal from what ``mpirun`` (Open MPI) or ``srun`` printed. :func:`diagnose` puts both together into one
:class:`Failure` and says whether relaunching can help (pure).

>>> diagnose(137, [], launcher_events("mpirun noticed that process rank 1 with PID 0 on node n3 "
...                                    "exited on signal 9 (Killed)."), hosts=["n3", "n3"]).describe()
'rank 1 on n3 was killed by signal 9 (SIGKILL)'
"""
import re
import signal
from dataclasses import dataclass
from typing import Optional

from ..errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_HUNG, EXIT_OTHER, EXIT_STOPPED


# ---------------------------------------------------------------- the launcher's report
_OMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+?) exited on signal (\d+)")
_OMPI_EXIT = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
_OMPI_ABORT = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+\s+with errorcode (\d+)")
_SRUN_TASK = re.compile(r"srun: error: (\S+?): tasks? ([\d,\-]+): (Killed|Exited with exit code (\d+)|.+)")
# Slurm lost the node (its slurmd died or stopped answering); with --no-kill the job goes on without it.
_SRUN_NODE_FAIL = re.compile(r"srun: error: Node failure on (\S+)")
_SIGNAL_NAMES = {"Killed": 9, "Terminated": 15, "Segmentation fault": 11, "Aborted": 6, "Bus error": 7}


def _task_ranks(text):
    ranks = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        ranks.extend(range(int(lo), int(hi or lo) + 1))
    return ranks


def launcher_events(text):
    """``[{"rank", "host", "signal", "status", "source"}]``: what ``mpirun`` or ``srun`` said
    about ranks that died, in the order printed (``host`` or ``signal`` ``None`` when not said).
    The first is what happened first; srun then reports the tasks it killed because of it."""
    found = []  # (position in the text, event)
    for m in _OMPI_SIGNAL.finditer(text):
        host = m.group(2).rstrip(".,")
        found.append((m.start(), {"rank": int(m.group(1)), "host": host, "signal": int(m.group(3)), "status": None,
                                  "source": "mpirun"}))
    for m in [*_OMPI_ABORT.finditer(text), *_OMPI_EXIT.finditer(text)]:
        found.append((m.start(), {"rank": int(m.group(1)), "host": None, "signal": None, "status": int(m.group(2)),
                                  "source": "mpirun"}))
    for m in _SRUN_TASK.finditer(text):
        what = m.group(3).strip()
        sig = _SIGNAL_NAMES.get(what)
        status = int(m.group(4)) if m.group(4) else None
        if sig is None and status is None:
            continue  # another srun error line
        for rank in _task_ranks(m.group(2)):
            found.append((m.start(), {"rank": rank, "host": m.group(1), "signal": sig, "status": status,
                                      "source": "srun"}))
    for m in _SRUN_NODE_FAIL.finditer(text):
        found.append((m.start(), {"rank": None, "host": m.group(1), "signal": None, "status": None,
                                  "source": "srun", "node_failure": True}))
    return [event for _, event in sorted(found, key=lambda pair: pair[0])]


# ---------------------------------------------------------------- one diagnosis
@dataclass
class Failure:
    """Why one launch of the job did not succeed, and whether a relaunch can help."""

    cause: str  # signal, exception, hang, exit, bad_input, diverged, stopped, failure, node_failure or stalled
    status: int  # the job's exit status as the supervisor passes it on
    restartable: bool
    rank: Optional[int] = None
    host: Optional[str] = None
    signal: Optional[int] = None
    error: Optional[str] = None  # the exception's type
    message: Optional[str] = None
    step: Optional[int] = None  # the step it failed in, when a record says so
    source: Optional[str] = None  # "record", "mpirun", "srun" or "exit status"

    def describe(self):
        who = "the job" if self.rank is None else f"rank {self.rank}" + (f" on {self.host}" if self.host else "")
        if self.cause == "signal":
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "?"
            return f"{who} was killed by signal {self.signal} ({name})"
        if self.cause == "node_failure":
            return f"node {self.host} failed (Slurm lost contact with it)"
        if self.cause == "stalled":
            return f"the ranks did not get through start-up (imports, MPI) in {self.message}: the launch was ended"
        if self.cause == "hang":
            return f"{who} hung{'' if self.step is None else f' in step {self.step}'} and the watchdog ended the job"
        what = {"bad_input": "stopped on bad input", "diverged": "diverged (non-finite training)",
                "stopped": "stopped on request", "exit": "called sys.exit alone"}.get(self.cause, "failed")
        error = f": {self.error}" if self.error else ""
        return f"{who} {what}{error} (exit status {self.status})"


def stalled(seconds):
    """The :class:`Failure` of a launch ended because its ranks did not get through start-up in ``seconds``
    (restartable: a launcher or MPI start-up that hung, often on one sick node, may go through the next time)."""
    return Failure("stalled", EXIT_OTHER, True, message=f"{seconds:g} s", source="supervisor")


def _host(rank, hosts):
    return hosts[rank] if hosts and rank is not None and 0 <= rank < len(hosts) else None


def _by_status(status):
    """(cause, restartable) of an exit status of `hpctrain train`."""
    return {EXIT_BAD_INPUT: ("bad_input", False), EXIT_STOPPED: ("stopped", False),
            EXIT_HUNG: ("hang", True), EXIT_DIVERGED: ("diverged", False)}.get(status, ("failure", True))


def diagnose(returncode, records=(), events=(), hosts=None):
    """One :class:`Failure` from the launcher's exit status, the ranks' records of this launch and the
    launcher's events (pure). The cause, by precedence: a node srun reports lost (``Node failure on n3``); a
    rank killed by a signal, when the launcher reports that first (the others' records describe the
    consequences); the first record of a rank that failed itself (not a ``RemoteError``: that names another
    rank's failure); what the launcher said; the exit status. Never restartable: bad input (2, the same error
    would repeat), a requested stop (3, the job script requeues) and divergence (5)."""
    events = list(events)
    # A lost node explains the ranks' hangs or collective errors with it: the cause, and the node to drop.
    lost = [e for e in events if e.get("node_failure")]
    if lost:
        return Failure("node_failure", EXIT_OTHER, True, host=lost[0]["host"], source=lost[0]["source"])
    if events and events[0].get("signal"):
        e = events[0]
        return Failure("signal", EXIT_OTHER, True, e["rank"], e["host"] or _host(e["rank"], hosts),
                       signal=e["signal"], source=e["source"])
    own = [r for r in records if r.get("error") != "RemoteError"]
    if own:
        first = min(own, key=lambda r: r.get("timestamp") or 0)
        status = int(first.get("status") or EXIT_OTHER)
        cause, restartable = _by_status(status)
        if first.get("kind") == "hang":
            cause, restartable = "hang", True
        elif cause == "failure":
            cause = "exit" if first.get("kind") == "exit" else "exception"
        return Failure(cause, status, restartable, first.get("rank"), first.get("host"), error=first.get("error"),
                       message=first.get("message"), step=first.get("step"), source="record")
    status = returncode if 0 < returncode < 128 else EXIT_OTHER
    rank, host, source = None, None, "exit status"
    if events:
        e = events[0]
        rank, host, source = e["rank"], e["host"] or _host(e["rank"], hosts), e["source"]
        if e.get("status"):
            status = e["status"]
    if (returncode < 0 or returncode > 128) and not events:  # a signal, with no rank named
        return Failure("signal", EXIT_OTHER, True, signal=-returncode if returncode < 0 else returncode - 128,
                       source=source)
    cause, restartable = _by_status(status)
    return Failure(cause, status, restartable, rank, host, source=source)
