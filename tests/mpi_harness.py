"""Launch real ranks with mpirun from tests: every launch has a timeout, every rank's
output is kept, and a failure on any rank fails the test.

Most launches do not need a world of their own: ``mpirun(n, args)`` runs them in a pool of ``n`` ranks
started once and kept (tests/mpi/pool.py), which runs each job as a launch of its own would, in a fresh
``__main__`` with its own environment, working directory, output and exit status, but without starting the
interpreter, torch, MPI and Horovod again (1.5-2 s a rank here). A job that ends its ranks (a kill, an
abort, a hang past its timeout) ends its pool as it would end its own launch, and the next job gets a new
one. A launch gets a world of its own (``fresh=True``) where the test says so, where it changes what a
process reads when it starts (``AT_START``), or where the pool does not keep that rank count.

The Open MPI settings for running as root and oversubscribing this small machine belong
here (and in the job scripts), never in library code.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEFAULT_TIMEOUT = 180
POOL_SCRIPT = ROOT / "tests" / "mpi" / "pool.py"
# Rank counts kept as pools (larger worlds are rare in the suite and would hold memory idle).
POOL_RANKS = (1, 2, 3, 4)
# Variables that a process, MPI or Horovod read when they start: a launch that sets one of these otherwise
# than the pool was started with gets a world of its own. (hpctrain reads its own HPCTRAIN_* settings when
# it needs them, except the allocator's, which are applied once per process.)
AT_START = ("PYTHON", "OMPI_", "PMIX_", "HOROVOD_", "OMP_", "MKL_", "LD_", "MALLOC_", "HPCTRAIN_MALLOC",
            "CUDA_")


def have_horovod():
    """Whether Horovod is installed (make setup builds it; a bare venv may lack it)."""
    import importlib.util

    return importlib.util.find_spec("horovod") is not None



# A skip marker for tests (or parameters) that run Horovod, where it is not installed.
needs_horovod = pytest.mark.skipif(not have_horovod(), reason="Horovod is not installed (make setup)")


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "true",
        "OMPI_MCA_mpi_yield_when_idle": "true",
        # Loopback and shared memory only: no probing of other interfaces on a test machine.
        "OMPI_MCA_btl": "self,vader,tcp",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.setdefault("OMP_NUM_THREADS", "1")
    for name, value in (extra or {}).items():  # None: not set at all, as on a user's machine
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def check_launch(needed):
    """Replaced by tests/conftest.py while a test runs: fails a test that launches without its marker."""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    args: list
    ranks: list = field(default_factory=list)  # each rank's own stdout + stderr, when asked for

    @property
    def output(self):
        return self.stdout + self.stderr

    def check(self):
        assert self.returncode == 0, (
            f"{' '.join(self.args)} exited {self.returncode}\n--- stdout\n{self.stdout[-6000:]}"
            f"\n--- stderr\n{self.stderr[-6000:]}")
        return self


def mpirun(n, args, timeout=DEFAULT_TIMEOUT, env=None, cwd=None, check=False, per_rank=False, fresh=False):
    """Run ``mpirun -n N <args>``; ``args`` starting with a ``.py`` path, ``-m`` or ``-c`` run under
    this interpreter, in a pool of ranks unless ``fresh`` (see the module's docstring). Kills the whole
    launch on timeout and fails the test.

    ``per_rank``: also keep each rank's output apart (``Result.ranks``). mpirun's own streams
    interleave the ranks' writes mid-line, so a message counted "on every rank" is counted there."""
    check_launch("mpi")
    python = bool(args) and (str(args[0]).endswith(".py") or args[0] in ("-m", "-c"))
    full_env = mpi_env(env)
    pooled = python and not fresh and n in POOL_RANKS and _same_at_start(full_env, _POOL_ENV)
    _note_launch(n, args, pooled, fresh, full_env)
    if pooled:
        result = _pool(n).run([str(a) for a in args], full_env, cwd or ROOT, timeout)
        return result.check() if check else result
    if python:
        args = [PYTHON] + list(args)
    with tempfile.TemporaryDirectory(prefix="hpctrain-ranks-") as apart:
        keep = ["--output-filename", apart] if per_rank else []
        cmd = ["mpirun", "-n", str(n), "--timeout", str(timeout)] + keep + [str(a) for a in args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                                  env=full_env, cwd=cwd or ROOT)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout + 30}s:\n"
                                 f"{(exc.stdout or b'')[-4000:]}\n{(exc.stderr or b'')[-4000:]}")
        ranks = [_rank_output(Path(apart), r) for r in range(n)] if per_rank else []
    result = Result(proc.returncode, proc.stdout, proc.stderr, cmd, ranks)
    return result.check() if check else result


def _rank_output(folder, rank):
    """What one rank wrote, as Open MPI keeps it under ``--output-filename`` (job 1)."""
    own = folder / "1" / f"rank.{rank}"
    return "".join((own / name).read_text(errors="replace") for name in ("stdout", "stderr")
                   if (own / name).exists())


def hpctrain(n, *args, **kwargs):
    """``mpirun -n N python -m hpctrain ARGS``."""
    return mpirun(n, ["-m", "hpctrain", *args], **kwargs)


