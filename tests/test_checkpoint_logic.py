"""Fast, single-process tests of the checkpoint format's pure logic: names, checksums and
their combination, the sharing-out of datasets among ranks, retention, when to save."""
import json
import math
import random
import zlib

import numpy as np
import pytest

from hpctrain.checkpoint.content import format as fmt
from hpctrain.checkpoint.content import plan as ckplan
from hpctrain.checkpoint import policy
from hpctrain.runtime.fsutil import temp_name


def test_names_sort_like_steps_and_round_trip():
    assert fmt.checkpoint_name(120) == "ckpt-00000120.h5"
    assert fmt.parse_step("ckpt-00000120.h5") == 120
    assert fmt.parse_step(fmt.checkpoint_name(123456789)) == 123456789
    names = [fmt.checkpoint_name(s) for s in (5, 40, 300, 2000)]
    assert sorted(names) == names
    for not_one in ("latest", "ckpt-00000120.h5.tmp-1-ab", "ckpt-12.h5", "ckpt-00000012.pt", ".probe"):
        assert fmt.parse_step(not_one) is None
    assert fmt.parse_step(temp_name("ckpt-00000001.h5", "x")) is None
    assert fmt.parse_step(temp_name("ckpt-00000001.h5")) is None
    with pytest.raises(ValueError):
        fmt.checkpoint_name(-1)


def test_param_keys_keep_dots_and_escape_slashes():
    assert fmt.param_key("layers.0.weight") == "layers.0.weight"
    assert fmt.param_name(fmt.param_key("a/b.c")) == "a/b.c"
    assert "/" not in fmt.param_key("a/b")


@pytest.mark.parametrize("sizes", [[0], [1], [5, 7], [1000, 0, 3, 1 << 16], [13] * 9])
def test_crc32_combine_equals_crc_of_concatenation(sizes):
    rng = random.Random(len(sizes))
    parts = [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]
    whole = b"".join(parts)
    crc = 0
    for p in parts:
        crc = fmt.crc32_combine(crc, zlib.crc32(p), len(p))
    assert crc == zlib.crc32(whole)


def test_combine_pieces_any_order_and_rejects_gaps():
    data = np.arange(1000, dtype=np.float32)
    raw = data.tobytes()
    cuts = [0, 4, 1000, 2000, 4000]
    pieces = [(a, b - a, zlib.crc32(raw[a:b])) for a, b in zip(cuts, cuts[1:])]
    assert fmt.combine_pieces(pieces[::-1]) == zlib.crc32(raw) == fmt.crc32_bytes(data)
    with pytest.raises(ValueError):
        fmt.combine_pieces(pieces[:1] + pieces[2:])


def test_crc_of_non_contiguous_and_scalar_arrays():
    a = np.arange(20, dtype=np.int64).reshape(4, 5)
    assert fmt.crc32_bytes(a.T) == zlib.crc32(np.ascontiguousarray(a.T).tobytes())
    s = np.array(3.5, dtype=np.float32)
    assert fmt.crc32_bytes(s) == zlib.crc32(s.tobytes())


def _coverage(plan, specs):
    for (shape, _), pieces in zip(specs, plan):
        rows = shape[0] if shape else 1
        covered = []
        for _, a, b in pieces:
            covered.extend(range(a, b))
        assert covered == list(range(rows))


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7])
def test_plan_tiles_every_dataset_once(nranks):
    specs = [((10, 4), 4), ((), 8), ((3_000_000,), 4), ((1,), 2), ((600, 600), 4), ((0,), 4), ((5, 1 << 20), 1)]
    plan = fmt.plan_pieces(specs, nranks)
    _coverage(plan, specs)
    assert plan == fmt.plan_pieces(specs, nranks)  # deterministic
    for pieces in plan:
        assert all(0 <= r < nranks for r, _, _ in pieces)


def test_plan_splits_large_and_spreads_small():
    specs = [((1 << 20,), 4)] + [((16,), 4)] * 8
    plan = fmt.plan_pieces(specs, 4)
    assert [r for r, _, _ in plan[0]] == [0, 1, 2, 3]
    owners = [pieces[0][0] for pieces in plan[1:]]
    assert sorted(set(owners)) == [0, 1, 2, 3] and all(len(p) == 1 for p in plan[1:])


