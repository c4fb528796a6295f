"""Smoke runs of every benchmark at tiny sizes under a real mpirun: each writes JSON with
the expected fields and sane values, and the report renders it. Not a test of speed."""
import json
import sys

import pytest

from mpi_harness import ROOT, mpirun

pytestmark = pytest.mark.mpi

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def _have_horovod():
    import importlib.util

    return importlib.util.find_spec("horovod") is not None


def run(n, script, *args, timeout=150):
    mpirun(n, [BENCH / script, *args], timeout=timeout, check=True)


def read(path):
    doc = json.loads(path.read_text())
    assert {"benchmark", "ranks", "params", "machine", "results"} <= set(doc)
    return doc


@pytest.mark.parametrize("backend", ["mpi", pytest.param("horovod", marks=pytest.mark.skipif(
    not _have_horovod(), reason="Horovod is not installed (make setup)"))])
def test_allreduce(tmp_path, backend):
    out = tmp_path / "ar.json"
    run(2, "allreduce.py", "--backend", backend, "--sizes", "65536", "1048576", "--tensors", "4",
        "--reps-scale", "0.1", "--out", out)
    doc = read(out)
    assert doc["ranks"] == 2
    rows = doc["results"]
    assert {r["path"] for r in rows} == {"fused_allreduce", f"{backend}_none", f"{backend}_fp16"}
    assert sorted({r["bytes"] for r in rows}) == [65536, 1048576]
    for r in rows:
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] and r["busbw_gbs"] > 0
        assert r["wire_bytes"] == (r["bytes"] // 2 if r["path"].endswith("fp16") else r["bytes"])
        # busbw = algbw * 2(n-1)/n = algbw on 2 ranks
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])
        if r["path"] == "fused_allreduce":
            assert r["ratio_to_fused"] == 1.0


@pytest.mark.parametrize("impl", ["ddp", "mpi"])
def test_train_step(tmp_path, impl):
    out = tmp_path / "ts.json"
    run(2, "train_step.py", "--impl", impl, "--model", "small", "--hidden", "16", "--batch", "4",
        "--steps", "2", "--warmup", "1", "--block", "1", "--out", out)
    r = read(out)["results"]
    assert r["impl"] == impl and r["tensors"] > 300  # the many-small-tensors model
    assert r["grad_bytes"] == 4 * r["parameters"]
    for key in ("step_s", "local_step_s", "fused_allreduce_s", "forward_backward_s", "optimizer_s"):
        assert 0 < r[key] < 60, key
    assert r["sync_s"] >= 0 and r["step_over_local"] > 0
    assert (r["sync_over_fused"] is None) == (impl == "ddp")
    assert len(r["step_samples_s"]) == 2


def test_ckpt_io(tmp_path):
    out = tmp_path / "ck.json"
    run(2, "ckpt_io.py", "--state-mib", "4", "--reps", "1", "--dir", tmp_path / "scratch", "--stall",
        "--stall-steps", "1", "--stall-reps", "1", "--out", out, timeout=240)
    r = read(out)["results"]
    assert r["state_bytes"] > 3 * 2 ** 20
    methods = {m["method"]: m for m in r["methods"]}
    assert {"raw", "torch", "hpctrain", "hpctrain_noverify"} <= set(methods)
    assert "dcp" in methods or r["dcp_error"]
    for name, m in methods.items():
        assert m["save_s"] > 0 and m["peak_extra_bytes"] >= 0
        assert m["file_bytes"] >= 0.9 * r["state_bytes"], name  # the whole state was written
        assert (m["load_s"] is None) == (name == "hpctrain_noverify")
        assert (m["load_warm_s"] is None) == (name == "hpctrain_noverify")
        assert m["load_warm_s"] is None or m["load_warm_s"] > 0
    for mode in ("sync", "async"):
        s = r["stall"][mode]
        assert s["total_s"] > 0 and s["blocking_s"] >= 0 and s["baseline_s"] > 0
    assert list((tmp_path / "scratch").glob("*.h5")) == []  # removed after each measurement


def test_report_renders_every_section(tmp_path):
    from report import render

    run(2, "allreduce.py", "--backend", "mpi", "--sizes", "4194304", "--reps-scale", "0.1",
        "--out", tmp_path / "allreduce-mpi-2.json")
    for impl in ("ddp", "mpi"):
        run(2, "train_step.py", "--impl", impl, "--model", "large", "--hidden", "32", "--batch", "4",
            "--steps", "1", "--warmup", "1", "--out", tmp_path / f"train_step-large-{impl}-none-2.json")
    run(1, "train_step.py", "--impl", "mpi", "--model", "large", "--hidden", "32", "--batch", "4",
        "--steps", "1", "--warmup", "1", "--out", tmp_path / "train_step-large-mpi-none-1.json")
    table = render(str(tmp_path))
    assert "## 1. Gradient all-reduce" in table and "| 2 | 4 MiB |" in table
    assert "## 2. Training step, large model" in table and "| mpi none |" in table
    assert "## Targets" in table and ("met" in table or "MISSED" in table)
