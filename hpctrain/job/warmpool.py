"""The warm pool: one process per supervisor, on its host, that has done a rank's imports once (the interpreter,
torch and its compiler front end, h5py, Horovod, hpctrain) and forks each rank of ``hpctrain launch`` from there.

A rank's start-up is mostly imports: 2.8 s of CPU here, paid again by every rank of every relaunch and of every
warm spare set, on the cores the training uses. A rank forked from the pool starts with them done. It is the
process mpirun started that asks: ``python -m hpctrain train ...`` (:func:`enter`, before any import of
its own) finds ``HPCTRAIN_WARM_POOL`` naming a pool of its host, hands the pool its arguments, environment,
working directory, niceness, CPU binding and standard streams, and stays as the rank's stand-in for the
launcher: the signals it is sent go to the forked rank, and it ends as the rank ends (the same exit status, the
same signal). When it is killed, the pool kills the rank; when the pool is gone, it kills the rank itself. A
pool that is not there, not up yet, or was started for another Python, package or import-time environment is
no error: the rank starts as it would have (a cold start). MPI starts in the forked rank, never in the pool.

Only ranks of the supervisor's host, started by mpirun, use the pool: under srun a rank belongs to its step
(its cgroup, its accounting), which a process forked elsewhere would leave.
"""
import contextlib
import gc
import os
import select
import signal
import socket
import sys
import time

from .. import settings
from ..errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK, EXIT_STOPPED
from .poolsocket import address, connect, peer, receive, send

SERVE_FLAG = "--warm-pool-serve"  # ``python -m hpctrain --warm-pool-serve NAME``: the pool's own command line
READY = "ready"  # the pool's first line on its standard output, once its imports are done
REPLY_SECONDS = 10.0  # a pool that does not answer a rank this soon is passed over (the rank starts cold)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT,
             signal.SIGQUIT, signal.SIGTSTP)


# ---------------------------------------------------------------- in the rank mpirun started
def enter(argv, warm):
    """``python -m hpctrain ARGV``: where this process should run its command. Returns ``argv`` to run here (no
    pool offered, or it cannot take this rank); in the pool's forked rank, the arguments it was handed; never
    returns in a rank the pool ran (it ends as that rank ends), nor in the pool. ``warm()``: in the pool, the
    imports of the command its ranks run."""
    if argv[:1] == [SERVE_FLAG]:
        return _serve(argv[1], warm)
    host, _, name = (settings.get("WARM_POOL") or "").partition(":")
    if not name or argv[:1] != ["train"] or host != socket.gethostname():
        return argv
    pending = []  # signals sent while the pool is asked: the rank's, once there is one
    held = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in FORWARDED}
    sock = connect(name, _request(argv), REPLY_SECONDS, fds=(0, 1, 2))
    reply = None
    if sock is not None:
        with contextlib.suppress(OSError):
            reply, _ = receive(sock)
        if reply and "pid" in reply:
            sock.settimeout(None)
            _stand_in(sock, reply["pid"], pending)
        sock.close()
    if reply:
        print(f"hpctrain: warm pool not used ({reply.get('refused')}): starting cold", file=sys.stderr, flush=True)
    for sig, handler in held.items():
        signal.signal(sig, handler)
    if pending:  # taken as `hpctrain train` takes them from its first line on (a stop request), or as they come
        from . import preemption
        preemption.install()
        for sig in pending:
            os.kill(os.getpid(), sig)
    return argv


