"""Smoke runs of every benchmark at tiny sizes under a real mpirun: each writes JSON with
the expected fields and sane values, and the report renders it with the verdict its numbers
give. The report's verdicts are also checked on numbers chosen around the targets. Not a
test of speed."""
import json
import re
import sys

import pytest

from mpi_harness import ROOT, mpirun, needs_horovod

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def run(n, script, *args, timeout=150):
    mpirun(n, [BENCH / script, *args], timeout=timeout, check=True)


def read(path):
    doc = json.loads(path.read_text())
    assert {"benchmark", "ranks", "params", "machine", "results"} <= set(doc)
    return doc


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", pytest.param("horovod", marks=needs_horovod)])
def test_allreduce(tmp_path, backend):
    out = tmp_path / "ar.json"
    run(2, "allreduce.py", "--backend", backend, "--sizes", "65536", "1048576", "--tensors", "4",
        "--reps-scale", "0.1", "--out", out)
    doc = read(out)
    assert doc["ranks"] == 2
    rows = doc["results"]
    parts = {"horovod_one_tensor", "horovod_floor"} if backend == "horovod" else set()
    assert {r["path"] for r in rows} == {"fused_allreduce", f"{backend}_none", f"{backend}_fp16"} | parts
    assert sorted({r["bytes"] for r in rows}) == [65536, 1048576]
    for r in rows:
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] and r["busbw_gbs"] > 0
        wire = 4 if r["path"] == "horovod_floor" else r["bytes"] // 2 if r["path"].endswith("fp16") else r["bytes"]
        assert r["wire_bytes"] == wire
        # busbw = algbw * 2(n-1)/n = algbw on 2 ranks
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])
        if r["path"] == "fused_allreduce":
            assert r["ratio_to_fused"] == 1.0


@pytest.mark.mpi
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


@pytest.mark.mpi
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
        assert s["total_s"] > 0 and s["blocking_s"] >= 0 and s["baseline_s"] > 0 and s["other_cpu_s"] >= 0
    assert list((tmp_path / "scratch").glob("*.h5")) == []  # removed after each measurement


@pytest.mark.mpi
def test_ckpt_io_as_make_bench_launches_it_without_touched_memory(tmp_path):
    # The trained-first launch: training steps first, the methods rotated, the two layouts' floors.
    out = tmp_path / "trained.json"
    run(2, "ckpt_io.py", "--state-mib", "4", "--reps", "2", "--prefault-mib", "0", "--train-steps", "1",
        "--methods", "hpctrain", "dcp", "raw_shared", "raw_per_rank", "--dir", tmp_path / "scratch", "--out", out,
        timeout=240)
    r = read(out)["results"]
    assert r["prefault_bytes"] == 0
    methods = {m["method"]: m for m in r["methods"]}
    assert {"hpctrain", "raw_shared", "raw_per_rank"} <= set(methods) and ("dcp" in methods or r["dcp_error"])
    for name, m in methods.items():
        assert m["reps"] == 2 and len(m["save_samples_s"]) == 2, name
        assert m["file_bytes"] >= 0.9 * r["state_bytes"], name
        assert (m["load_s"] is None) == name.startswith("raw_"), name  # the floors only save
    # The async stall alone, no method (the 1-rank launch of make bench).
    run(1, "ckpt_io.py", "--methods", "--state-mib", "4", "--stall", "--stall-steps", "1", "--stall-reps", "1",
        "--out", tmp_path / "stall.json", timeout=240)
    r = read(tmp_path / "stall.json")["results"]
    assert r["methods"] == [] and r["stall"]["async"]["total_s"] > 0


def targets(table):
    """The rows of the report's ``## Targets`` table: {target: (measured, verdict)}."""
    assert "## Targets\n\n" in table and "\n| target | measured | verdict |\n|---|---|---|\n" in table, table
    rows = {}
    for line in table.split("## Targets", 1)[1].split("|---|---|---|\n", 1)[1].splitlines():
        if not line.startswith("|"):
            break
        m = re.fullmatch(r"\| (.+) \| (\S+) \| (\S+) \|", line)
        assert m, line
        rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def _allreduce_doc(ranks, backend, ratio):
    row = lambda path, r: {"path": path, "bytes": 4 * 2 ** 20, "ratio_to_fused": r, "busbw_gbs": 1.0}  # noqa: E731
    return {"benchmark": "allreduce", "ranks": ranks,
            "results": [row("fused_allreduce", 1.0), row(f"{backend}_none", ratio)]}