def test_plan_more_ranks_than_tensors_leaves_ranks_empty():
    plan = fmt.plan_pieces([((3, 3), 4)], 4)
    assert plan == [[(0, 0, 3)]]
    # a large tensor with fewer rows than ranks: ranks without a row get nothing
    plan = fmt.plan_pieces([((2, 1 << 20), 4)], 4)
    assert len(plan[0]) == 2
    _coverage(plan, [((2, 1 << 20), 4)])


def test_select_keep_last_best_milestones():
    ckpts = [(s, m) for s, m in [(100, 0.9), (200, 0.5), (300, 0.7), (400, 0.8), (500, 0.6), (600, 0.95)]]
    assert policy.select_keep(ckpts, keep_last=2) == {500, 600}
    assert policy.select_keep(ckpts, keep_last=0) == {100, 200, 300, 400, 500, 600}
    assert policy.select_keep(ckpts, keep_last=1, keep_best=2) == {600, 200, 500}
    assert policy.select_keep(ckpts, keep_last=1, keep_best=1, best_mode="max") == {600}
    assert policy.select_keep(ckpts, keep_last=1, keep_best=2, best_mode="max") == {600, 100}
    assert policy.select_keep(ckpts, keep_last=1, milestone_every=200) == {200, 400, 600}
    assert policy.select_keep([], keep_last=3) == set()
    # missing and NaN metrics never count as best; ties go to the newer
    assert policy.select_keep([(1, None), (2, math.nan), (3, 0.5), (4, 0.5), (5, 9.0)], 1, 1) == {5, 4}
    with pytest.raises(ValueError):
        policy.select_keep(ckpts, best_mode="lowest")


def test_save_reason():
    r = lambda step, **kw: policy.save_reason(step, kw.pop("last", None), kw.pop("secs", 0.0), **kw)  # noqa: E731
    assert r(10, every_steps=5) == "steps"
    assert r(11, every_steps=5) is None
    assert r(10, every_steps=5, last=10) is None  # never twice for one step
    assert r(3, every_minutes=1.0, secs=61) == "time"
    assert r(3, every_minutes=1.0, secs=59) is None
    assert r(3, epoch_end=True) == "epoch_end"
    assert r(3, epoch_end=True, on_epoch_end=False) is None
    assert r(3, final=True) == "final"
    assert r(3, final=True, on_finish=False) is None
    assert r(3, requested=True) == "requested"
    assert r(0) is None


def test_json_attributes_keep_floats_exact():
    value = {"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "none": None, "arr": np.arange(3)}
    back = fmt.from_json(fmt.to_json(value), "x")
    assert back["lr"] == 0.1 + 0.2 and back["betas"] == [0.9, 0.999] and back["arr"] == [0, 1, 2]
    with pytest.raises(fmt.CheckpointCorrupt):
        fmt.from_json("{nope", "x")


def test_tensor_encoding_round_trips_every_dtype():
    torch = pytest.importorskip("torch")
    from hpctrain.checkpoint.content.snapshot import array_to_tensor, tensor_to_array

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                  torch.uint8, torch.bool):
        t = (torch.randn(3, 5) * 10).to(dtype)
        array, name = tensor_to_array(t, copy=True)
        assert name == str(dtype).replace("torch.", "")
        if dtype == torch.bfloat16:
            assert array.dtype == np.uint16
        back = array_to_tensor(array, name)
        assert back.dtype == dtype and torch.equal(back, t)
    scalar = torch.tensor(7.0)
    array, name = tensor_to_array(scalar, copy=False)
    assert array.shape == () and array_to_tensor(array, name).item() == 7.0


