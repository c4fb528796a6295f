"""Effective training time ratio (ETTR) under failures: ``hpctrain launch -n 2`` trains for M minutes while a
random rank is SIGKILLed every T seconds (each wait drawn uniformly from [T/2, 3T/2]); uninterrupted runs
of the same length, in the same command, are the reference: by default one before the first run with failures,
one between every two and one after the last, and each run is measured against the mean of the two beside it
(the throughput of this machine drifts from one run to the next by more than a few failures cost, 18% between
two references 40 minutes apart; a drift over a run cancels in the mean of its neighbours). ETTR against every
reference's mean and against each neighbour is reported too.

    python benchmarks/ettr.py [--minutes 4] [--every 60,120] [--configs defaults,no-local]
                              [--references between|2|1] [--out DIR]

ETTR = steps kept / steps the uninterrupted run made in the same wall time; "own rate": steps kept / (the run's
own steps per second while it trained, from its logged intervals, x its wall time). Each run starts from nothing
(its first start-up counts, as in the reference) and is stopped after M minutes with SIGUSR1 (hpctrain's stop:
the ranks save and exit); steps kept are the step of that last checkpoint. Per failure: the restart's cost
from the last step before it to the first after it, part by part (``hpctrain report``'s breakdown: the steps
trained between the logged steps around it left out; the time between those logged steps beside it), and the
steps computed again. Configurations: ``defaults`` (what a user gets: a checkpoint per epoch of 1024
steps, node-local snapshots between them at an interval hpctrain chooses (``checkpoint.local = "auto"``), a warm
spare set), ``no-local`` (``checkpoint.local = false``: the files alone), ``local`` (``checkpoint.local = true``),
``cold`` and ``cold-local`` (``--spares 0``: every relaunch starts its ranks). The model: an MLP of
0.56M parameters on the generated teacher data (65536 samples, global batch 64). The load average is recorded
before and after each run; run nothing else meanwhile.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from run_all import mpi_env  # noqa: E402

from hpctrain.checkpoint.directory import read_latest  # noqa: E402
from hpctrain.checkpoint.content.format import parse_step  # noqa: E402
from hpctrain.monitoring.report import restart_costs, restart_events  # noqa: E402

MODEL = ["model.in_features=64", "model.hidden=512", "model.depth=3", "model.num_classes=10",
         "data.generate=teacher", "data.val=none", "train.max_steps=1000000000", "train.epochs=100000",
         "monitor.progress=log", "monitor.log_every=20"]
AFTER = 10.0  # seconds after a restart's first logged step in which its training is compared with the run's
# name: (options of hpctrain launch, overrides)
CONFIGS = {"defaults": ([], []), "no-local": ([], ["checkpoint.local=false"]),
           "local": ([], ["checkpoint.local=true"]), "cold": (["--spares", "0"], []),
           "cold-local": (["--spares", "0"], ["checkpoint.local=true"])}


def _idle_spare(pid):
    """Whether ``pid`` is a warm spare rank not called yet (killing it is no failure of the training)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return True
    call = env.get(b"HPCTRAIN_SPARE_CALL")
    return call is not None and not os.path.exists(call)


