"""The Monitor under a real mpirun: a rank slowed on purpose is named with its phase, one
rank's perturbed parameters are caught, and a healthy run reports nothing."""

import pytest

from mpi_harness import mpirun
from run_records import records

pytestmark = pytest.mark.mpi

LOOP = "tests/mpi/monitor_loop.py"


def test_slow_rank_and_diverged_parameters_are_reported(tmp_path):
    result = mpirun(4, [LOOP, tmp_path, "--steps", "30", "--slow-rank", "1", "--perturb-rank", "2",
                        "--perturb-step", "12", "--consistency-every", "5"], timeout=150).check()
    (slow,) = records(tmp_path, "slow_rank")  # reported once, not at every gather
    assert slow["rank"] == 1 and slow["phase"] == "data" and slow["ratio"] > 1.3
    assert slow["exclude"] == f"#SBATCH --exclude={slow['host']}"
    assert "slow rank: rank 1 on" in result.stderr and "the slow phase is 'data'" in result.stderr
    (diverged,) = records(tmp_path, "divergence")
    assert diverged["ranks"] == [2] and diverged["reference_ranks"] == [0, 1, 3] and diverged["step"] == 15
    assert "parameters differ across ranks at step 15: rank(s) 2" in result.stderr
    # rank 0 speaks, once; the others only print the script's own last line
    assert result.stderr.count("step 10/30") == 1 and result.stderr.count("slow rank:") == 1
    train = records(tmp_path, "train")
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert all(len(r["ranks"]) == 4 for r in train)


@pytest.mark.smoke
def test_healthy_run_reports_nothing(tmp_path):
    result = mpirun(4, [LOOP, tmp_path, "--steps", "30", "--consistency-every", "5"], timeout=150).check()
    assert records(tmp_path, "slow_rank") == [] and records(tmp_path, "divergence") == []
    assert "warning" not in result.output
    train = records(tmp_path, "train")
    assert train[-1]["step"] == 30 and train[-1]["gather"]["seconds"] < 1.0


def test_the_rank_with_the_highest_peak_memory_is_named(tmp_path):
    # fresh: a rank's peak memory is its process's, and a pool's process ran other jobs before
    result = mpirun(2, [LOOP, tmp_path, "--steps", "10", "--hog-rank", "1", "--hog-mib", "256"], timeout=150,
                    fresh=True).check()
    first, last = records(tmp_path, "train")[0], records(tmp_path, "train")[-1]
    peaks = [r["peak_rss_mib"] for r in last["ranks"]]
    assert last["memory"]["rank"] == 1 and peaks[1] - peaks[0] > 200, peaks
    assert last["ranks"][1]["peak_rss_mib"] - first["ranks"][1]["peak_rss_mib"] > 200  # grown at step 6: seen at 10
    assert f"peak mem {last['memory']['peak_rss_mib_max']:.0f} MiB/rank" in result.stderr
    from hpctrain.monitoring.report import format_summary, read_metrics, summarize

    summary = format_summary(summarize(read_metrics(tmp_path)))
    assert f"peak memory: {last['memory']['peak_rss_mib_max']:.0f} MiB resident on rank 1" in summary