def test_every_plan_checksums_to_the_crc_of_the_whole_dataset():
    """Ranks checksum what they write, by rows (data parallel) or by any region (split
    models); the combined CRC is the dataset's, whoever wrote which part."""
    from hpctrain.checkpoint.io import writer
    from hpctrain.checkpoint.content.snapshot import Entry, Snapshot

    big = np.arange(600 * 600, dtype=np.float32).reshape(600, 600)  # >= 1 MiB: split by rows
    small = np.arange(12, dtype=np.int64).reshape(3, 4)
    snap = Snapshot([Entry("model/big", big), Entry("model/small", small), Entry("s", np.array(2.5))], {}, {})
    plans = [ckplan.plan_snapshot(snap, 3, rank) for rank in range(3)]
    assert [r for r, _ in plans[0].datasets[0].pieces] == [0, 1, 2]
    gathered = [ckplan.own_checksums(p.datasets, rank)[0] for rank, p in enumerate(plans)]
    assert fmt.combine_checksums(gathered, 3) == [fmt.crc32_bytes(a) for a in (big, small, np.array(2.5))]
    # columns split over two tensor ranks, rows of each half over two replicas
    regions = [((0, 300), (0, 300)), ((0, 300), (300, 600)), ((300, 600), (0, 300)), ((300, 600), (300, 600))]
    pieces = list(enumerate(regions))
    parts = [ckplan.DatasetPlan("w", big.shape, big.dtype, {}, pieces, big[fmt.slices(r)]) for r in regions]
    gathered = [ckplan.own_checksums([d], rank)[0] for rank, d in enumerate(parts)]
    assert fmt.combine_checksums(gathered, 1) == [fmt.crc32_bytes(big)]


@pytest.mark.parametrize("workers", [1, 3])
def test_a_background_save_copies_only_its_own_rows_checked_into_kept_buffers(workers):
    """An async save's pieces stop aliasing training's tensors: each rank copies the rows it
    writes, no more, into the buffers of the previous save, and finds NaN in the same pass."""
    from hpctrain.checkpoint.io import writer
    from hpctrain.checkpoint.content.snapshot import Entry, Snapshot

    big = np.arange(600 * 600, dtype=np.float32).reshape(600, 600)  # >= 1 MiB: split by rows
    own = np.arange(5, dtype=np.float32)  # already the save's own memory (a GPU tensor's host copy)
    snap = Snapshot([Entry("optimizer/state/w/exp_avg", big, {fmt.DTYPE_ATTR: "float32"}, finite=True), Entry("model/own", own, private=True),
                     Entry("model/empty", np.zeros((0, 3), np.float32))], {}, {})
    plan = ckplan.plan_snapshot(snap, 2, 1)
    rows = plan.datasets[0].region_of(1)[0]
    buffers = {}
    assert ckplan.copy_own_pieces(plan, buffers, workers) == [] and not plan.datasets[0].private
    piece = plan.datasets[0].mine
    assert piece.shape == (rows[1] - rows[0], 600) and not np.shares_memory(piece, big)
    assert np.array_equal(piece, big[rows[0]:rows[1]]) and buffers["optimizer/state/w/exp_avg"] is piece
    big[rows[0], 7] = np.nan  # training goes on: the copy stays as it was
    assert np.isfinite(piece).all()
    again = ckplan.plan_snapshot(snap, 2, 1)
    assert ckplan.copy_own_pieces(again, buffers, workers) == [0] and again.own_nonfinite == [0]
    assert again.datasets[0].mine is piece and np.isnan(piece[0, 7])  # the same buffer, reused
    first, theirs = ckplan.plan_snapshot(snap, 2, 0), {}
    assert ckplan.copy_own_pieces(first, theirs, workers) == []  # rank 0's rows are finite
    assert "model/own" not in theirs and np.shares_memory(first.datasets[1].mine, own)  # rank 0 writes it, uncopied


def test_a_nan_refused_by_the_serial_writer_leaves_a_file_without_a_checkpoint(tmp_path):
    """Without parallel HDF5 rank 0 writes alone, checksumming each dataset as it writes
    it: a NaN refuses the save naming the tensor, and the file holds no valid checkpoint."""
    import h5py

    from hpctrain.checkpoint.io import writer
    from hpctrain.checkpoint.content.snapshot import Entry, Snapshot

    good = np.ones((4, 4), np.float32)
    bad = np.ones(3, np.float32)
    bad[1] = np.inf
    snap = Snapshot([Entry("model/a", good, {fmt.DTYPE_ATTR: "float32"}, finite=True),
                     Entry("model/b", bad, {fmt.DTYPE_ATTR: "float32"}, finite=True)], {}, {})
    path = str(tmp_path / "ckpt-00000001.h5.tmp")
    with pytest.raises(fmt.NonFiniteState, match="/model/b"):
        writer.write_serial(path, ckplan.plan_snapshot(snap, 1, 0))
    with h5py.File(path, "r") as f:  # never sealed: its checksums are the placeholders
        assert int(f.attrs[fmt.METADATA_CRC_ATTR]) == 0 and int(f["model/a"].attrs[fmt.CRC_ATTR]) == 0
    bad[1] = 0.0
    sums = writer.write_serial(path, ckplan.plan_snapshot(snap, 1, 0))
    assert sums == [fmt.crc32_bytes(good), fmt.crc32_bytes(bad)]
    with h5py.File(path, "r") as f:
        assert [int(f[p].attrs[fmt.CRC_ATTR]) for p in ("model/a", "model/b")] == sums
        assert int(f.attrs[fmt.METADATA_CRC_ATTR]) != 0