def test_targets_give_each_verdict(tmp_path):
    # Measurements chosen on each side of the 1.2x target, and on it.
    from report import render

    for name, doc in {"allreduce-mpi-2": _allreduce_doc(2, "mpi", 1.2),
                      "allreduce-horovod-2": _allreduce_doc(2, "horovod", 1.5),
                      "allreduce-mpi-4": _allreduce_doc(4, "mpi", 0.9)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    assert targets(render(str(tmp_path))) == {
        "sync mpi none 4 MiB 2 ranks <= 1.2x fused": ("1.20", "met"),
        "sync horovod none 4 MiB 2 ranks <= 1.2x fused": ("1.50", "MISSED"),
        "sync mpi none 4 MiB 4 ranks <= 1.2x fused": ("0.90", "met"),
    }


def test_small_buffers_show_horovods_floor_against_the_target(tmp_path):
    from report import render

    def row(path, nbytes, ms, fused_ms):
        return {"path": path, "bytes": nbytes, "median_s": ms / 1e3, "ratio_to_fused": ms / fused_ms,
                "busbw_gbs": 1.0}

    results = []
    for nbytes, fused, floor, one, many in ((256 * 1024, 0.05, 0.20, 0.25, 0.60), (4 * 2 ** 20, 0.70, 0.20, 0.90, 1.00)):
        results += [row("fused_allreduce", nbytes, fused, fused), row("horovod_floor", nbytes, floor, fused),
                    row("horovod_one_tensor", nbytes, one, fused), row("horovod_none", nbytes, many, fused)]
    (tmp_path / "allreduce-horovod-2.json").write_text(json.dumps({"benchmark": "allreduce", "ranks": 2,
                                                                    "results": results}))
    # The baseline is the mpi launch's Allreduce where there is one (4 MiB here): not the one
    # beside Horovod's thread, which the scheduler can hold up.
    clean = row("fused_allreduce", 4 * 2 ** 20, 0.5, 0.5)
    (tmp_path / "allreduce-mpi-2.json").write_text(json.dumps({"benchmark": "allreduce", "ranks": 2,
                                                               "results": [clean]}))
    table = render(str(tmp_path))
    # floor + fused bounds Horovod from below: 0.25 ms > 0.075 at 256 KiB; 0.70 ms < 0.75 at 4 MiB
    assert "| 256 KiB | 0.050 | 0.050 | 0.075 | 0.200 | 0.250 | 0.250, 5.00 | 0.600, 12.00 | yes |" in table
    assert "| 4 MiB | 0.500 | 0.700 | 0.750 | 0.200 | 0.700 | 0.900, 1.80 | 1.000, 2.00 | no |" in table
    got = targets(table)
    assert got["small sync horovod none 256 KiB 2 ranks <= 1.5x fused"] == ("12.00", "MISSED")
    assert got["small sync horovod none 4 MiB 2 ranks <= 1.5x fused"] == ("2.00", "MISSED")


def test_no_measurements_no_targets(tmp_path):
    from report import render

    (tmp_path / "allreduce-mpi-2.json").write_text(json.dumps(dict(_allreduce_doc(2, "mpi", 1.0), results=[
        {"path": "mpi_none", "bytes": 65536, "ratio_to_fused": 3.0, "busbw_gbs": 1.0}])))
    table = render(str(tmp_path))
    assert "| 2 | 64 KiB |" in table and "## Targets" not in table  # small sizes are shown, not judged


def _verdict(value, limit):
    return "met" if value <= limit else "MISSED"


@pytest.mark.mpi
def test_report_renders_every_section(tmp_path):
    from report import TARGETS, render

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
    assert "## 4. Scaling" in table
    # One verdict per judged measurement, each the one its numbers give.
    (sync,) = [r["ratio_to_fused"] for r in read(tmp_path / "allreduce-mpi-2.json")["results"]
               if r["path"] == "mpi_none"]
    mpi, ddp = (read(tmp_path / f"train_step-large-{impl}-none-2.json")["results"] for impl in ("mpi", "ddp"))
    step = mpi["step_over_local"] / ddp["step_over_local"]
    assert targets(table) == {
        "sync mpi none 4 MiB 2 ranks <= 1.2x fused": (f"{sync:.2f}", _verdict(sync, TARGETS["sync"])),
        "step mpi none, large model, <= DDP (normalised)": (f"{step:.2f}", _verdict(step, TARGETS["step"])),
    }


# ---------------------------------------------------------------- trusting a figure
def _cond(load_before=0.5, foreign=0.1, steal=0.0, cpus=2):
    return {"load_before": [load_before, 0, 0], "load_after": [1.0, 0, 0], "cpus": cpus,
            "foreign_cores": foreign, "steal_fraction": steal, "own_cores": 2.0, "seconds": 10}


def test_judge_names_what_was_not_quiet():
    from conditions import judge

    assert judge(_cond()) == (True, "")
    assert judge(_cond(load_before=2.5)) == (False, "load 2.5 > 2 cores before the launch")
    assert judge(_cond(foreign=0.8)) == (False, "other processes used 0.80 cores during it")
    ok, why = judge(_cond(load_before=3.0, steal=0.2))
    assert not ok and "load 3.0 > 2 cores" in why and "CPU steal 20%" in why


def test_launch_cpu_is_told_from_other_processes():
    """A child's CPU time is the launch's own; CPU burnt in this process counts as another's."""
    import subprocess
    import time

    from conditions import during, snapshot

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    before = snapshot()
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)
    child = during(before, snapshot())
    assert child["own_cores"] * child["seconds"] >= 0.5
    before = snapshot()
    t = time.process_time()
    while time.process_time() - t < 0.6:
        pass
    here = during(before, snapshot())
    assert here["own_cores"] == 0 and here["foreign_cores"] * here["seconds"] >= 0.4