def command(*args, timeout=120, cwd=None, env=None):
    """``hpctrain ARGS`` for the commands that run in one process without MPI (``ckpt``, ``report``), run by
    the pool of one rank: the same command line and output, without importing torch and h5py again."""
    return mpirun(1, ["-m", "hpctrain", *map(str, args)], timeout=timeout, cwd=cwd, env=env)



def _note_launch(n, args, pooled, fresh, env):
    """One line per launch into the file HPCTRAIN_TEST_LAUNCHES names (if set): how the suite's launches
    went, pooled or not and why (docs/testing.md counts them)."""
    path = os.environ.get("HPCTRAIN_TEST_LAUNCHES")
    if not path:
        return
    why = ("pool" if pooled else "fresh=True" if fresh else f"{n} ranks" if n not in POOL_RANKS else
           "not python" if not (str(args[0]).endswith(".py") or args[0] in ("-m", "-c")) else
           "at start: " + ",".join(sorted(k for k in {*env, *_POOL_ENV} if k.startswith(AT_START)
                                          and env.get(k) != _POOL_ENV.get(k))))
    with open(path, "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "ranks": n,
                            "how": why, "args": [str(a) for a in args][:3]}) + "\n")


# ---------------------------------------------------------------- pools of ranks
def _same_at_start(env, pool_env):
    keys = {k for k in (*env, *pool_env) if k.startswith(AT_START)}
    return all(env.get(k) == pool_env.get(k) for k in keys)


_POOL_ENV = mpi_env()  # the environment every pool starts with: the tests' own, taken at import
_pools = {}


def _pool(n):
    pool = _pools.get(n)
    if pool is None or not pool.alive():
        pool = _pools[n] = Pool(n)
    return pool


@atexit.register
def close_pools():
    while _pools:
        _pools.popitem()[1].close()


class Pool:
    """``n`` ranks under one mpirun (tests/mpi/pool.py) that run the jobs handed to them one after another."""

    def __init__(self, n):
        self.n = n
        self.folder = Path(tempfile.mkdtemp(prefix=f"hpctrain-pool{n}-"))
        self.k = 0
        self.log = open(self.folder / "mpirun.log", "wb")
        cmd = ["mpirun", "-n", str(n), PYTHON, str(POOL_SCRIPT), str(self.folder), str(os.getpid())]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_POOL_ENV, cwd=ROOT)

    def alive(self):
        return self.proc.poll() is None

    def run(self, args, env, cwd, timeout):
        """One job: its :class:`Result`, as ``mpirun -n N args`` would have given it."""
        k, self.k = self.k, self.k + 1
        job = self.folder / f"job-{k}.json"
        (self.folder / "next.tmp").write_text(json.dumps({"args": args, "env": env, "cwd": str(cwd),
                                                          "timeout": timeout}))
        os.replace(self.folder / "next.tmp", job)
        stems = [self.folder / f"job-{k}.{r}" for r in range(self.n)]
        deadline = time.monotonic() + timeout + 60  # the ranks' own deadline ends the pool before this one
        while not all(Path(f"{s}.status").exists() for s in stems):
            if not self.alive() or time.monotonic() > deadline:
                return self._ended(args, stems, timeout)
            time.sleep(0.005)
        outputs = [(_read(Path(f"{s}.out")), _read(Path(f"{s}.err")), Path(f"{s}.status").read_text().split())
                   for s in stems]
        codes = [int(status[0]) for _, _, status in outputs]
        code = next((c for c in codes if c != 0), 0)
        return Result(code, "".join(o for o, _, _ in outputs), "".join(e for _, e, _ in outputs),
                      ["mpirun", "-n", str(self.n), PYTHON, *args], [o + e for o, e, _ in outputs])

    def _ended(self, args, stems, timeout):
        """The job ended the pool (a rank killed or aborted, or past its timeout): what a launch of its own
        would have shown, with mpirun's own words, and the pool is gone."""
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"mpirun -n {self.n} {' '.join(args)} did not finish in {timeout + 60}s:\n"
                                 + "".join(_read(Path(f"{s}.err"))[-2000:] for s in stems))
        self.log.close()
        said = _read(self.folder / "mpirun.log")
        code = self.proc.returncode or 1
        outs = [_read(Path(f"{s}.out")) for s in stems]
        errs = [_read(Path(f"{s}.err")) for s in stems]
        result = Result(code, "".join(outs), "".join(errs) + said, ["mpirun", "-n", str(self.n), PYTHON, *args],
                        [o + e for o, e in zip(outs, errs)])
        shutil.rmtree(self.folder, ignore_errors=True)
        if "did not finish in" in result.stderr and code == 124:
            raise AssertionError(f"mpirun -n {self.n} {' '.join(args)} did not finish in {timeout}s:\n"
                                 f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return result

    def close(self):
        if self.alive():
            (self.folder / "next.tmp").write_text(json.dumps({"stop": True}))
            os.replace(self.folder / "next.tmp", self.folder / f"job-{self.k}.json")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _read(path):
    return path.read_text(errors="replace") if path.exists() else ""