def rank_pids(run_dir):
    """The training ranks of the run in ``run_dir`` (python processes of ``hpctrain train``, not mpirun, the
    supervisor or a warm spare waiting for its call)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if (f"run.run_dir={run_dir}" in text and " train " in f" {text} " and "launch" not in text
                and not os.path.basename(argv[0].decode(errors="replace")).startswith(("mpirun", "orted", "prterun"))):
            pids.append(int(entry))
    return [p for p in pids if not _idle_spare(p)]


def final_step(run_dir):
    name = read_latest(os.path.join(run_dir, "checkpoints"))
    return 0 if name is None else parse_step(name)


def one_run(name, config, minutes, every, out, data):
    run_dir = os.path.join(out, name)
    options, overrides = CONFIGS[config]
    cmd = [os.path.join(ROOT, ".venv", "bin", "hpctrain"), "launch", "-n", "2", "--max-restarts", "1000", *options,
           os.path.join(ROOT, "examples", "digits.toml"), f"data.path={data}", f"run.run_dir={run_dir}",
           *MODEL, *overrides]
    load_before = os.getloadavg()
    log = open(os.path.join(out, f"{name}.log"), "w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=mpi_env(), cwd=ROOT)
    rng, kills = random.Random(f"{name}"), []
    end = started + minutes * 60
    next_kill = started + (rng.uniform(every / 2, 3 * every / 2) if every else float("inf"))
    while time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        if time.monotonic() >= next_kill:
            pids = rank_pids(run_dir)
            if pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                kills.append(round(time.monotonic() - started, 1))
            next_kill = time.monotonic() + rng.uniform(every / 2, 3 * every / 2)
    proc.send_signal(signal.SIGUSR1)  # stop: the ranks save and exit 3
    try:
        code = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "timeout"
    wall = time.monotonic() - started
    log.close()
    records = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        records = [json.loads(line) for line in open(path) if line.strip()]
    restarts = restart_events(records)  # steps lost counted from the step each relaunch resumed
    train = [r for r in records if r.get("kind") == "train" and r.get("steps") and r.get("step_time")]
    # the run's own rate while it trained (its logged intervals: start-ups and failures left out), and the same
    # away from restarts (the AFTER seconds after each: a slower start there is a failure's cost)
    own_rate, restarted = _rate(train), _restarted_at(records, train)
    steady = [r for r in train if not any(0 <= r["timestamp"] - t <= AFTER for t in restarted)]
    return {"name": name, "config": config, "every_s": every, "minutes": minutes, "exit": code,
            "wall_s": round(wall, 1), "steps": final_step(run_dir), "kills_at_s": kills,
            "own_rate": own_rate, "steady_rate": _rate(steady), "restarts": len(restarts), "steps_lost": [r.get("steps_lost") for r in restarts],
            "restart_costs": restart_costs(records), "after_restart": _after_restart(train, restarted),
            "load_before": load_before, "load_after": os.getloadavg()}


def summary(run, references, neighbours):
    """The figures of ``run`` against ``neighbours`` (the references run beside it) and all ``references``."""
    costs = [c["total"] for c in run["restart_costs"] if c["total"] is not None]
    logged = [c["logged"] for c in run["restart_costs"] if c.get("logged") is not None]
    parts = {}
    for c in run["restart_costs"]:
        for k, v in c["parts"].items():
            parts.setdefault(k, []).append(v)
    spread = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"  # noqa: E731
    lost = [s for s in run["steps_lost"] if isinstance(s, (int, float))]
    made = [r["steps"] for r in neighbours if r["steps"]]
    made_all = [r["steps"] for r in references if r["steps"]]
    own, steady = _own(run), _own(run, "steady_rate")
    # what an uninterrupted run keeps of its own rate (its start-up and final save), from the references beside it
    kept = [_own(r) for r in neighbours if _own(r)]
    return {"ettr": round(run["steps"] / statistics.mean(made), 3) if made else None,
            "ettr_each": [round(run["steps"] / m, 3) for m in made],
            "ettr_all_references": round(run["steps"] / statistics.mean(made_all), 3) if made_all else None,
            "ettr_own": round(own, 3) if own else None,
            "ettr_same_rate": round(steady / statistics.mean(kept), 3) if steady and kept else None,
            "after_restart_lost_s": run.get("after_restart", "-"),
            "restart_s": spread(costs), "logged_gap_s": spread(logged), "parts_s": {k: spread(v) for k, v in parts.items()},
            "steps_lost": spread(lost), "steps_lost_total": sum(lost)}


def _rate(train):
    """Steps per second over logged intervals ``train``, or None."""
    return sum(r["steps"] for r in train) / sum(r["steps"] * r["step_time"] for r in train) if train else None


def _own(run, rate="own_rate"):
    """Steps kept / (the run's own steps per second while it trained (``rate``) x its wall time)."""
    return run["steps"] / (run[rate] * run["wall_s"]) if run.get(rate) else None


def _restarted_at(records, train):
    """When each relaunch logged its first step."""
    starts = [r["timestamp"] for r in records if r.get("kind") == "start" and r.get("step")]
    return [next(r["timestamp"] for r in train if r["timestamp"] > t) for t in starts
            if any(r["timestamp"] > t for r in train)]


def _after_restart(train, restarted):
    """Seconds of training lost in the :data:`AFTER` seconds after each restart's first logged step (``restarted``),
    against the run's median rate over its logged intervals ``train``: median and range, or "-". A relaunch that
    trains slower than the run would show here, where the rates of whole runs (which it lowers too) do not."""
    if not train:
        return "-"
    median = statistics.median(1 / r["step_time"] for r in train)
    lost = []
    for first in restarted:
        if train[-1]["timestamp"] < first + AFTER:
            continue  # too near the end to have the whole window
        inside = [r for r in train if first < r["timestamp"] <= first + AFTER]
        lost.append(sum(r["steps"] * r["step_time"] for r in inside) - sum(r["steps"] for r in inside) / median)
    return f"{statistics.median(lost):.2f} ({min(lost):.2f} to {max(lost):.2f})" if lost else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--every", default="60,120", help="seconds between kills (mean), comma-separated")
    ap.add_argument("--configs", default="defaults,no-local")
    ap.add_argument("--references", choices=("between", "2", "1"), default="between",
                    help="uninterrupted runs: before, between and after the others (default); 2: before and after "
                         "them; 1: before them")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-results", time.strftime("ettr-%Y%m%d-%H%M%S")))
    args = ap.parse_args(argv)
    # absolute: the ranks' command lines have the run directories so (rank_pids), and the runs start in ROOT
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "teacher.h5")
    subprocess.run([sys.executable, "-c", "import sys; from hpctrain.config import load_config; "
                    "from hpctrain.data import generate; c = load_config(sys.argv[1], sys.argv[2:]); "
                    "generate(c.data, c.model, seed=c.run.seed)", os.path.join(ROOT, "examples", "digits.toml"),
                    f"data.path={data}", *MODEL], check=True, cwd=ROOT, env=mpi_env())
    runs = [(f"{config}-every{int(every)}s", config, every)
            for every in [float(e) for e in args.every.split(",")] for config in args.configs.split(",")]
    order = ["reference-1"]  # the runs in the order they are made; each run's neighbours are the references beside it
    for i, (name, _, _) in enumerate(runs):
        order.append(name)
        if args.references == "between" or (args.references == "2" and i == len(runs) - 1):
            order.append(f"reference-{len([o for o in order if o.startswith('reference')]) + 1}")
    settings = {name: (config, every) for name, config, every in runs}
    results = {}
    for name in order:
        config, every = settings.get(name, ("defaults", 0))
        results[name] = one_run(name, config, args.minutes, every, args.out, data)
        print(json.dumps(results[name]), flush=True)
    references = [results[k] for k in order if k.startswith("reference")]
    for i, name in enumerate(order):
        if name in settings:
            beside = ([results[k] for k in order[i - 1:i + 2] if k.startswith("reference")]
                      if args.references == "between" else references)
            results[name]["summary"] = summary(results[name], references, beside)
    with open(os.path.join(args.out, "ettr.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    for ref in references:
        print(f"{ref['name']}: {ref['steps']} steps in {ref['wall_s']} s uninterrupted "
              f"(load {ref['load_before'][0]:.2f} -> {ref['load_after'][0]:.2f}); against its own rate while "
              f"training {summary(ref, [ref], [ref])['ettr_own']}")
    print("| run | ETTR (the references beside it: mean; each) | ETTR, every reference's mean | ETTR, own rate | "
          "ETTR, own rate / the references' | kills | restarts | "
          "restart s, median (min-max) | between the logged steps around it, s | steps lost per restart | "
          "training lost in the 10 s after a restart, s | load before/after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, run in results.items():
        if name not in settings:
            continue
        s = run["summary"]
        print(f"| {name} | {s['ettr']}; {', '.join(map(str, s['ettr_each']))} | {s['ettr_all_references']} | "
              f"{s['ettr_own']} | "
              f"{s['ettr_same_rate']} | {len(run['kills_at_s'])} | {run['restarts']} | {s['restart_s']} | "
              f"{s['logged_gap_s']} | {s['steps_lost']} | {s['after_restart_lost_s']} | {run['load_before'][0]:.2f} / {run['load_after'][0]:.2f} |")
        print(f"|   parts | {s['parts_s']} |")
    print(f"results: {args.out}/ettr.json")
    unkilled = [name for name in settings if settings[name][1] and not results[name]["kills_at_s"]]
    if unkilled:  # its figures are an uninterrupted run's, not the failures'
        sys.exit(f"no rank of {', '.join(unkilled)} was found to kill: its figures are not a run with failures")


if __name__ == "__main__":
    main()
