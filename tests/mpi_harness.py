"""Launch real ranks with mpirun from tests: every launch has a timeout, every rank's
output is kept, and a failure on any rank fails the test.

The Open MPI settings for running as root and oversubscribing this small machine belong
here (and in the job scripts), never in library code.
"""
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEFAULT_TIMEOUT = 180


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


def mpirun(n, args, timeout=DEFAULT_TIMEOUT, env=None, cwd=None, check=False, per_rank=False):
    """Run ``mpirun -n N <args>``; ``args`` starting with a ``.py`` path or ``-m`` run under
    this interpreter. Kills the whole launch on timeout and fails the test.

    ``per_rank``: also keep each rank's output apart (``Result.ranks``). mpirun's own streams
    interleave the ranks' writes mid-line, so a message counted "on every rank" is counted there."""
    if args and (str(args[0]).endswith(".py") or args[0] == "-m" or args[0] == "-c"):
        args = [PYTHON] + list(args)
    with tempfile.TemporaryDirectory(prefix="hpctrain-ranks-") as apart:
        keep = ["--output-filename", apart] if per_rank else []
        cmd = ["mpirun", "-n", str(n), "--timeout", str(timeout)] + keep + [str(a) for a in args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                                  env=mpi_env(env), cwd=cwd or ROOT)
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