def test_settle_waits_for_the_load_to_fall():
    from conditions import settle

    loads = iter([3.0, 2.5, 1.5, 0.5])
    slept = []
    assert settle(cpus=2, poll=1.0, sleep=slept.append, load=lambda: (next(loads), 0, 0)) == 2.0
    assert slept == [1.0, 1.0]
    assert settle(cpus=2, timeout=3.0, poll=1.0, sleep=lambda s: None, load=lambda: (9.0, 0, 0)) == 3.0


def test_report_refuses_a_ratio_from_a_busy_launch(tmp_path):
    from report import render

    for name, doc in {"allreduce-mpi-2": _allreduce_doc(2, "mpi", 1.1),
                      "allreduce-horovod-2": _allreduce_doc(2, "horovod", 1.1)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    entry = lambda name, ok, why="": {"name": name, "rc": 0, "seconds": 5.0, "conditions": _cond(),  # noqa: E731
                                      "publishable": ok, "why_not": why}
    (tmp_path / "launches.json").write_text(json.dumps({"launches": [
        entry("allreduce-mpi-2", True), entry("allreduce-horovod-2", False, "load 3.1 > 2 cores before the launch")]}))
    table = render(str(tmp_path))
    assert targets(table) == {"sync mpi none 4 MiB 2 ranks <= 1.2x fused": ("1.10", "met"),
                              "sync horovod none 4 MiB 2 ranks <= 1.2x fused": ("1.10", "unpublished")}
    assert "- sync horovod none 4 MiB 2 ranks <= 1.2x fused: allreduce-horovod-2: load 3.1 > 2 cores" in table
    assert "| allreduce-horovod-2 | 5 | 0.5 | 1.0 | 0.10 | 0% | no: load 3.1 > 2 cores before the launch |" in table


def _ckpt_doc(rows):
    return {"benchmark": "ckpt_io", "ranks": 2, "results": {"state_bytes": 2 ** 30, "methods": [
        {"method": m, "save_samples_s": saves, "load_samples_s": loads} for m, saves, loads in rows]}}


def test_checkpoint_settings_judge_hpctrain_against_dcp_in_each(tmp_path):
    from report import render

    # Fresh processes: one sample per launch, the methods alternating; hpctrain's save slower, load faster.
    for r, (ours, dcp) in enumerate(((1.2, 1.0), (1.4, 1.0), (1.3, 1.1))):
        fresh = _ckpt_doc([("hpctrain", [ours], [0.5])])
        (tmp_path / f"ckpt_io-fresh-hpctrain-r{r}.json").write_text(json.dumps(fresh))
        (tmp_path / f"ckpt_io-fresh-dcp-r{r}.json").write_text(json.dumps(_ckpt_doc([("dcp", [dcp], [0.6])])))
    (tmp_path / "ckpt_io-trained-2.json").write_text(json.dumps(_ckpt_doc([
        ("hpctrain", [0.9, 1.0, 1.1], [0.7, 0.8, 0.9]), ("dcp", [1.0, 1.1, 1.2], [0.6, 0.6, 0.7]),
        ("raw_shared", [0.6, 0.7], []), ("raw_per_rank", [0.5, 0.5], [])])))
    entry = lambda name, ok: {"name": name, "rc": 0, "seconds": 5.0, "conditions": _cond(),  # noqa: E731
                              "publishable": ok, "why_not": "" if ok else "load 3.0 > 2 cores before the launch"}
    (tmp_path / "launches.json").write_text(json.dumps({"launches": [
        entry(p.stem, p.stem != "ckpt_io-trained-2") for p in tmp_path.glob("ckpt_io-*.json")]}))
    table = render(str(tmp_path))
    assert "| fresh process (one save and load per launch, as after a relaunch) | 3 + 3 | 1.30 | 1.20-1.40 | 1.00 " \
        in table
    assert "one shared file (hpctrain's layout) 0.65 s (0.60-0.70), into a file of its own (DCP's) 0.50 s" in table
    assert targets(table) == {
        "checkpoint save <= DCP (fresh process)": ("1.30", "MISSED"),
        "checkpoint load <= DCP (fresh process)": ("0.83", "met"),
        # a busy launch publishes no verdict
        "checkpoint save <= DCP (trained first)": ("0.91", "unpublished"),
        "checkpoint load <= DCP (trained first)": ("1.33", "unpublished"),
    }


def _step_doc(impl, step, local):
    return {"benchmark": "train_step", "ranks": 2, "results": {
        "impl": impl, "compression": "none", "model": "large", "parameters": 1e6, "tensors": 4,
        "grad_bytes": 4e6, "batch_per_rank": 4, "step_s": step, "local_step_s": local,
        "step_over_local": step / local, "exposed_comm_s": step - local, "sync_s": 0.01,
        "sync_over_fused": None if impl == "ddp" else 1.0, "fused_allreduce_s": 0.01}}


def test_alternated_rounds_give_median_and_spread(tmp_path):
    from report import render

    # Round r: DDP 100 ms, mpi (90, 120, 100) ms; local steps equal, so normalised = direct.
    for r, mpi in enumerate((0.09, 0.12, 0.10)):
        suffix = f"-r{r}" if r else ""
        (tmp_path / f"train_step-large-ddp-none-2{suffix}.json").write_text(json.dumps(_step_doc("ddp", 0.1, 0.05)))
        (tmp_path / f"train_step-large-mpi-none-2{suffix}.json").write_text(json.dumps(_step_doc("mpi", mpi, 0.05)))
    table = render(str(tmp_path))
    assert "With 3 rounds" in table
    row = next(line for line in table.splitlines() if line.startswith("| mpi none |"))
    assert "| 1.00 | 1.00 | 0.90-1.20 |" in row
    assert targets(table) == {"step mpi none, large model, <= DDP (normalised)": ("1.00", "met")}


def test_horovods_own_cycle_and_spinning_waits_are_rows_of_their_own(tmp_path):
    from report import render

    for r in range(2):
        suffix = f"-r{r}" if r else ""
        (tmp_path / f"train_step-large-ddp-none-2{suffix}.json").write_text(json.dumps(_step_doc("ddp", 0.1, 0.05)))
        hpctrain_default = _step_doc("horovod", 0.09, 0.05)
        hpctrain_default["results"]["cycle_asked_ms"] = None
        horovods = _step_doc("horovod", 0.11, 0.05)
        horovods["results"]["cycle_asked_ms"] = 1.0
        (tmp_path / f"train_step-large-horovod-none-2{suffix}.json").write_text(json.dumps(hpctrain_default))
        (tmp_path / f"train_step-large-horovod-cycle1-2{suffix}.json").write_text(json.dumps(horovods))
        spinning = _step_doc("horovod", 0.16, 0.15)
        spinning["results"].update(mpi_waits_asked="spin", mpi_yield_when_idle="0")
        (tmp_path / f"train_step-large-horovod-spin-2{suffix}.json").write_text(json.dumps(spinning))
    table = render(str(tmp_path))
    rows = {}
    for line in table.splitlines():  # the training-step table comes first
        if line.startswith("| horovod none"):
            rows.setdefault(line.split(" |")[0], line)
    assert "| 0.90 | 0.90 | 0.90-0.90 |" in rows["| horovod none"]  # x DDP, normalised, spread
    assert "| 1.10 | 1.10 | 1.10-1.10 |" in rows["| horovod none 1 ms cycle"]
    # Open MPI's spinning waits: 1.6x DDP's step; normalised by its own slowed local step, 0.53.
    assert "| 160 | 1.60 | 0.53 | 0.53-0.53 |" in rows["| horovod none MPI waits spin"]


@pytest.mark.mpi
def test_recipes_variants_and_their_section(tmp_path):
    """Two of benchmarks/recipes.py's variants at a few steps: each a process of its own, and the report's rows."""
    import recipes

    docs = {}
    for variant in ("data-inline", "data-workers"):
        out = tmp_path / f"recipes-{variant}.json"
        run(1, "recipes.py", "--variant", variant, "--steps", "4", "--out", out)
        docs[out.stem] = json.loads(out.read_text())
        assert docs[out.stem]["steps"] == 4 and len(docs[out.stem]["step_s"]) == 2
        assert docs[out.stem]["peak_rss_mib"] > 100 and docs[out.stem]["cost_per_sample_s"] == 0.001
    lines = "\n".join(recipes.section(docs))
    assert re.search(r"\| data-workers \| [\d.]+ \([\d.]+-[\d.]+\) \| - \|", lines), lines  # no data-memory: no ratio
    assert "| data-memory | - |" in lines
