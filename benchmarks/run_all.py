"""Run every benchmark under mpirun and print the table (``make bench``).

    python benchmarks/run_all.py                 # ~30 minutes on 2 cores
    BENCH_QUICK=1 python benchmarks/run_all.py   # ~2 minutes: small sizes, few steps

Results: ``bench-results/<timestamp>/*.json`` (one file per launch), ``table.md`` (what is
printed) and ``launches.json`` (commands, exit codes, seconds, output of failed launches).
Every launch has a timeout; a failed one is reported and the others still run.

Before each launch it waits (up to 90 s) for the 1-minute load to fall below the core count,
and records the load before and after, other processes' CPU use during it and CPU steal
(benchmarks/conditions.py); the report publishes no ratio from a launch that ran on a busy
machine. The training-step launches run in alternated rounds (DDP, Horovod, Horovod fp16,
mpi, then again), and the report gives each ratio's median and min-max over the rounds.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2 ** 20
ROUNDS = 3  # launches of each compared training-step implementation, alternated
FRESH_ROUNDS = 4  # launches of each checkpoint method in fresh processes, alternated

sys.path.insert(0, HERE)
import conditions  # noqa: E402


def mpi_env():
    env = dict(os.environ)
    env.update({
        # As root, and with more ranks than the 2 cores here: Open MPI refuses both unless told.
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "true",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.setdefault("OMP_NUM_THREADS", "1")
    # MPI waits yielding the core: hpctrain sets that in every rank (hpctrain.runtime.world.mpi_defaults),
    # so the launches measure what a user's mpirun gets, not a setting of the bench's own.
    env.pop("OMPI_MCA_mpi_yield_when_idle", None)
    env.setdefault("OMPI_MCA_btl", "self,vader,tcp")
    env.setdefault("OMPI_MCA_btl_tcp_if_include", "lo")
    env.setdefault("OMPI_MCA_oob_tcp_if_include", "lo")
    return env


def plan(quick, out):
    """``[(name, ranks, script args, timeout s)]``."""
    j = lambda name: ["--out", os.path.join(out, f"{name}.json")]  # noqa: E731
    launches = []
    sizes = [256 * 1024 * 4 ** i for i in range(3 if quick else 6)]
    for n in (2, 4):
        for backend in ("mpi", "horovod"):
            name = f"allreduce-{backend}-{n}"
            scale = 0.3 if quick else (1.0 if n == 2 else 0.5)
            launches.append((name, n, ["allreduce.py", "--backend", backend, "--reps-scale", str(scale),
                                       "--sizes", *map(str, sizes)] + j(name), 240 if quick else 420))
    # hpctrain's Horovod cycle (0.2 ms) against Horovod's own 1 ms: the same launch.
    name = "allreduce-horovod-cycle1-2"
    launches.append((name, 2, ["allreduce.py", "--backend", "horovod", "--horovod-cycle-ms", "1", "--reps-scale",
                               "0.3" if quick else "1.0", "--sizes", *map(str, sizes[:4])] + j(name),
                     240 if quick else 420))
    impls = [("ddp", "none"), ("horovod", "none"), ("horovod", "fp16"), ("mpi", "none"), ("horovod", "cycle1"),
             ("horovod", "spin")]
    steps = ["--steps", "4", "--warmup", "2", "--block", "2"] if quick else ["--steps", "20", "--warmup", "4"]
    # DDP and the backends alternate in rounds, so that a change in the machine's load hits
    # each of them alike; the report takes each round's ratio to that round's DDP step.
    for model in (("large",) if quick else ("large", "small")):
        for r in range(1 if quick else ROUNDS):
            for impl, comp in impls:
                if comp in ("cycle1", "spin") and (quick or model != "large"):
                    continue
                # Against hpctrain's defaults in the same rounds: cycle1, Horovod's own 1 ms cycle;
                # spin, Open MPI's own waits (what a rank gets where hpctrain could not set them).
                extra = ["--compression", "none", "--horovod-cycle-ms", "1"] if comp == "cycle1" else \
                    ["--compression", "none", "--mpi-waits", "spin"] if comp == "spin" else ["--compression", comp]
                name = f"train_step-{model}-{impl}-{comp}-2" + (f"-r{r}" if r else "")
                launches.append((name, 2, ["train_step.py", "--impl", impl] + extra
                                 + ["--model", model] + steps + j(name), 240 if quick else 300))
    # Scaling at a fixed per-rank batch; 2 ranks come from the launches above.
    for n in (1, 4):
        for impl in ("horovod",):
            name = f"train_step-large-{impl}-none-{n}"
            launches.append((name, n, ["train_step.py", "--impl", impl, "--model", "large"]
                             + (steps if quick else ["--steps", "12", "--warmup", "3", "--block", "4"])
                             + j(name), 240 if quick else 400))
    ckpt = (["--state-mib", "128", "--reps", "1", "--stall", "--stall-steps", "1", "--stall-reps", "1"] if quick
            else ["--state-mib", "1100", "--reps", "3", "--stall", "--stall-steps", "3", "--stall-reps", "4"])
    launches.append(("ckpt_io-2", 2, ["ckpt_io.py"] + ckpt + j("ckpt_io-2"), 300 if quick else 900))
    launches += ckpt_settings_plan(quick, j)
    # The async stall where the writer has a core to itself: one rank given both cores here
    # (mpirun binds a rank to one core by default when it starts one or two).
    stall = ckpt[ckpt.index("--stall"):]
    if not quick:  # its samples spread 0.08-0.7 s here: the median of 8 says more than that of 4
        stall[stall.index("--stall-reps") + 1] = "8"
    launches.append(("ckpt_io-stall-1", 1, ["--bind-to", "none", "ckpt_io.py", "--methods", "--state-mib", ckpt[1]]
                     + stall
                     + j("ckpt_io-stall-1"), 300 if quick else 600))
    # comm.shard (docs/sharding.md): per-rank memory and step time against replicated AdamW and
    # PyTorch's ZeroRedundancyOptimizer; then the largest width that fits a per-rank limit.
    zero = (["--widths", "64", "--steps", "2", "--warmup", "1", "--batch", "8"] if quick
            else ["--steps", "10", "--warmup", "3"])
    for n in (2, 4):
        for mode in ("none", "optimizer", "gradients", "torch_zero"):
            name = f"zero_memory-{mode}-{n}"
            launches.append((name, n, ["zero_memory.py", "--mode", mode] + zero + j(name), 240 if quick else 600))
        name = f"zero_memory-steps-{n}"  # the step-time ratios: the modes alternated in one launch
        launches.append((name, n, ["zero_memory.py", "--interleave", "none", "optimizer", "gradients", "torch_zero",
                                   "--rounds", "1" if quick else "3"] + zero + j(name), 240 if quick else 900))
    limit = (["--widths", "64", "128", "--limit-mib", "8", "--steps", "1", "--warmup", "1", "--batch", "8"] if quick
             else ["--widths", "1024", "1440", "2048", "2432", "2896", "--limit-mib", "1024", "--steps", "3",
                   "--warmup", "1"])
    for mode in ("none", "optimizer", "gradients"):
        name = f"zero_memory-limit-{mode}-4"
        launches.append((name, 4, ["zero_memory.py", "--mode", mode] + limit + j(name), 240 if quick else 900))
    launches += comm_modes_plan(quick, out, j)
    # Data workers, compile and activation checkpointing: each variant a process of its own, in alternated rounds.
    for r in range(1 if quick else ROUNDS):
        for variant in ("data-memory", "data-inline", "data-workers", "gpt-eager", "gpt-compile", "gpt-recompute"):
            name = f"recipes-{variant}-r{r}"
            launches.append((name, 1, ["recipes.py", "--variant", variant, "--steps", "8" if quick else "30"]
                             + j(name), 300 if quick else 600))
        # Data workers with cores of their own: mpirun binds one rank to one core, which its workers share.
        for variant in ("data-memory", "data-inline", "data-workers"):
            name = f"recipes-{variant}-unbound-r{r}"
            launches.append((name, 1, ["--bind-to", "none", "recipes.py", "--variant", variant, "--steps",
                                       "8" if quick else "30"] + j(name), 300 if quick else 600))
    # The language-model example as shipped, to the validation loss its docstring states (the suite trains
    # it for a few steps only).
    name = "example_targets-byte_gpt-2"
    launches.append((name, 2, ["example_targets.py", "--example", "byte_gpt"] + (["--max-steps", "20"] if quick
                                                                                  else []) + j(name),
                     300 if quick else 1500))
    return launches


def ckpt_settings_plan(quick, j):
    """hpctrain's checkpoint against DCP as a user's process meets it, no memory touched beforehand
    (``--prefault-mib 0``): in fresh processes, one save and load per launch, the two alternating over
    ``FRESH_ROUNDS`` rounds (as after a relaunch); and in one process that trains first (a rollback, or a
    resume after some work), the two interleaved."""
    size = ["--state-mib", "128" if quick else "1100", "--prefault-mib", "0"]
    launches = []
    order = ("hpctrain", "hpctrain_buffered", "hpctrain_direct", "dcp")
    for r in range(1 if quick else FRESH_ROUNDS):
        for method in (order if r % 2 == 0 else order[::-1]):
            name = f"ckpt_io-fresh-{method}-r{r}"
            launches.append((name, 2, ["ckpt_io.py", "--methods", method, "--reps", "1"] + size + j(name),
                             240 if quick else 300))
    trained = ["--train-steps", "2" if quick else "10", "--reps", "1" if quick else "5"]
    # With the floors of the two layouts: plain writes of each rank's share into one file, and into its own.
    launches.append(("ckpt_io-trained-2", 2, ["ckpt_io.py", "--methods", "hpctrain", "hpctrain_buffered",
                                              "hpctrain_direct", "dcp",
                                              "raw_shared", "raw_per_rank"] + size + trained
                     + j("ckpt_io-trained-2"), 300 if quick else 900))
    return launches


def comm_modes_plan(quick, out, j):
    """comm.mode against sync in one series per data set (benchmarks/comm_modes.py): time and bytes
    per step, val loss against wall time and steps, sync_every 4/16/64, and a slowed rank."""
    launches = []
    data_dir = ["--data-dir", os.path.join(out, "comm_modes-data")]
    size = {"digits": [], "teacher": (["--hidden", "64", "--depth", "2", "--samples", "4096"] if quick
                                      else ["--hidden", "512", "--depth", "4", "--samples", "32768"])}
    steps = (["--steps", "64", "--eval-every", "64", "--batch", "16"] if quick
             else ["--steps", "1024", "--eval-every", "64"])
    modes = [("sync", []), ("stale", ["--mode", "stale"])] + [
        (f"local{h}", ["--mode", "local_sgd", "--sync-every", str(h)]) for h in (4, 16, 64)] + [
        ("local16n", ["--mode", "local_sgd", "--sync-every", "16", "--outer", "nesterov"])]
    for data in ("digits", "teacher"):
        for label, mode in modes:
            if quick and data == "teacher" and label not in ("sync", "local16"):
                continue
            name = f"comm_modes-{data}-{label}"
            launches.append((name, 2, ["comm_modes.py", "--data", data, *mode, *size[data], *steps, *data_dir]
                             + j(name), 240 if quick else 900))
    for slow in ("one", "jitter"):  # what a slowed rank costs sync and local SGD
        for label, mode in modes:
            if label in ("sync", "local16"):
                name = f"comm_modes-teacher-{label}-slow-{slow}"
                launches.append((name, 2, ["comm_modes.py", "--data", "teacher", *mode, *size["teacher"], *steps,
                                           "--slow", slow, "--slow-ms", "5" if quick else "20", *data_dir]
                                 + j(name), 240 if quick else 900))
    return launches


def run(name, n, args, timeout, out, log):
    script = next(i for i, a in enumerate(args) if a.endswith(".py"))  # mpirun's own options first
    cmd = ["mpirun", "-n", str(n), "--timeout", str(timeout), *args[:script],
           sys.executable, os.path.join(HERE, args[script])] + args[script + 1:]
    env = mpi_env()
    env["BENCH_OUT"] = out
    waited = conditions.settle()
    before = conditions.snapshot()
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, env=env, cwd=ROOT)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
    seconds = time.time() - t0
    cond = conditions.during(before, conditions.snapshot())
    cond["settle_s"] = waited
    quiet, why = conditions.judge(cond)
    for line in stdout.splitlines():
        if line.startswith(("allreduce", "train_step", "ckpt_io", "comm_modes", "zero_memory", "example_targets",
                            "recipes")):
            print(f"  {line}", flush=True)
    entry = {"name": name, "ranks": n, "command": " ".join(cmd), "rc": rc, "seconds": round(seconds, 1),
             "conditions": cond, "publishable": quiet, "why_not": why}
    print(f"  load {cond['load_before'][0]:.1f} -> {cond['load_after'][0]:.1f}, others "
          f"{cond['foreign_cores']:.2f} cores, steal {100 * cond['steal_fraction']:.0f}%"
          + ("" if quiet else f": NOT PUBLISHABLE ({why})"), flush=True)
    if rc != 0:
        entry["output_tail"] = (stdout + stderr)[-4000:]
        print(f"  {name}: FAILED ({rc}) after {seconds:.0f} s; see launches.json", flush=True)
    log.append(entry)


def main():
    quick = os.environ.get("BENCH_QUICK", "0") not in ("", "0")
    out = os.environ.get("BENCH_DIR") or os.path.join(ROOT, "bench-results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    only = os.environ.get("BENCH_ONLY", "")  # e.g. "allreduce,ckpt": a subset by name prefix
    launches = [x for x in plan(quick, out) if not only or x[0].startswith(tuple(only.split(",")))]
    print(f"bench: {len(launches)} launches{' (quick)' if quick else ''}; results in {out}", flush=True)
    log, t0 = [], time.time()
    for name, n, args, timeout in launches:
        print(f"[{time.time() - t0:5.0f} s] {name} ({n} ranks)", flush=True)
        run(name, n, args, timeout, out, log)
        with open(os.path.join(out, "launches.json"), "w") as f:
            json.dump({"quick": quick, "launches": log, "load_avg_end": os.getloadavg()}, f, indent=1)
    from report import render

    table = render(out)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"bench: {time.time() - t0:.0f} s; results in {out}")
    return 1 if any(e["rc"] != 0 for e in log) else 0


if __name__ == "__main__":
    sys.exit(main())
