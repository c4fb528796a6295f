"""A world of ranks kept for many jobs: the test harness's launches of one rank count run here one after
another, each as ``mpirun -n N python JOB...`` would have run it, without starting the interpreter, torch,
MPI and Horovod again for each (tests/mpi_harness.py, ``Pool``).

    mpirun -n N python tests/mpi/pool.py DIR HARNESS_PID

Every rank waits for DIR/job-<k>.json (k = 0, 1, ...: ``{"args", "env", "cwd", "timeout"}``, ``args`` as for
mpirun: a ``.py`` path run as ``__main__``, ``-m module ...`` or ``-c code ...``; ``{"stop": true}`` ends the
pool), runs it and writes DIR/job-<k>.<rank>.out and .err (file descriptors 1 and 2, so what C libraries and
other threads print is kept too), then DIR/job-<k>.<rank>.status: the exit status (0, the ``SystemExit``
code, or 1 for an exception, whose traceback goes to .err) and the job's seconds. Waiting costs no CPU: the
ranks poll the folder, not MPI, and Horovod is shut down after every job that started it (its background
thread otherwise cycles every 0.2 ms, busy, between jobs).

A job that ends its ranks (MPI_Abort, a kill, one rank's exit) ends the pool as it would end its own launch;
the harness reports it as such and starts a new pool for the next job. A job that outlives its timeout on
any rank ends the pool too (MPI_Abort, status 124), saying so in that rank's .err: a hung job never holds the
suite. What one job changes in the process is undone before the next: the environment, the working
directory, ``sys.argv``, ``sys.path``, the modules imported from outside hpctrain and the installed packages
(the user's package of a test, an example's module, the script itself), a stop signal received, torch's
generator (reset to the seed a new process has) and thread count, and the attributes of hpctrain's modules
and classes (and of a few others) that a job replaced.
"""
import json
import os
import runpy
import sys
import sysconfig
import threading
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Modules from these folders stay imported between jobs; any other module a job imported is imported afresh
# by the next job that needs it, as in a new process.
KEPT = tuple(os.path.realpath(p) + os.sep for p in
             {*(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")),
              os.path.join(ROOT, "hpctrain")})
POLL = 0.01  # seconds between looks for the next job
# Modules whose attributes a job may replace (a test script slowing or breaking one function of hpctrain, as
# tests/mpi/interval_train.py does) and that outlive the job: put back as they were after every job.
PATCHED = ("hpctrain", "os", "time", "shutil", "torch", "h5py", "numpy")


def _kept(module):
    path = getattr(module, "__file__", None)
    return path is None or os.path.realpath(path).startswith(KEPT)


def _run(args):
    """Run one job's command line in this process; its exit status."""
    first, rest = str(args[0]), [str(a) for a in args[1:]]
    try:
        if first == "-m":
            sys.argv = [rest[0], *rest[1:]]
            runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
        elif first == "-c":
            sys.argv = ["-c", *rest[1:]]
            sys.path.insert(0, "")
            exec(compile(rest[0], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = [first, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(first)))
            runpy.run_path(first, run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: B902 - reported as the job's failure, as an uncaught exception would be
        traceback.print_exc()
        return 1


class _Deadline:
    """Ends the whole pool when a job outlives its timeout on this rank."""

    def __init__(self, what, rank, timeout):
        self.what, self.rank, self.timeout = what, rank, timeout
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def _watch(self):
        if self.done.wait(self.timeout):
            return
        from mpi4py import MPI

        os.write(2, f"pool: {self.what} did not finish in {self.timeout} s on rank {self.rank}: ending the "
                    f"launch\n".encode())
        MPI.COMM_WORLD.Abort(124)


def _namespaces():
    """The attribute dictionaries a job may change: those of the modules in ``PATCHED`` (hpctrain's
    submodules included) and of the classes hpctrain defines."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name in PATCHED or name.startswith("hpctrain.")):
            continue
        found.append(module)
        if name.startswith("hpctrain"):
            found += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
    return found


def _snapshot():
    return [(owner, dict(vars(owner))) for owner in _namespaces()]


def _restore(snapshot):
    """Put back what a job replaced; what it added is taken away from hpctrain's own modules and classes only
    (other packages add attributes as they load their submodules lazily)."""
    for owner, saved in snapshot:
        current = vars(owner)
        ours = getattr(owner, "__name__", "").startswith("hpctrain") or isinstance(owner, type)
        for key in [k for k, v in current.items() if k not in saved and ours and not k.startswith("__")
                    and not isinstance(v, types.ModuleType)]:  # a submodule imported since stays imported
            delattr(owner, key)
        for key, value in saved.items():
            if current.get(key, saved) is not value and not key.startswith("__"):
                setattr(owner, key, value)


class _Process:
    """What a job may change in this process, saved before it and put back after."""

    def __init__(self):
        import torch

        self.torch = torch
        self.seed = torch.initial_seed()
        self.threads = torch.get_num_threads()

    def __enter__(self):
        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.argv, self.path, self.modules = list(sys.argv), list(sys.path), set(sys.modules)
        self.attributes = _snapshot()
        self.torch.manual_seed(self.seed)
        return self

    def __exit__(self, *exc):
        from hpctrain.job import preemption

        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and hvd.is_initialized():
            hvd.shutdown()
        preemption.uninstall()
        preemption.reset()
        _restore(self.attributes)
        for name in set(sys.modules) - self.modules:
            if not _kept(sys.modules[name]):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv[:], sys.path[:] = self.argv, self.path
        self.torch.set_num_threads(self.threads)
        self.torch.set_grad_enabled(True)


def run_job(job, stem, rank, process):
    """Run ``job`` with its output in ``stem``.out/.err; its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with process, open(stem + ".out", "wb") as o, open(stem + ".err", "wb") as e:
        for name, value in (job.get("env") or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        os.chdir(job.get("cwd") or ROOT)
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            with _Deadline(" ".join(map(str, job["args"]))[:200], rank, job["timeout"]):
                return _run(job["args"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _save_coverage():
    """Under `make coverage`, what this job ran is written now: a later job that ends the pool (an abort, a
    kill) would otherwise take every earlier job's lines with it."""
    coverage = sys.modules.get("coverage")
    current = coverage and coverage.Coverage.current()
    if current is not None:
        current.save()


def _next_job(folder, k, harness):
    """The k-th job, once the harness has written it; None when the harness is gone."""
    path = os.path.join(folder, f"job-{k}.json")
    checked = time.monotonic()
    while not os.path.exists(path):
        time.sleep(POLL)
        if time.monotonic() - checked > 1:
            checked = time.monotonic()
            try:
                os.kill(harness, 0)
            except ProcessLookupError:
                return None
    with open(path) as f:
        return json.load(f)


def main(argv):
    folder, harness = argv[0], int(argv[1])
    # What every job would import first, imported once for all of them.
    import h5py  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    from mpi4py import MPI

    import hpctrain.training.trainer  # noqa: F401
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        pass
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    process = _Process()
    with open(os.path.join(folder, f"ready.{rank}"), "w"):
        pass
    k = 0
    while True:
        job = _next_job(folder, k, harness)
        if job is None or job.get("stop"):
            break
        comm.Barrier()  # every rank has the job: none starts it while another still ends the last one
        stem = os.path.join(folder, f"job-{k}.{rank}")
        started = time.monotonic()
        status = run_job(job, stem, rank, process)
        _save_coverage()
        with open(stem + ".status.tmp", "w") as f:
            f.write(f"{status} {time.monotonic() - started:.3f}")
        os.replace(stem + ".status.tmp", stem + ".status")
        k += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
