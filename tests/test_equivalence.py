"""The package redesign changes no behaviour, bit for bit: the same training launches on the
code of the reference commit (extracted with ``git archive``) and on the working tree write
the same checkpoint files, dataset for dataset and attribute for attribute.

Five scenarios (comm.mode sync, local_sgd, stale; comm.shard=optimizer; a 2-stage pipeline),
each a real ``mpirun -n 2`` that crosses an epoch boundary, checkpoints every 2 steps and is
stopped on request at step 5, then a ``mpirun -n 1`` that resumes it (``checkpoint.resume=auto``,
the pipeline in the dense model) and trains to the end. All five share one process per launch:
4 launches in all (old 2-rank, old 1-rank, new 2-rank, new 1-rank).
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mpi_harness import ROOT, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

REFERENCE = "2c7090a5f75ab01feba3db42be458b0e3b7cf244"  # the code before the package redesign
SCRIPT = ROOT / "tests" / "mpi" / "equivalence_run.py"
SCENARIOS = ("sync", "local_sgd", "stale", "shard_optimizer", "pipeline")
STOP_AT, LAST_STEP = 5, 12  # equivalence_run.py: stop after step 5; 3 epochs of 4 steps
TIMEOUT = 150
# Root attributes that say when, where and with what a file was written, not what it holds
# (metadata_crc32 covers them too).
VOLATILE_ROOT = {"created", "created_unix", "hostname", "metadata_crc32"}
CKPT = re.compile(r"^ckpt-(\d+)\.h5$")


def extract_reference(dest):
    """The reference commit's ``hpctrain/`` under ``dest``; a missing git or commit fails the
    test (never skips it: without the reference there is no proof)."""
    git = shutil.which("git")
    assert git, "git is not on PATH: cannot extract the reference code of the equivalence test"
    found = subprocess.run([git, "-C", str(ROOT), "cat-file", "-e", f"{REFERENCE}^{{commit}}"],
                           capture_output=True, text=True)
    assert found.returncode == 0, (f"reference commit {REFERENCE} is not in {ROOT} ({found.stderr.strip()}); "
                                   f"fetch it (e.g. git fetch --unshallow)")
    dest.mkdir(parents=True)
    archive = subprocess.run(f"{git} -C {ROOT} archive {REFERENCE} hpctrain | tar -x -C {dest}", shell=True,
                             capture_output=True, text=True, timeout=120)
    assert archive.returncode == 0 and (dest / "hpctrain" / "__init__.py").is_file(), (
        f"git archive {REFERENCE} hpctrain failed: {archive.stderr}")
    return dest


def launch(n, out, phase, pythonpath, expect_file):
    """One launch of every scenario; checks which hpctrain ran and how each scenario ended."""
    env = None if pythonpath is None else {"PYTHONPATH": str(pythonpath)}  # None: the harness's, the repo root
    result = mpirun(n, [SCRIPT, out, phase, *SCENARIOS], timeout=TIMEOUT, env=env, check=True)
    ran = re.findall(r"^HPCTRAIN_FILE (.+)$", result.stdout, re.M)
    assert ran and os.path.realpath(ran[0]) == os.path.realpath(expect_file), (
        f"{phase} launch on {n} rank(s) ran {ran}, not {expect_file}")
    stopped, step = (True, STOP_AT) if phase == "first" else (False, LAST_STEP)
    for name in SCENARIOS:
        line = f"SCENARIO {name} {phase} stopped={stopped} step={step}"
        assert line in result.stdout, f"expected {line!r}\n--- stdout\n{result.stdout[-4000:]}"
    return result


def checkpoint_files(out, name):
    """{file name: sha256} of the checkpoints of one scenario's run."""
    directory = out / name / "checkpoints"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if CKPT.match(p.name)}


def run_side(base, side, pythonpath, package):
    """The 2-rank launch, then the 1-rank resume, in ``base/side``; returns the checkpoints
    the first launch wrote ({scenario: {file: sha256}})."""
    out = base / side
    expect = package / "hpctrain" / "__init__.py"
    launch(2, out, "first", pythonpath, expect)
    first = {name: checkpoint_files(out, name) for name in SCENARIOS}
    launch(1, out, "resume", pythonpath, expect)
    for name in SCENARIOS:
        after = checkpoint_files(out, name)
        steps = [int(CKPT.match(f).group(1)) for f in first[name]]
        assert len(steps) >= 2 and max(steps) == STOP_AT, (
            f"{side}/{name}: the 2-rank launch wrote {sorted(first[name])}")
        for f, digest in first[name].items():  # a run that started over would have rewritten them
            assert after.get(f) == digest, f"{side}/{name}: the resumed run rewrote or removed {f}"
        resumed = [int(CKPT.match(f).group(1)) for f in set(after) - set(first[name])]
        assert resumed and min(resumed) > STOP_AT and max(resumed) == LAST_STEP, (
            f"{side}/{name}: the 1-rank launch wrote {sorted(resumed)}, not steps after {STOP_AT} up to {LAST_STEP}")
    return first


def _normal(value, out):
    """An attribute as comparable bytes: numpy values by dtype and bytes, text with this
    side's output directory (in run_config) written as <OUT>."""
    import numpy as np

    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        return "str", value.replace(str(out), "<OUT>")
    array = np.asarray(value)
    return str(array.dtype), array.shape, array.tobytes()


