import os
import sys

# The harness modules (mpi_harness, slurm_cluster) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

import mpi_harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- tiers (docs/testing.md)
# What a test launches decides its marker, so that `-m` selects by what a machine has: a launch of ranks
# (mpirun, also through a pool or `hpctrain launch`) needs `mpi`, Slurm's commands need `slurm`, the
# multi-node cluster needs `multinode`. Checked at every launch (below), not left to memory.
# (Slurm's query commands are left out: hpctrain itself asks squeue and sinfo, and copes where they are absent.)
LAUNCHERS = {"mpirun": "mpi", "mpiexec": "mpi", "srun": "slurm", "sbatch": "slurm", "salloc": "slurm"}


def _needs(args):
    """The marker a command line needs, or None."""
    if isinstance(args, (str, bytes)) or not args:
        return None
    args = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]
    name = os.path.basename(args[0])
    if name in LAUNCHERS:
        return LAUNCHERS[name]
    if name in ("bash", "sh") and "-c" in args[1:-1]:  # a shell script of the test's: what it runs
        words = set(re.findall(r"[\w.-]+", args[args.index("-c") + 1]))
        return next((LAUNCHERS[w] for w in ("sbatch", "srun", "salloc", "mpirun", "mpiexec") if w in words), None)
    if "hpctrain" in args and "launch" in args[args.index("hpctrain") + 1:args.index("hpctrain") + 2]:
        return "mpi"
    return None


@pytest.fixture(autouse=True)
def launches_carry_their_marker(request, monkeypatch):
    """Fails a test that launches ranks or uses Slurm without the marker that says so."""
    marks = {m.name for m in request.node.iter_markers()}
    if "slurm_multinode" in request.fixturenames and "multinode" not in marks:
        pytest.fail("this test uses the multi-node Slurm cluster: mark it @pytest.mark.multinode")
    if "slurm_cluster" in request.fixturenames and "slurm" not in marks:
        pytest.fail("this test uses the Slurm cluster: mark it @pytest.mark.slurm")
    real = subprocess.Popen.__init__

    def check(needed, what):
        # Slurm tests start ranks through srun and mpirun alike; the multi-node ones are Slurm tests too.
        if needed and needed not in marks and not (needed == "mpi" and "slurm" in marks):
            raise AssertionError(f"this test runs {what}: mark it @pytest.mark.{needed} "
                                 f"(tests/conftest.py, docs/testing.md)")

    def checked(self, args, *rest, **kwargs):
        check(_needs(args), os.path.basename(str(args[0])) if not isinstance(args, str) else args)
        real(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked)
    monkeypatch.setattr(mpi_harness, "check_launch", lambda needed: check(needed, "ranks (mpirun)"))


@pytest.hookimpl(wrapper=True)  # around the others: the groups are set before pytest-xdist reads them
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`), the tests on the Slurm clusters, which mostly wait (job scheduling,
    SlurmdTimeout, a real time limit), run in order on one worker, beside the tests that compute."""
    # A module with a Slurm test goes there whole: its module-scoped fixtures (test_install.py's installation
    # and test user) are then made once, by one worker.
    on_slurm = {item.module.__name__ for item in items
                if item.get_closest_marker("slurm") or item.get_closest_marker("multinode")}
    for item in items:
        if item.module.__name__ in on_slurm:
            item.add_marker(pytest.mark.xdist_group("slurm"))
    return (yield)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The digits data file, made once for the session (read only by the tests), so that
    jobs running side by side never race to create it."""
    from hpctrain.config import load_config
    from hpctrain.data import generate

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    cfg = load_config(os.path.join(ROOT, "examples", "digits.toml"), [f"data.path={path}"])
    generate(cfg.data, cfg.model, seed=cfg.run.seed)
    return path


# ---------------------------------------------------------------- Slurm


def _slurm(prefix, nodes, what):
    """A real Slurm cluster for the session (scripts/slurm-cluster.sh), stopped afterwards, also
    when tests fail; the tests that use it are skipped, with the reason, where it cannot start."""
    from slurm_cluster import start_or_reason

    # Short path under /tmp: munge's socket path must fit in a Unix socket address.
    directory = tempfile.mkdtemp(prefix=prefix)
    cluster, reason = start_or_reason(directory, nodes=nodes)
    if cluster is None:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"no {what}: {reason}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm cluster (munged, slurmctld, slurmd)."""
    yield from _slurm("hpctrain-slurm-", 1, "Slurm cluster")


@pytest.fixture(scope="session")
def slurm_multinode():
    """A real 3-node Slurm cluster on this machine (nodes n1, n2, n3 in network namespaces,
    sharing the filesystem), started the first time a test asks for it; namespaces and bridge
    are torn down with it."""
    yield from _slurm("hpctrain-mn-", 3, "multi-node Slurm cluster")


# ---------------------------------------------------------------- node-local snapshots
# Runs take node-local snapshots into /dev/shm by default (checkpoint.local = "auto"); those of runs a test
# killed for good stay there, as on a cluster until an epilog removes them. At its end the suite removes those
# of its own runs (a part file names its run's checkpoint directory: under this session's temporary folder) and
# those of runs whose directory is gone, in the controlling process, once every worker is done; another
# session's, running beside it, stay.
SHM = "/dev/shm"


def _own_snapshot_dirs(basetemp):
    import glob

    from hpctrain.checkpoint.local import files

    for base in glob.glob(os.path.join(SHM, "hpctrain-*")):
        for part in glob.glob(os.path.join(base, "*", "step-*", "part-*.bin"))[:1]:
            try:
                checkpoints = files.read_trailer(part)["checkpoint_dir"]
                if checkpoints.startswith(basetemp + os.sep) or not os.path.isdir(checkpoints):
                    yield base  # or of a run whose directory a test removed: nothing can resume from them
            except (files.PartDamaged, KeyError, OSError):
                pass


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the others may still be running
        return
    basetemp = str(session.config._tmp_path_factory.getbasetemp())
    for base in list(_own_snapshot_dirs(basetemp)):
        shutil.rmtree(base, ignore_errors=True)
