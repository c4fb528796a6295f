"""Token streams (data.kind = "tokens", hpctrain/data/tokens.py): the windows, the three file formats, the
errors for bad files and keys, that reading windows never reads the file whole, and that the sampler's
windows depend only on (seed, step, rank, ranks)."""
import numpy as np
import pytest
import torch

from hpctrain.config import DataConfig, load_config, validate
from hpctrain.data import ShardSampler, TokenWindows, open_splits
from hpctrain.errors import ConfigError, HpctrainError

TOKENS = np.arange(1000, dtype=np.int64) * 7 % 50021  # distinct, fits uint16


def write(path, tokens=TOKENS, dtype=np.uint16):
    """``tokens`` as a .bin, .npy or HDF5 (dataset "tokens") file, by the suffix of ``path``."""
    path = str(path)
    tokens = np.asarray(tokens, dtype=dtype)
    if path.endswith(".bin"):
        tokens.tofile(path)
    elif path.endswith(".npy"):
        np.save(path, tokens)
    else:
        import h5py

        with h5py.File(path, "w") as f:
            f["tokens"] = tokens
    return path


@pytest.mark.parametrize("stride", [0, 5])
def test_window_i_is_the_tokens_from_i_times_stride_and_y_is_x_shifted_by_one(tmp_path, stride):
    data = TokenWindows(write(tmp_path / "t.bin"), block_size=16, stride=stride)
    step = stride or 16
    assert len(data) == (1000 - 17) // step + 1
    indices = [7, 0, len(data) - 1, 7]
    x, y = data.read(indices)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    for row, i in enumerate(indices):  # in the order asked for, repeats included
        start = i * step
        assert x[row].tolist() == TOKENS[start:start + 16].tolist()
        assert y[row].tolist() == TOKENS[start + 1:start + 17].tolist()
    assert x.is_contiguous() and y.is_contiguous()


def test_bin_npy_and_hdf5_files_give_the_same_windows(tmp_path):
    indices = np.random.default_rng(0).permutation(62)[:20]
    reads = [TokenWindows(write(tmp_path / name, dtype=dtype), 16, dtype=key).read(indices)
             for name, dtype, key in (("a.bin", np.uint16, "uint16"), ("b.bin", np.uint32, "uint32"),
                                      ("c.npy", np.uint16, "uint16"), ("d.npy", np.int32, "uint16"),
                                      ("e.h5", np.uint16, "uint16"), ("f.hdf5", np.uint32, "uint16"))]
    for x, y in reads[1:]:
        assert x.equal(reads[0][0]) and y.equal(reads[0][1])
    with pytest.raises(IndexError):
        TokenWindows(tmp_path / "a.bin", 16).read([62])


