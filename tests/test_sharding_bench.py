"""Smoke run of benchmarks/zero_memory.py at a tiny size under a real mpirun: it writes the
fields docs/sharding.md quotes, and its tensor accounting shows the optimizer state per rank
halved on 2 ranks by sharding. Not a test of speed."""
import json

import pytest

from mpi_harness import ROOT, mpirun

pytestmark = [pytest.mark.mpi]


def run(tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    mpirun(2, [ROOT / "benchmarks" / "zero_memory.py", "--mode", mode, "--backend", "mpi", "--widths", "64",
               "--steps", "1", "--warmup", "1", "--batch", "8", "--limit-mib", "4096", "--out", out],
           timeout=180, check=True)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "zero_memory" and doc["ranks"] == 2
    (row,) = doc["results"]
    assert row["mode"] == mode and row["fits"] is True and row["step_s"] > 0
    assert row["replicated_bytes"] == 16 * row["params"] and row["param_bytes"] == 4 * row["params"]
    return row


def test_zero_memory_accounts_the_state_each_rank_holds(tmp_path):
    replicated, sharded = run(tmp_path, "none"), run(tmp_path, "gradients")
    assert 0 <= replicated["state_bytes"] - 8 * replicated["params"] <= 4 * 64  # + a 4-byte step per tensor
    # half of AdamW's two moments per rank, to within one row of a slice; and only the slice's gradients
    assert abs(sharded["state_bytes"] - 4 * sharded["params"]) <= 8 * 64 + 64
    assert sharded["grad_bytes"] < replicated["grad_bytes"] * 0.6
    assert sharded["held_vs_replicated"] < 0.7


def test_report_section_gives_the_targets_verdicts():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zero_memory

    def doc(mode, step_s, state):
        return {"ranks": 4, "params": {}, "results": [{
            "mode": mode, "hidden": 64, "params": 1000, "held_bytes": 1, "held_vs_replicated": 1.0,
            "state_bytes": state, "peak_rss_extra_bytes": 1, "step_s": step_s}]}

    verdicts = []
    lines = zero_memory.section({"zero_memory-none-4": doc("none", 1.0, 8000),
                                 "zero_memory-optimizer-4": doc("optimizer", 1.08, 2000)}, verdicts)
    assert any("zero_memory-optimizer-4 | 4 | 64 | 1,000" in line for line in lines)
    assert [v[2] for v in verdicts] == ["met", "met"]
    verdicts = []
    zero_memory.section({"zero_memory-none-4": doc("none", 1.0, 8000),
                         "zero_memory-optimizer-4": doc("optimizer", 1.2, 4000)}, verdicts)
    assert [v[2] for v in verdicts] == ["MISSED", "MISSED"]


def test_interleaved_launch_alternates_the_modes_and_its_ratio_gives_the_verdict(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zero_memory

    out = tmp_path / "steps.json"
    mpirun(2, [ROOT / "benchmarks" / "zero_memory.py", "--interleave", "none", "optimizer", "--rounds", "2",
               "--backend", "mpi", "--widths", "64", "--steps", "1", "--warmup", "1", "--batch", "8", "--out", out],
           timeout=180, check=True)
    doc = json.loads(out.read_text())
    assert [(r["round"], r["mode"]) for r in doc["results"]] == [(0, "none"), (0, "optimizer"), (1, "none"), (1, "optimizer")]
    for r, step in zip(doc["results"], (1.0, 1.5, 2.0, 2.0)):  # ratios 1.5 and 1.0: median 1.25
        r["step_s"] = step
    assert zero_memory.interleaved_ratios(doc["results"]) == {"optimizer": [1.5, 1.0]}
    verdicts = []
    lines = zero_memory.section({"zero_memory-steps-2": doc}, verdicts)
    assert any("| optimizer | " in line and "| 1.25 | 1.00-1.50 |" in line for line in lines), lines
    assert verdicts == [("comm.shard=optimizer step time <= 1.10x replicated, 2 ranks (interleaved, median of rounds)",
                         1.25, "MISSED", ["zero_memory-steps-2"])]
