"""The per-rank sampler and HDF5 datasets."""
import numpy as np
import pytest

from hpctrain.data import ShardSampler, eval_shard


def flat(step):
    return np.concatenate(step)


@pytest.mark.parametrize("ranks, batch, accumulation", [(1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (3, 5, 2)])
def test_shards_are_disjoint_and_cover_the_epoch(ranks, batch, accumulation):
    n = 103
    samplers = [list(ShardSampler(n, 7, batch, ranks, accumulation).steps(0, 0, r)) for r in range(ranks)]
    global_batch = batch * ranks * accumulation
    steps = n // global_batch
    assert all(len(s) == steps for s in samplers)
    for step in range(steps):
        parts = [flat(samplers[r][step]) for r in range(ranks)]
        assert all(len(p) == batch * accumulation for p in parts)
        assert all(len(mb) == batch for r in range(ranks) for mb in samplers[r][step])
        together = np.concatenate(parts)
        assert len(set(together.tolist())) == global_batch  # disjoint within a step
    seen = np.concatenate([flat(s) for r in range(ranks) for s in samplers[r]])
    assert len(set(seen.tolist())) == len(seen) == steps * global_batch  # no sample twice in the epoch
    # Exactly the first steps x global_batch samples of the epoch's global order, in order.
    order = ShardSampler(n, 7, batch, ranks, accumulation).permutation(0)
    merged = np.concatenate([flat(samplers[r][s]) for s in range(steps) for r in range(ranks)])
    assert np.array_equal(merged, order[:steps * global_batch])


def test_deterministic_per_seed_and_epoch():
    a = ShardSampler(100, 3, 10)
    assert np.array_equal(a.permutation(2), ShardSampler(100, 3, 10).permutation(2))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), ShardSampler(100, 4, 10).permutation(0))
    assert sorted(a.permutation(5).tolist()) == list(range(100))


def test_same_global_order_for_any_rank_count():
    one = np.concatenate([flat(s) for s in ShardSampler(64, 0, 8, 1).steps(0)])
    two = [list(ShardSampler(64, 0, 4, 2).steps(0, 0, r)) for r in range(2)]
    assert np.array_equal(one, np.concatenate([np.concatenate([flat(two[0][s]), flat(two[1][s])])
                                               for s in range(len(two[0]))]))


def test_resume_mid_epoch_on_a_different_rank_count_continues_the_global_order():
    n, seed = 200, 11
    # 4 ranks x 3 x accumulation 2 = 24 per step: stop after 3 steps (72 samples).
    before = ShardSampler(n, seed, 3, 4, 2)
    done = 3 * before.global_batch
    consumed = [flat(s) for r in range(4) for s in list(before.steps(1, 0, r))[:3]]
    # Resume on 2 ranks x 4 x accumulation 1 = 8 per step from samples_in_epoch = 72.
    after = ShardSampler(n, seed, 4, 2, 1)
    steps = [list(after.steps(1, done, r)) for r in range(2)]
    rest = np.concatenate([np.concatenate([flat(steps[0][s]), flat(steps[1][s])]) for s in range(len(steps[0]))])
    order = before.permutation(1)
    assert np.array_equal(rest, order[done:done + len(rest)])
    assert len(rest) == (n - done) // 8 * 8
    assert not set(rest.tolist()) & set(np.concatenate(consumed).tolist())


def test_nothing_left_at_the_end_of_an_epoch():
    s = ShardSampler(50, 0, 8, 2)
    assert list(s.steps(0, 48, 0)) == [] and s.steps_per_epoch == 3


def test_eval_shards_split_everything_once():
    parts = [eval_shard(10, r, 4) for r in range(4)]
    assert np.array_equal(np.concatenate(parts), np.arange(10))
    assert [len(p) for p in parts] == [2, 3, 2, 3]


# ---------------------------------------------------------------- HDF5
@pytest.fixture
def h5py():
    return pytest.importorskip("h5py")


def test_hdf5_dataset_reads_exactly_the_indices_asked_for(tmp_path, h5py):
    import torch

    from hpctrain.data import HDF5Dataset

    path = tmp_path / "d.h5"
    x = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    with h5py.File(path, "w") as f:
        f["g/x"] = x
        f["g/y"] = np.arange(50) % 7
    ds = HDF5Dataset(path, x="g/x", y="g/y")
    ds.CHUNK = 4  # several chunked reads
    idx = [17, 3, 49, 3, 0, 25, 8, 9, 10, 44]
    xb, yb = ds.read(idx)
    assert isinstance(xb, torch.Tensor) and xb.dtype == torch.float32
    assert np.array_equal(xb.numpy(), x[idx]) and np.array_equal(yb.numpy(), np.array(idx) % 7)
    assert len(ds) == 50
    ds.close()


def test_hdf5_dataset_names_what_is_missing(tmp_path, h5py):
    from hpctrain.data import HDF5Dataset
    from hpctrain.errors import HpctrainError

    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((3, 2))
        f["labels"] = np.zeros(3)
    with pytest.raises(HpctrainError, match=r"has no dataset 'y'(.|\n)*HINT: datasets there: labels, x"):
        HDF5Dataset(path)
    with pytest.raises(HpctrainError, match="does not exist"):
        HDF5Dataset(tmp_path / "nope.h5")


def test_digits_file_is_deterministic_and_split(tmp_path, h5py):
    pytest.importorskip("sklearn")
    from hpctrain.data import make_digits_h5, open_splits
    from hpctrain.config import DataConfig

    a, b = make_digits_h5(tmp_path / "a.h5"), make_digits_h5(tmp_path / "b.h5")
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert fa["train/x"].shape == (1438, 64) and fa["val/x"].shape == (359, 64)
        assert np.array_equal(fa["train/y"][:], fb["train/y"][:]) and np.array_equal(fa["val/x"][:], fb["val/x"][:])
        assert 0.0 <= fa["train/x"][:].min() and fa["train/x"][:].max() <= 1.0
    train, val = open_splits(DataConfig(path=str(a)))
    assert len(train) == 1438 and len(val) == 359


def test_teacher_corpus_is_deterministic_and_uses_every_class(tmp_path, h5py):
    from hpctrain.data import make_teacher_h5

    a = make_teacher_h5(tmp_path / "a.h5", 3000, 100, features=16, classes=4, seed=5)
    b = make_teacher_h5(tmp_path / "b.h5", 3000, 100, features=16, classes=4, seed=5)
    c = make_teacher_h5(tmp_path / "c.h5", 3000, 100, features=16, classes=4, seed=6)
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb, h5py.File(c, "r") as fc:
        assert np.array_equal(fa["train/x"][:], fb["train/x"][:]) and np.array_equal(fa["val/y"][:], fb["val/y"][:])
        assert not np.array_equal(fa["train/y"][:], fc["train/y"][:])
        counts = np.bincount(fa["train/y"][:], minlength=4)
        assert counts.min() > 300  # every class present in earnest
