import os
import sys

# The harness modules (mpi_harness, slurm_cluster) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