def _request(argv):
    from ..runtime import startup

    return {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path,
            "executable": sys.executable, "package": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            "umask": _umask(), "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "cpus": sorted(os.sched_getaffinity(0)), "started": startup.process_started()}


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stand_in(sock, pid, pending):
    """Until the forked rank ``pid`` ends: pass the signals this process gets (and got: ``pending``) on to it;
    then end alike. Never returns."""
    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    for sig in pending:
        forward(sig, None)
    record, _ = receive(sock)
    if record is None:  # the pool is gone, and with it whoever would say how the rank ended
        forward(signal.SIGKILL, None)
        print(f"hpctrain: the warm pool ended under rank process {pid}: it is ended too", file=sys.stderr,
              flush=True)
        os._exit(1)
    code = record["exit"]
    sys.stdout.flush()
    if code < 0:  # ended by a signal: so is this process, as the launcher would have seen it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to undo
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    os._exit(code if code >= 0 else 128 - code)


# ---------------------------------------------------------------- the pool
def _serve(name, warm):
    """The pool: warm up (``warm()``: the command's imports), say so, fork a rank for each request until the
    supervisor is gone and no rank runs. Returns (in a forked rank only) the arguments that rank runs."""
    from . import spares

    parent = os.getppid()
    spares.warm_imports()  # torch's compiler front end and Horovod, as a spare rank does before its call
    warm()
    torch = sys.modules.get("torch")
    # MPI or CUDA started here would be every forked rank's, shared (CUDA refuses to run in a forked child): never
    started = "MPI" if "mpi4py.MPI" in sys.modules else "CUDA" if torch and torch.cuda.is_initialized() else None
    if started:
        print(f"hpctrain: the warm pool's imports started {started}: no warm pool", file=sys.stderr, flush=True)
        return os._exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(name))
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select below
    signal.signal(signal.SIGTERM, _end)  # the supervisor's end: no rank is left behind
    signal.set_wakeup_fd(wake_w)
    gc.freeze()  # the objects of the imports are shared with every rank: no collection copies their pages
    print(READY, spares.resident_bytes(), flush=True)
    from .survivor import Saves

    _POOL["pid"], ranks, saves = os.getpid(), _POOL["ranks"], Saves(_kill)  # ranks: connection -> pid
    _POOL["saves"] = saves
    while os.getppid() == parent or ranks or saves.doomed:
        readable, _, _ = select.select([listener, wake_r, *ranks, *saves.offers], [], [], saves.timeout())
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(ranks, saves)
        for conn in [c for c in readable if c in ranks]:
            with contextlib.suppress(OSError):
                if conn.recv(1):
                    continue
            pid = ranks.pop(conn)
            conn.close()
            if not saves.spared(pid):  # the rank's stand-in is gone (killed with its launch): so goes the rank
                _kill(pid)
        for conn in [c for c in readable if c in saves.offers]:
            saves.answered(conn)
        if listener in readable:
            argv = _take(listener, ranks, saves, (listener, wake_r, wake_w))
            if argv is not None:
                return argv
        saves.tick()  # after _take: a supervisor's wait with nothing pending is answered now, not at the next wake
    return os._exit(0)


_POOL = {"pid": None, "ranks": {}, "saves": None}  # the pool's pid, its ranks by connection, its saves (for _end)


def _end(signum, frame):
    if os.getpid() == _POOL["pid"]:  # not a rank just forked, before it took the default back
        for pid in [*_POOL["ranks"].values(), *(_POOL["saves"].doomed if _POOL["saves"] else ())]:
            _kill(pid)
    os._exit(128 + signum)


