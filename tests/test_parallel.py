"""Single-process tests of the pure parts of hpctrain.parallel: layouts, splitting,
schedules, checkpoint planning; and one-rank runs that need no mpirun."""
import pytest

from hpctrain.errors import ConfigError
from hpctrain.parallel.layout import Layout, coordinates, rank_of
from hpctrain.parallel.pipeline import bounds_from_counts, partition, schedule_ops


def test_layout_fills_in_replicas_and_orders_ranks():
    layout = Layout(stages=2).resolve(4)
    assert layout == Layout(2, 2, 1)
    # replica-major, stage next: ranks 0, 1 are one pipeline; 0 and 2 hold stage 0
    assert [coordinates(r, layout) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    big = Layout(2, 2, 2)
    assert all(rank_of(*coordinates(r, big), big) == r for r in range(8))


@pytest.mark.parametrize("layout,size,text", [
    (Layout(stages=3), 4, "4 is not a multiple of 3"),
    (Layout(stages=2, replicas=3), 4, "needs 6 ranks, but the job has 4"),
    (Layout(stages=0), 4, "parallel.stages is 0"),
])
def test_layout_errors_say_what_and_how(layout, size, text):
    with pytest.raises(ConfigError, match="HINT|expected") as info:
        layout.resolve(size)
    assert text in str(info.value)


def test_partition_minimises_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([8, 0, 1, 1, 1, 0, 5], 3) == [(0, 1), (1, 5), (5, 7)]
    assert partition([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError, match="3 layer"):
        partition([1, 2, 3], 4)


def test_bounds_from_counts():
    assert bounds_from_counts([2, 1], 3) == [(0, 2), (2, 3)]
    with pytest.raises(ConfigError):
        bounds_from_counts([3, 0], 3)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 4), (4, 2), (3, 7)])
def test_schedules_run_every_micro_batch_once_and_forward_first(kind, stages, micro):
    for stage in range(stages):
        ops = schedule_ops(kind, stage, stages, micro)
        assert sorted(ops) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
        assert all(ops.index(("F", m)) < ops.index(("B", m)) for m in range(micro))


def test_1f1b_keeps_fewer_activations_than_gpipe():
    def peak(ops):
        live = high = 0
        for op, _ in ops:
            live += 1 if op == "F" else -1
            high = max(high, live)
        return high

    assert peak(schedule_ops("gpipe", 0, 4, 8)) == 8
    assert [peak(schedule_ops("1f1b", s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]
    with pytest.raises(ConfigError, match="parallel.schedule = 'zigzag' is not one of 1f1b, gpipe"):
        schedule_ops("zigzag", 0, 2, 2)


def test_runs_cover_a_column_slice_row_by_row():
    from hpctrain.checkpoint.content.format import runs

    assert runs((4, 6), ((0, 4), (2, 4)), 4) == [(8, 8), (32, 8), (56, 8), (80, 8)]
    assert runs((4, 6), ((1, 3), (0, 6)), 4) == [(24, 48)]
    assert runs((), (), 8) == [(0, 8)]


def test_plan_writes_shares_rows_among_copies_and_checks_coverage():
    from hpctrain.errors import CheckpointError
    from hpctrain.parallel.checkpoint import plan_writes

    full = ((0, 4), (0, 6))
    left, right = ((0, 4), (0, 3)), ((0, 4), (3, 6))
    order, datasets, plan = plan_writes([[("w", (4, 6), "float32", left)], [("w", (4, 6), "float32", right)],
                                         [("w", (4, 6), "float32", left)], [("w", (4, 6), "float32", right)]])
    assert order == ["w"] and datasets["w"] == ((4, 6), "float32")
    assert sorted(plan["w"]) == [(0, ((0, 2), (0, 3))), (1, ((0, 2), (3, 6))), (2, ((2, 4), (0, 3))),
                                 (3, ((2, 4), (3, 6)))]
    _, _, plan = plan_writes([[("b", (4, 6), "float32", full)], [("b", (4, 6), "float32", full)]])
    assert plan["b"] == [(0, ((0, 2), (0, 6))), (1, ((2, 4), (0, 6)))]
    with pytest.raises(CheckpointError, match="hold 12 of its 24"):
        plan_writes([[("w", (4, 6), "float32", left)]])


def test_tensor_parallel_layers_on_one_rank_equal_the_dense_ones():
    import torch
    from mpi4py import MPI

    from hpctrain.parallel.tensor import MLPBlock, SelfAttention, tensor_parallelize, ParallelMLP

    torch.manual_seed(0)
    dense, attn = MLPBlock(8, 16), SelfAttention(8, 2)
    x = torch.randn(3, 4, 8)
    par = ParallelMLP.from_dense(dense, MPI.COMM_SELF)
    assert torch.allclose(par(x), dense(x))
    assert tensor_parallelize(attn, MPI.COMM_SELF) is attn  # one tensor rank: nothing to split
