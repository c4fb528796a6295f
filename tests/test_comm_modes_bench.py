"""Smoke run of benchmarks/comm_modes.py at tiny sizes under a real mpirun: each launch writes
its JSON, the table compares the modes, and the monitor names the slowed rank. Not a test
of speed: figures come from ``make bench`` on a quiet machine."""
import json
import sys

import pytest

from mpi_harness import ROOT, mpirun

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.mpi

TINY = ["--data", "teacher", "--hidden", "16", "--depth", "1", "--samples", "1024", "--batch", "8",
        "--steps", "24", "--eval-every", "8", "--backend", "mpi"]


def test_comm_modes_benchmark_runs_and_tabulates(tmp_path):
    from comm_modes import section

    runs = {"sync": [], "local4": ["--mode", "local_sgd", "--sync-every", "4"],
            "local4-slow-one": ["--mode", "local_sgd", "--sync-every", "4", "--slow", "one", "--slow-rank", "1",
                                "--slow-ms", "40"]}
    for name, args in runs.items():
        mpirun(2, [BENCH / "comm_modes.py", *TINY, *args, "--data-dir", tmp_path / "data",
                   "--out", tmp_path / f"comm_modes-{name}.json"], timeout=150, check=True)
    docs = {n: json.loads((tmp_path / f"comm_modes-{n}.json").read_text())["results"][0] for n in runs}
    sync, local = docs["sync"], docs["local4"]
    assert sync["steps"] == local["steps"] == 24
    assert [p[0] for p in local["curve"]] == [8, 16, 24] and local["final_val_loss"] > 0
    # sync sends every gradient every step; local SGD every 4th step the parameter change and
    # AdamW's two moments (three times the gradient bytes, plus a step count per tensor)
    assert local["bytes_per_step"] == pytest.approx(3 * sync["bytes_per_step"] / 4, rel=0.01)
    # the slowed rank is still the one the monitor names
    assert docs["local4-slow-one"]["slow_ranks_named"] == [1]
    text = "\n".join(section(str(tmp_path)))
    assert "| teacher | local_sgd H=4 | none |" in text and "| teacher | local_sgd H=4 | one 40 ms |" in text