def test_the_dataset_maps_the_file_and_reading_windows_does_not_read_it_whole(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:  # 1 GiB, sparse: nothing written but the last token
        f.truncate(2 ** 30 - 2)
        f.write(b"\x01\x00")
    data = TokenWindows(path, block_size=256)
    assert isinstance(data.tokens, np.memmap) and data.tokens.base is not None  # a mapping, not a copy
    assert isinstance(TokenWindows(write(tmp_path / "t.npy"), 16).tokens, np.memmap)

    def resident():  # bytes of (anonymous memory, file pages mapped) of this process
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return [int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile")]

    rng = np.random.default_rng(0)
    data.read([0])
    before = resident()
    for _ in range(5):
        x, y = data.read(rng.integers(0, len(data), 64))
    assert x.shape == (64, 256) and int(y.max()) <= 1
    anon, mapped = (after - was for after, was in zip(resident(), before))
    # 320 windows of 514 bytes: no copy of the 1 GiB, and only the pages around each window (the kernel
    # maps up to 64 KiB around a page it faults in: about 20 MiB)
    assert anon < 16 * 2 ** 20 and mapped < 128 * 2 ** 20, (anon, mapped)


def test_hdf5_windows_read_slices_only(tmp_path, monkeypatch):
    data = TokenWindows(write(tmp_path / "t.h5"), 16)
    asked = []
    real = type(data.tokens).__getitem__
    monkeypatch.setattr(type(data.tokens), "__getitem__", lambda ds, key: asked.append(key) or real(ds, key))
    data.read([3, 1])
    assert asked == [slice(16, 33), slice(48, 65)]  # two windows in file order, nothing else
    data.close()


@pytest.mark.parametrize("make, text, hint", [
    (lambda d: write(d / "short.bin", TOKENS[:16]), "has 16 tokens, fewer than one window of data.block_size + 1 = 17",
     "lower data.block_size"),
    (lambda d: str(d / "missing.bin"), "does not exist", "nanoGPT's prepare.py"),
    (lambda d: (d / "odd.bin").write_bytes(b"\x01\x02\x03") and str(d / "odd.bin"),
     "has 3 bytes, not a multiple of the 2 bytes of one data.dtype = 'uint16' token", "set data.dtype"),
    (lambda d: write(d / "2d.npy", TOKENS.reshape(50, 20)), "the array has shape (50, 20), not one dimension",
     "flatten it"),
    (lambda d: write(d / "f.npy", TOKENS, np.float32), "the array holds float32, not integers", "integer token ids"),
    (lambda d: (d / "x.npy").write_text("not numpy") and str(d / "x.npy"), "is not a NumPy .npy array", "np.save"),
    (lambda d: str(d), "is a directory", "one token file"),
])
def test_bad_token_files_are_clear_errors_with_a_hint(tmp_path, make, text, hint):
    path = make(tmp_path)
    with pytest.raises(HpctrainError) as err:
        TokenWindows(path, 16, key="data.val_path")
    assert text in str(err.value) and "(data.val_path)" in str(err.value) and hint in err.value.hint


def test_hdf5_token_file_with_another_dataset_name_or_a_2d_one(tmp_path):
    import h5py

    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f["train/ids"] = TOKENS
        f["grid"] = TOKENS.reshape(10, 100)
    with pytest.raises(HpctrainError, match="has no dataset 'tokens'") as err:
        TokenWindows(path, 16)
    assert err.value.hint == "set data.token_dataset to one of: grid, train/ids"
    with pytest.raises(HpctrainError, match=r"dataset 'grid' has shape \(10, 100\), not one dimension"):
        TokenWindows(path, 16, dataset="grid")
    assert len(TokenWindows(path, 16, dataset="train/ids")) == 62
    (tmp_path / "junk.h5").write_text("not HDF5")
    with pytest.raises(HpctrainError, match="cannot be read as HDF5"):
        TokenWindows(tmp_path / "junk.h5", 16)


def test_open_splits_gives_token_windows_for_train_and_val(tmp_path):
    train_path, val_path = write(tmp_path / "train.bin"), write(tmp_path / "val.bin", TOKENS[:100])
    train, val = open_splits(DataConfig(kind="tokens", path=train_path, block_size=16))
    assert isinstance(train, TokenWindows) and len(train) == 62 and val is None
    train, val = open_splits(DataConfig(kind="tokens", path=train_path, val_path=val_path, block_size=32, stride=8))
    assert (len(train), len(val), val.stride) == ((1000 - 33) // 8 + 1, (100 - 33) // 8 + 1, 8)


@pytest.mark.parametrize("overrides, text", [
    (["data.kind=tokens", "data.path=t.bin"], 'data.kind = "tokens" needs data.block_size'),
    (["data.kind=tokens", "data.path=t.bin", "data.block_size=-4"], "data.block_size = -4 must be > 0"),
    (["data.kind=tokens", "data.path=t.bin", "data.block_size=8", "data.stride=-1"], "data.stride = -1 must be >= 0"),
    (["data.kind=token", "data.path=t.bin"], "data.kind = 'token' is not one of hdf5, tokens"),
    (["data.kind=tokens", "data.path=t.bin", "data.block_size=8", "data.dtype=uint8"],
     "data.dtype = 'uint8' is not one of uint16, uint32"),
    (["data.kind=tokens", "data.path=t.txt", "data.block_size=8"], "data.path = 't.txt' is not a token file"),
    (["data.kind=tokens", "data.path=t.bin", "data.val_path=v.csv", "data.block_size=8"],
     "data.val_path = 'v.csv' is not a token file"),
    (["data.kind=tokens", "data.block_size=8"], "data.path is not set"),
    (["data.kind=tokens", "data.path=t.bin", "data.block_size=8", "data.factory=a.b:c"],
     'data.factory = \'a.b:c\' and data.kind = "tokens" do not go together'),
    (["data.path=d.h5", "data.block_size=8"], 'data.block_size = 8 is only used with data.kind = "tokens"'),
    (["data.path=d.h5", "data.val_path=v.bin"], "data.val_path = 'v.bin' is only used with data.kind"),
])
def test_token_keys_are_checked_with_the_key_the_value_and_the_fix(overrides, text):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides))
    assert text in str(err.value) and err.value.hint


def test_token_configuration_validates():
    cfg = validate(load_config(None, ["data.kind=tokens", "data.path=data/train.bin", "data.val_path=data/val.bin",
                                      "data.block_size=256", "data.dtype=uint32"]))
    assert (cfg.data.kind, cfg.data.block_size, cfg.data.stride, cfg.data.dtype) == ("tokens", 256, 0, "uint32")
    assert validate(load_config(None, ["data.path=d.h5"])).data.kind == "hdf5"  # the default: (x, y) files


def _windows_of_step(num, seed, global_batch, ranks, step):
    """Every window the ranks read at ``step`` (epoch 0), with ``global_batch`` split over ``ranks``."""
    sampler = ShardSampler(num, seed, global_batch // ranks, ranks)
    per = [list(sampler.steps(0, step * global_batch, rank))[0][0] for rank in range(ranks)]
    return np.concatenate(per)


def test_the_windows_of_a_step_depend_on_seed_and_step_only_for_any_rank_count_and_resume():
    # ShardSampler's order is one permutation of the window indices from (seed, epoch); a step takes the next
    # global batch of it and rank r the r-th slice: a resume at samples_in_epoch = step x global batch, or a
    # relaunch on another rank count with the same global batch, reads the same windows at each step.
    for step in (0, 3, 9):
        one = _windows_of_step(1000, 5, 24, 1, step)
        for ranks in (2, 3, 4):
            assert _windows_of_step(1000, 5, 24, ranks, step).tolist() == one.tolist()
    resumed = [mb[0] for mb in ShardSampler(1000, 5, 12, 2).steps(0, 3 * 24, 1)]
    whole = [mb[0] for mb in ShardSampler(1000, 5, 12, 2).steps(0, 0, 1)]
    assert all(a.tolist() == b.tolist() for a, b in zip(resumed, whole[3:])) and len(resumed) == len(whole) - 3
    assert _windows_of_step(1000, 6, 24, 1, 0).tolist() != _windows_of_step(1000, 5, 24, 1, 0).tolist()