def test_the_serial_writers_failures_name_the_dataset_and_the_fix(tmp_path, monkeypatch):
    """Rank 0 writing alone: a full disk while writing a dataset, or a file that cannot be
    created, is a CheckpointError naming what failed and how to fix it."""
    import errno

    from hpctrain.checkpoint.io import writer
    from hpctrain.checkpoint.content.snapshot import Entry, Snapshot
    from hpctrain.errors import CheckpointError

    snap = Snapshot([Entry("model/a", np.ones((4, 4), np.float32), {fmt.DTYPE_ATTR: "float32"})], {}, {})

    def full(d, rank):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "region_to_write", full)
    with pytest.raises(CheckpointError, match=r"/model/a: OSError(.|\n)*HINT: the file system is full"):
        writer.write_serial(str(tmp_path / "ckpt-00000001.h5.tmp"), ckplan.plan_snapshot(snap, 1, 0))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"writing .*/nowhere/ckpt.h5 failed(.|\n)*HINT: the previous checkpoint"):
        writer.write_serial(str(tmp_path / "nowhere" / "ckpt.h5"), ckplan.plan_snapshot(snap, 1, 0))

def test_all_finite_per_dtype_as_stored():
    """NaN and infinity are found in every floating dtype, also those stored as raw bits."""
    import torch

    from hpctrain.checkpoint.content.snapshot import tensor_to_array

    dtypes = [torch.float16, torch.float32, torch.float64, torch.bfloat16]
    dtypes += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    for dtype in dtypes:
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = torch.tensor([0.5, -2.0, 1.0], dtype=torch.float32)
            array, name = tensor_to_array(t.to(dtype), copy=True)
            assert fmt.all_finite(array, name), name
            t[1] = bad
            array, name = tensor_to_array(t.to(dtype), copy=True)
            expect = not torch.isfinite(t.to(dtype).float()).all().item()  # e4m3fn turns inf into NaN
            assert fmt.all_finite(array, name) is not expect, (name, bad)
    ints, name = tensor_to_array(torch.tensor([1, 2]), copy=False)
    assert fmt.all_finite(ints, name) and fmt.all_finite(np.array([True]), "bool")


def test_finite_paths_are_parameters_and_optimizer_state():
    groups = {"optimizer": {"param_groups": json.dumps([{"params": ["fc.weight", "a/b"], "lr": 0.1}])}}
    paths = ["model/fc.weight", "model/a%2Fb", "model/causal_mask", "optimizer/state/fc.weight/exp_avg",
             "trainer/rng/torch"]
    assert fmt.finite_paths(groups, paths) == {"model/fc.weight", "model/a%2Fb", "optimizer/state/fc.weight/exp_avg"}


def test_metadata_crc_covers_values_not_their_types():
    """The same values give the same checksum whether written (Python, numpy) or read back
    (numpy scalars, bytes); any changed value, shape or dtype changes it."""
    root = {"step": 12, "created_unix": 1.5, "run_config": "{}", "metadata_crc32": 7}
    groups = {"trainer": {"step": 12, "extra": "{}"}, "optimizer/state": {}}
    datasets = {"model/w": ((2, 3), "<f4", {"crc32": np.uint32(5), "dtype": "float32"})}
    crc = fmt.metadata_crc(root, groups, datasets)
    read_back = ({"step": np.int64(12), "created_unix": np.float64(1.5), "run_config": b"{}"},
                 {"trainer": {"step": np.int64(12), "extra": "{}"}},
                 {"model/w": ((2, 3), "<f4", {"crc32": 5, "dtype": b"float32"})})
    assert fmt.metadata_crc(*read_back) == crc
    assert fmt.metadata_crc(dict(root, step=13), groups, datasets) != crc
    assert fmt.metadata_crc(root, {"trainer": {"step": 12, "extra": "{ }"}}, datasets) != crc
    assert fmt.metadata_crc(root, groups, {"model/w": ((3, 2), "<f4", datasets["model/w"][2])}) != crc
    assert fmt.metadata_crc(root, groups, {"model/w": ((2, 3), "<f8", datasets["model/w"][2])}) != crc


