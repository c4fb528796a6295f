"""Launcher detection and its cross-check against MPI (pure logic)."""
import pytest

from hpctrain.runtime.world import cpu_threads_per_rank, launch_info, launch_problems


def test_no_launcher():
    info = launch_info({})
    assert info.launcher == "none" and info.size is None
    assert launch_problems(info, 0, 1) == []


def test_mpirun_variables():
    info = launch_info({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("mpirun", 2, 4, 0)
    assert launch_problems(info, 2, 4) == []


def test_mpirun_inside_slurm_batch_step_trusts_mpirun():
    # mpirun's ranks inherit SLURM_PROCID=0 of the batch step; that must not count.
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "SLURM_JOB_ID": "7",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    info = launch_info(env)
    assert info.launcher == "mpirun" and info.rank == 1 and info.slurm_job_id == "7"
    assert launch_problems(info, 1, 2) == []


def test_srun_without_pmix_is_named_with_the_fix():
    env = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
           "SLURM_LOCALID": "1"}
    info = launch_info(env)
    assert info.launcher == "srun" and info.size == 4
    (problem,) = launch_problems(info, 0, 1)
    assert "rank 0 of 1" in problem and "srun --mpi=pmix" in problem


def test_srun_with_pmix_matches():
    env = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"}
    assert launch_problems(launch_info(env), 3, 4) == []


def test_size_mismatch_points_at_the_mpi_library():
    info = launch_info({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"})
    (problem,) = launch_problems(info, 0, 2)
    assert "4 ranks" in problem and "MPI_COMM_WORLD has 2" in problem and "HINT" in problem


def test_single_process_inside_a_multi_task_allocation():
    info = launch_info({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "8"})
    (problem,) = launch_problems(info, 0, 1)
    assert "8 tasks" in problem and "mpirun -n 8" in problem


@pytest.mark.parametrize("env,local,expected", [
    ({"OMP_NUM_THREADS": "3"}, 4, 3),
    ({"OMP_NUM_THREADS": "0"}, 4, 1),
])
def test_threads_respect_omp_num_threads(env, local, expected):
    assert cpu_threads_per_rank(local, env) == expected


@pytest.mark.parametrize("cores,usable,local,expected", [
    (16, 16, 4, 4),    # not bound: the node's cores shared by the ranks on it
    (16, 16, 3, 5),    # rounded down, never oversubscribed
    (16, 16, 32, 1),   # more ranks than cores: at least one thread
    (16, 16, 0, 16),   # a local size of 0 counts as 1
    (16, 3, 4, 3),     # bound by the launcher to 3 cores: exactly those
    (16, 1, 1, 1),
], ids=["split", "rounded-down", "at-least-one", "local-size-0", "bound", "bound-to-one"])
def test_threads_split_the_node(monkeypatch, cores, usable, local, expected):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(usable)), raising=False)
    assert cpu_threads_per_rank(local, {}) == expected


def test_threads_without_affinity_use_the_core_count(monkeypatch):
    import os

    # Not Linux: no sched_getaffinity, so the node's cores are split.
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert cpu_threads_per_rank(2, {}) == 4


def test_threads_follow_a_real_cpu_binding():
    # A process really bound to one core (as `mpirun --bind-to core` does) gets one thread,
    # even where the node's cores would give it more.
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs Linux CPU affinity and at least 2 cores")
    code = ("import os; from hpctrain.runtime.world import cpu_threads_per_rank;"
            "cpu = min(os.sched_getaffinity(0)); os.sched_setaffinity(0, {cpu});"
            "print(cpu_threads_per_rank(1, {}))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=root)
    assert out.stdout.strip() == "1"