def _take(listener, ranks, saves, own):
    """Accept one request; fork its rank (or take a rank's offer, or the supervisor's wait: :class:`_Saves`). In
    the forked rank, its arguments; in the pool, None."""
    conn, _ = listener.accept()
    conn.settimeout(REPLY_SECONDS)
    try:
        pid, uid, _ = peer(conn)
        request, fds = receive(conn, max_fds=3)
    except (OSError, ValueError):
        conn.close()
        return None
    if request and uid == os.getuid() and (request.get("offer") or request.get("settle")) and not fds:
        conn.settimeout(None)
        if request.get("settle"):
            saves.waiting.append(conn)
        elif pid in ranks.values():
            saves.offers[conn] = pid
        else:
            conn.close()
        return None
    why = _refusal(request, uid, fds)
    if why:
        with contextlib.suppress(OSError):  # a stand-in gone meanwhile: none of the pool's concern
            send(conn, {"refused": why})
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        for c in (*ranks, *saves.offers, *saves.waiting):
            c.close()
        listener.close()
        conn.close()
        for fd in own[1:]:
            os.close(fd)
        return _become(request, fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        send(conn, {"pid": child})
    conn.settimeout(None)
    ranks[conn] = child
    saves.joined(child, request["env"])
    return None


def _refusal(request, uid, fds):
    """Why the pool cannot fork this rank, or None."""
    if request is None or len(fds) != 3:
        return "an incomplete request"
    if uid != os.getuid():
        return f"asked by user id {uid}, not the pool's {os.getuid()}"
    if request["executable"] != sys.executable:
        return f"the rank runs {request['executable']}, the pool {sys.executable}"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if request["package"] != package:
        return f"the rank's hpctrain is {request['package']}, the pool's {package}"
    differ = [k for k, v in settings.import_time_environment(request["env"]).items()
              if v != settings.import_time_environment().get(k)]
    if differ:
        return f"{', '.join(differ)} differ(s) from the pool's, and take effect at import"
    return None


def _become(request, fds):
    """In the forked process: become the rank the request describes; its arguments."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, *FORWARDED):
        signal.signal(sig, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv[1:] = request["argv"]
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, request["niceness"])
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, request["cpus"])
    from ..runtime import startup
    startup.started_at(request["started"])
    return request["argv"]


def _reap(ranks, saves):
    """Tell each ended rank's stand-in how it ended; a rank that failed has its survivors asked for their state."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        if code not in (EXIT_OK, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_DIVERGED):  # bad input or divergence: on
            # every rank, and no state worth resuming from; a stop has saved already
            saves.ended(pid, alive=False)
        for conn, rank in list(ranks.items()):
            if rank == pid:
                with contextlib.suppress(OSError):
                    send(conn, {"exit": code})
                conn.close()
                del ranks[conn]


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- in the supervisor
class Pool:
    """The supervisor's pool: :meth:`start` it, :meth:`wait_up` before the first launch, :meth:`close` at the end.
    ``environ``: what the ranks get from mpirun (the pool's import-time environment must be theirs); ``exports``
    names what mpirun must pass on for the ranks to find it."""

    UP_SECONDS = 60.0  # the first launch waits this long for the pool, then starts cold
    exports = ("WARM_POOL",)

    def __init__(self, python, environ, say):
        self.python, self.say, self.child, self.up = python, say, None, False
        self.name = f"hpctrain-warm-pool-{os.getpid()}-{os.urandom(4).hex()}"
        self.environ = dict(environ)
        self.environ.pop(settings.name("WARM_POOL"), None)

    def env(self):
        """What tells a rank of this host where the pool is."""
        return {settings.name("WARM_POOL"): f"{socket.gethostname()}:{self.name}"}

    def start(self):
        import subprocess

        self.started = time.monotonic()
        self.child = subprocess.Popen([self.python, "-m", "hpctrain", SERVE_FLAG, self.name], env=self.environ,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)

    def wait_up(self):
        """Wait (at most :attr:`UP_SECONDS`) for the pool's imports; say how it went."""
        said, deadline = [], self.started + self.UP_SECONDS
        while said[:1] != [READY]:  # an import may have printed a line of its own before
            ready, _, _ = select.select([self.child.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.child.stdout.readline() if ready else b""
            if not line:
                break
            said = line.decode(errors="replace").split()
        self.up = said[:1] == [READY]
        if self.up:
            self.say(f"warm pool up in {time.monotonic() - self.started:.1f} s, {int(said[1]) / 2**20:.0f} MiB "
                     f"resident: this host's ranks are forked from it with their imports done, at every launch, "
                     f"relaunch and spare set (--no-warm-pool: none)")
        else:
            self.say(f"warm pool not up after {time.monotonic() - self.started:.0f} s: the ranks start cold")
        return self.up

    def settle(self):
        """After a failed launch: wait for the survivors' saves the pool asked for (at most
        :data:`.survivor.SAVE_SECONDS` and one more); ``(what the pool says of them, the newest step one wrote or
        None)``."""
        from .survivor import SAVE_SECONDS

        sock = connect(self.name, {"settle": True}, SAVE_SECONDS + 1.0) if self.up else None
        if sock is None:
            return [], None
        with sock:
            try:
                record, _ = receive(sock)
            except OSError:  # it did not answer in time: the relaunch resumes from what is there
                record = None
        record = record or {}
        return record.get("said", []), record.get("kept")

    def close(self):
        if self.child is None or self.child.poll() is not None:
            return
        self.child.terminate()
        try:
            self.child.wait(10)
        except Exception:  # subprocess.TimeoutExpired: it is in no state to be waited for
            self.child.kill()
            self.child.wait()