def test_in_place_targets_skip_shared_mismatched_and_strided_tensors():
    import torch

    from hpctrain.checkpoint.content import snapshot
    from hpctrain.state import Progress, TrainState

    model = torch.nn.Module()
    model.a = torch.nn.Linear(4, 3)
    model.b = torch.nn.Linear(3, 4)
    model.b.weight = torch.nn.Parameter(model.a.weight.detach().t().contiguous())
    model.tied = torch.nn.Linear(4, 3)
    model.tied.weight = model.a.weight  # shares memory with a.weight: read into fresh arrays
    model.register_buffer("strided", torch.zeros(4, 6)[:, ::2])  # not contiguous
    model.register_buffer("flags", torch.zeros(2, dtype=torch.bool))  # stored as uint8
    state = TrainState(model, None, Progress())

    def stored(name, tensor, dtype=None):
        array, tname = snapshot.tensor_to_array(tensor.contiguous(), copy=True)
        return snapshot.model_path(name), (tuple(array.shape), array.dtype.str, {fmt.DTYPE_ATTR: dtype or tname})

    datasets = dict(stored(n, t) for n, t in model.state_dict().items())
    path, (shape, dtype, attrs) = stored("b.bias", model.b.bias, dtype="float64")
    datasets[path] = (shape, "<f8", attrs)  # saved as float64: not this tensor's dtype
    targets = snapshot.in_place_targets(state, datasets)
    assert sorted(targets) == ["model/a.bias", "model/b.weight", "model/tied.bias"]
    array, tensor = targets["model/b.weight"]
    assert array.ctypes.data == tensor.data_ptr() == model.b.weight.data_ptr()


def test_checksum_is_zlibs_crc32_and_fast_where_isal_installs():
    import platform

    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    assert fmt.crc32(data) == zlib.crc32(data) and fmt.crc32(data[:999], 77) == zlib.crc32(data[:999], 77)
    assert fmt.crc32_bytes(data.view(np.float32)) == zlib.crc32(data)
    if platform.machine() in ("x86_64", "aarch64"):  # setup.cfg installs isal there
        assert fmt.crc32 is not zlib.crc32, "isal is missing: pip install isal (make setup installs it)"


def test_early_writeback_asks_the_kernel_for_the_file_while_it_is_written(tmp_path, monkeypatch):
    # The real sync_file_range, wrapped to record what it was asked and what it answered.
    import os
    import time

    from hpctrain.runtime import fsutil

    real = fsutil._sync_file_range()
    if real is None:
        pytest.skip("no sync_file_range here (not Linux)")
    calls = []

    def recording(fd, offset, nbytes, flags):
        rc = real(fd, offset, nbytes, flags)
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), flags, rc))
        return rc

    monkeypatch.setattr(fsutil, "_sync_file_range", lambda: recording)
    path = tmp_path / "ckpt.h5.tmp"
    stop = fsutil.early_writeback(str(path), interval=0.005)
    time.sleep(0.03)  # the file does not exist yet: nothing is asked
    assert calls == []
    with open(path, "wb") as f:
        for _ in range(8):
            f.write(b"\1" * (1 << 20))
            f.flush()
            time.sleep(0.02)
        stop()
    assert calls, "no write-back was asked for while the file was written"
    assert {c[0] for c in calls} == {str(path)} and {c[1] for c in calls} == {fsutil._SYNC_FILE_RANGE_WRITE}
    assert {c[2] for c in calls} == {0}  # the kernel accepted every request
    n = len(calls)
    time.sleep(0.03)
    assert len(calls) == n  # stopped means stopped
