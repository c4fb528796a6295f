"""Every byte that resume depends on is covered by a checksum: single bit flips at random
offsets of a real checkpoint (written by 2 ranks through parallel HDF5): a third anywhere, a
third in the file's metadata (everything that is not dataset bytes), a third in the stored
text of the attributes resume reads. Each flip must be reported by
``verify_checkpoint`` (what ``hpctrain ckpt verify`` and resume run), or change nothing that
resume reads: tensors, progress, optimizer groups and state.

Every trial runs in a forked child, so that a flip which crashed HDF5 would be seen as such."""
import json
import os
import random
import shutil
import signal
import sys

import pytest

from assertions import ranks_say
from mpi_harness import ROOT, mpirun

pytestmark = pytest.mark.mpi

SCRIPTS = ROOT / "tests" / "mpi"
TRIALS = 180  # each a forked child that verifies the file (about 0.1 s)
IN_METADATA = 60  # of the trials, flips outside every dataset's bytes
IN_RESUMED_TEXT = 60  # and flips in the stored text of attributes that resume reads
SEED = 12


class SelfComm:
    """The one-process communicator load_checkpoint needs here (no MPI in forked children)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def Barrier(self):
        pass


def _resumed(path):
    """What resume reads from ``path``, as plain comparable values."""
    sys.path.insert(0, str(SCRIPTS))
    import ckpt_common as cc
    from hpctrain.checkpoint import load_checkpoint

    state = cc.make_state(seed=99)
    cc.step_once(state, 0)  # the optimizer has state to be replaced
    load_checkpoint(path, state, SelfComm(), restore_rng=False)
    return cc.reference(state)


def _child(path, reference, out):
    from hpctrain.checkpoint import verify_checkpoint

    sys.path.insert(0, str(SCRIPTS))
    import ckpt_common as cc

    signal.alarm(60)
    problems = verify_checkpoint(path)
    if problems:
        verdict = ["reported", problems[0][:200]]
    else:
        try:
            loaded = _resumed(path)
        except Exception as exc:  # not reported by verify, yet resume fails: counted as missed
            verdict = ["load failed", f"{type(exc).__name__}: {exc}"[:300]]
        else:
            try:
                for part in ("model", "optimizer", "progress"):
                    cc._same(reference[part], loaded[part], part)
                verdict = ["unchanged", ""]
            except AssertionError as exc:
                verdict = ["CHANGED", str(exc)[:300]]
    os.write(out, json.dumps(verdict).encode())
    os._exit(0)


def _data_ranges(path):
    import h5py

    ranges = []
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                ranges.append((obj.id.get_offset(), obj.id.get_offset() + obj.id.get_storage_size()))
        f.visititems(visit)
    return sorted(ranges)


def _resumed_text_offsets(path):
    """Byte offsets of the text of the JSON attributes resume reads (learning rates and
    betas in param_groups, per-parameter optimizer values, progress extra and best_metric),
    found in the file's bytes."""
    import h5py

    texts = []
    with h5py.File(path, "r") as f:
        texts.append(f["optimizer"].attrs["param_groups"])
        texts += [f["trainer"].attrs[k] for k in ("extra", "best_metric")]
        f["optimizer/state"].visititems(lambda n, o: texts.append(o.attrs["values"]) if "values" in o.attrs else None)
    blob = open(path, "rb").read()
    offsets = []
    for text in texts:
        raw = text.encode() if isinstance(text, str) else bytes(text)
        at = blob.find(raw)
        assert at >= 0, f"attribute text {raw[:40]!r} not found in the file"
        offsets.extend(range(at, at + len(raw)))
    return offsets


def _metadata_offsets(size, ranges):
    offsets, pos = [], 0
    for a, b in ranges:
        offsets.extend(range(pos, a))
        pos = b
    offsets.extend(range(pos, size))
    return offsets


def test_bit_flips_are_reported_or_harmless(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_CKPT_SERIAL", "1")  # the children read without MPI
    result = mpirun(2, [SCRIPTS / "ckpt_safety.py", tmp_path, "for_flips"], timeout=120).check()
    ranks_say(result, "for_flips OK", 2)
    original = tmp_path / "flips" / "ckpt-00000002.h5"
    import torch

    torch.set_num_threads(1)
    reference = _resumed(str(original))
    size = os.path.getsize(original)
    meta = _metadata_offsets(size, _data_ranges(original))
    rng = random.Random(SEED)
    texts = _resumed_text_offsets(original)
    flips = [(rng.choice(meta), rng.randrange(8)) for _ in range(IN_METADATA)]
    flips += [(rng.choice(texts), rng.randrange(8)) for _ in range(IN_RESUMED_TEXT)]
    flips += [(rng.randrange(size), rng.randrange(8)) for _ in range(TRIALS - IN_METADATA - IN_RESUMED_TEXT)]
    trial = tmp_path / "trial.h5"
    shutil.copy(original, trial)
    tally, bad = {}, []
    with open(trial, "r+b") as f:
        for offset, bit in flips:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
            f.flush()
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(str(trial), reference, w)
            os.close(w)
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            os.close(r)
            _, status = os.waitpid(pid, 0)
            verdict = json.loads(data) if data else ["crashed", f"wait status {status}"]
            tally[verdict[0]] = tally.get(verdict[0], 0) + 1
            if verdict[0] not in ("reported", "unchanged"):
                bad.append((offset, bit, verdict))
            f.seek(offset)
            f.write(bytes([byte]))
            f.flush()
    print(f"{TRIALS} flips ({IN_METADATA} in metadata, {IN_RESUMED_TEXT} in attribute text) of a {size}-byte file: {tally}")
    assert not bad, f"flips neither reported nor harmless ({tally}): {bad[:10]}"