def h5_contents(path, out):
    """Every dataset's (dtype, shape, bytes) and every group's and dataset's attributes,
    by HDF5 path; the root's attributes without the volatile ones."""
    import h5py

    datasets, attrs = {}, {}
    with h5py.File(path, "r") as f:
        attrs["/"] = {k: _normal(v, out) for k, v in f.attrs.items()
                      if k not in VOLATILE_ROOT and not (k.endswith("_version") and k != "format_version")}

        def visit(name, obj):
            attrs[f"/{name}"] = {k: _normal(v, out) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                datasets[f"/{name}"] = (str(data.dtype), data.shape, data.tobytes())

        f.visititems(visit)
    return datasets, attrs


def _describe(old, new):
    """Where two datasets' bytes part: the dtypes and shapes, or the first differing element."""
    import numpy as np

    (old_type, old_shape, old_bytes), (new_type, new_shape, new_bytes) = old, new
    if (old_type, old_shape) != (new_type, new_shape) or np.dtype(old_type).itemsize not in (1, 2, 4, 8):
        return f"old {old_type}{list(old_shape)}, new {new_type}{list(new_shape)}"
    bits = f"u{np.dtype(old_type).itemsize}"  # bitwise: -0.0 is not 0.0, NaN is itself
    a, b = np.frombuffer(old_bytes, bits), np.frombuffer(new_bytes, bits)
    i = int(np.flatnonzero(a != b)[0])
    where = np.unravel_index(i, old_shape) if old_shape else ()
    values = np.frombuffer(old_bytes, old_type)[i], np.frombuffer(new_bytes, new_type)[i]
    return (f"{old_type}{list(old_shape)}, {int((a != b).sum())} element(s) differ, first at "
            f"{list(map(int, where))}: old {values[0]!r}, new {values[1]!r}")


def _known_settings(old, new):
    """The run configurations (JSON) on the settings the reference code has: keys added since, at their
    defaults, are not a change of behaviour. ``train.epochs`` is in both (the scenarios set it)."""
    old_cfg, new_cfg = json.loads(old[1]), json.loads(new[1])
    for section, table in new_cfg.items():
        if isinstance(table, dict) and isinstance(old_cfg.get(section), dict):
            new_cfg[section] = {k: v for k, v in table.items() if k in old_cfg[section]}
    return old_cfg, new_cfg


def first_difference(name, file, old, new):
    """The failure message naming the scenario, the file and the first differing entry."""
    (old_data, old_attrs), (new_data, new_attrs) = old, new
    where = f"scenario {name}, {file}"
    if sorted(old_data) != sorted(new_data):
        return f"{where}: datasets differ: only old {sorted(set(old_data) - set(new_data))}, " \
               f"only new {sorted(set(new_data) - set(old_data))}"
    for key in sorted(old_data):
        if old_data[key] != new_data[key]:
            return f"{where}: dataset {key} differs: {_describe(old_data[key], new_data[key])}"
    if sorted(old_attrs) != sorted(new_attrs):
        return f"{where}: objects differ: only old {sorted(set(old_attrs) - set(new_attrs))}, " \
               f"only new {sorted(set(new_attrs) - set(old_attrs))}"
    for obj in sorted(old_attrs):
        for key in sorted(set(old_attrs[obj]) | set(new_attrs[obj])):
            a, b = old_attrs[obj].get(key), new_attrs[obj].get(key)
            if obj == "/" and key == "run_config":
                a, b = _known_settings(a, b)
            if a != b:
                return f"{where}: attribute {obj} @{key} differs: old {str(a)[:300]}, new {str(b)[:300]}"
    return None


def test_redesign_changes_no_checkpoint_bit(tmp_path):
    old_code = extract_reference(tmp_path / "reference")
    run_side(tmp_path, "old", old_code, old_code)
    run_side(tmp_path, "new", None, ROOT)

    compared = set()
    for name in SCENARIOS:
        old_dir, new_dir = tmp_path / "old" / name / "checkpoints", tmp_path / "new" / name / "checkpoints"
        old_files = sorted(p.name for p in old_dir.iterdir())
        new_files = sorted(p.name for p in new_dir.iterdir())
        assert old_files == new_files, (
            f"scenario {name}: checkpoint directories differ: old {old_files}, new {new_files}")
        assert (old_dir / "latest").read_text() == (new_dir / "latest").read_text(), (
            f"scenario {name}: the latest file differs")
        for file in (f for f in old_files if CKPT.match(f)):
            old = h5_contents(old_dir / file, tmp_path / "old")
            new = h5_contents(new_dir / file, tmp_path / "new")
            difference = first_difference(name, file, old, new)
            assert difference is None, difference
            compared.update(old[0])
    # Not vacuous: the parameters and the optimizer state were among what was compared.
    for prefix in ("/model/", "/optimizer/state/", "/trainer/rng/"):
        assert any(k.startswith(prefix) for k in compared), f"no {prefix} dataset compared: {sorted(compared)}"
    assert any(k.startswith("/comm/") for k in compared), "comm.mode=stale's pending gradient was not compared"
