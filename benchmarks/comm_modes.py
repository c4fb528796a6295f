"""``comm.mode`` compared: bytes and time per step, validation loss against wall time and
steps, the quality cost of averaging every H steps, and what a slowed rank costs.

    mpirun -n 2 python benchmarks/comm_modes.py --data digits --mode sync --out sync.json
    mpirun -n 2 python benchmarks/comm_modes.py --data teacher --mode local_sgd --sync-every 16 --out l16.json
    mpirun -n 2 python benchmarks/comm_modes.py --data teacher --mode local_sgd --sync-every 16 \\
        --slow one --slow-rank 1 --slow-ms 20 --out l16-slow.json
    python benchmarks/comm_modes.py --table DIR       # the comparison of every comm_modes-*.json in DIR

One launch trains one mode with the trainer itself (``hpctrain.Trainer``), evaluating every
``--eval-every`` steps (a multiple of every ``--sync-every`` compared, so local SGD is scored at
synchronisation points). Launches of one series share the data file and the settings, so
the table compares each mode against ``sync`` of the same series.

``--slow one``: rank ``--slow-rank`` sleeps ``--slow-ms`` in every forward pass (the monitor's
slow-rank rule must name it; the launch records what it named). ``--slow jitter``: at each
step one rank, drawn from the step number, sleeps instead (the same draw on every rank).
Expectation (docs/asynchronous.md): a rank that is slow at every step holds back ``local_sgd``
at each average about as much as ``sync`` at each step; delays that hit different ranks at
different steps cost ``sync`` their sum, ``local_sgd`` closer to their share per rank.

Bytes per step: what this rank hands to the gradient or parameter averages (``sync``: every
gradient once, half with fp16; the other modes count their own collectives).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from common import init, write_result

DATA = {
    # examples/large_mlp.toml's corpus kind, smaller: a fixed random teacher labels Gaussian inputs.
    "teacher": ["model.in_features=256", "model.num_classes=16", "model.residual=true", "model.layer_norm=true",
                "data.generate=teacher", "train.optimizer=adamw", "train.lr=0.0005", "train.weight_decay=0.01"],
    # examples/digits.toml
    "digits": ["model.in_features=64", "model.num_classes=10", "data.generate=digits", "train.optimizer=sgd",
               "train.lr=0.1", "train.momentum=0.9"],
}


class Record:
    """Every step's end time and every evaluation's (step, seconds, val_loss)."""

    def __init__(self):
        self.t0 = None
        self.ends, self.curve = [], []
        self.step = 0

    def on_step(self, state, metrics, phase_times):
        self.ends.append(time.perf_counter())
        self.step = state.progress.step

    def on_eval(self, state, metrics):
        self.curve.append([state.progress.step, time.perf_counter() - self.t0, metrics["val_loss"]])


def slow_hook(args, world, record):
    """A forward pre-hook that sleeps on the slowed rank (``one``) or the step's drawn rank (``jitter``)."""
    def hook(module, inputs):
        if not module.training:
            return
        if record.t0 is None:
            record.t0 = time.perf_counter()  # the clock starts with the first step, not the set-up
        if args.slow == "none":
            return
        if args.slow == "one":
            slow = world.rank == args.slow_rank
        else:
            slow = int(np.random.default_rng(record.step).integers(world.size)) == world.rank
        if slow:
            time.sleep(args.slow_ms / 1000.0)
    return hook


def slow_ranks_named(run_dir):
    """The ranks the monitor's slow-rank rule named in ``metrics.jsonl`` (rank 0)."""
    named = set()
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("kind") == "slow_rank" and "rank" in rec:
                    named.add(int(rec["rank"]))
    except OSError:
        pass
    return sorted(named)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", choices=sorted(DATA), default="digits")
    p.add_argument("--mode", choices=("sync", "local_sgd", "stale"), default="sync")
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--outer", choices=("none", "nesterov"), default="none")
    p.add_argument("--backend", default="horovod")
    p.add_argument("--compression", default="none")
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--samples", type=int, default=32768, help="teacher corpus: training samples")
    p.add_argument("--slow", choices=("none", "one", "jitter"), default="none")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--data-dir", default=None, help="where the series' data files are (default: next to --out)")
    p.add_argument("--out")
    p.add_argument("--table", metavar="DIR", help="print the comparison of the launches in DIR, and exit")
    args = p.parse_args()
    if args.table:
        print(table(args.table))
        return 0

    from hpctrain import Trainer, load_config
    from hpctrain.models import count_parameters

    world = init()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    data_dir = args.data_dir or os.path.join(out_dir, "data")
    data_file = os.path.join(data_dir, f"{args.data}-{args.samples}.h5")
    overrides = DATA[args.data] + [
        f"data.path={data_file}", f"data.samples={args.samples}", "data.val_samples=1024",
        f"model.hidden={args.hidden}" if args.data == "teacher" else "model.hidden=128",
        f"model.depth={args.depth}" if args.data == "teacher" else "model.depth=1",
        f"train.batch_size={args.batch}", "train.epochs=1000", f"train.max_steps={args.steps}",
        f"train.eval_every={args.eval_every}", f"comm.backend={args.backend}",
        f"comm.compression={args.compression}", f"comm.mode={args.mode}",
        f"run.root={os.path.join(out_dir, 'runs')}", f"run.name=comm_modes-{args.mode}",
        "monitor.progress=off", "monitor.log_every=16", "monitor.gather_every=4",
        "checkpoint.on_epoch_end=false", "checkpoint.on_finish=false",
    ]
    if args.mode == "local_sgd":
        overrides += [f"comm.sync_every={args.sync_every}", f"comm.outer_optimizer={args.outer}"]
        if args.outer == "nesterov":
            overrides += ["comm.outer_lr=0.7", "comm.outer_momentum=0.9"]
    cfg = load_config(None, overrides)
    record = Record()
    trainer = Trainer(cfg, world=world, checkpoints=None, callbacks=[record])
    # The hook goes on the model before fit() builds the run: made here, as fit() would.
    import torch

    from hpctrain.models import build_model

    torch.manual_seed(cfg.run.seed)
    trainer.model = build_model(cfg.model)
    trainer.model.register_forward_pre_hook(slow_hook(args, world, record))
    result = trainer.fit()
    wall = record.ends[-1] - record.t0  # the first step's start to the last step's end
    mode = trainer.state.comm_mode
    params, _ = count_parameters(trainer.state.model)
    steps = result.steps
    if args.mode == "sync":
        sent = params * (2 if args.compression == "fp16" else 4) * steps
    else:
        sent = mode.sent_bytes
    deltas = np.diff(record.ends)[len(record.ends) // 8:]  # after the first eighth: warm
    results = {
        "data": args.data, "mode": args.mode,
        "sync_every": args.sync_every if args.mode == "local_sgd" else None,
        "outer": args.outer if args.mode == "local_sgd" else None, "backend": args.backend,
        "compression": args.compression, "steps": steps, "wall_s": wall, "parameters": params,
        # the mean, not the median: local SGD waits only at its averages
        "step_time_mean_s": float(np.mean(deltas)) if len(deltas) else None,
        "step_time_median_s": float(statistics.median(deltas)) if len(deltas) else None,
        "bytes_per_step": sent / max(steps, 1), "curve": record.curve,
        "final_val_loss": result.metrics.get("val_loss"), "slow": args.slow,
        "slow_rank": args.slow_rank if args.slow == "one" else None, "slow_ms": args.slow_ms,
        "slow_ranks_named": slow_ranks_named(result.run_dir) if world.rank == 0 else None,
    }
    write_result(world, args.out, "comm_modes", vars(args), [results])
    if world.rank == 0:
        print(f"comm_modes {args.data} {args.mode} H={results['sync_every']} slow={args.slow}: "
              f"{results['step_time_mean_s']:.4f} s/step, {results['bytes_per_step'] / 2 ** 20:.2f} MiB/step, "
              f"val_loss {results['final_val_loss']:.4f}, wall {wall:.1f} s", flush=True)
    return 0


# ---------------------------------------------------------------- the table

def _label(r):
    if r["mode"] == "local_sgd":
        return f"local_sgd H={r['sync_every']}" + (" nesterov" if r["outer"] == "nesterov" else "")
    return r["mode"]


def _reach(curve, target, index):
    """The steps (index 0) or seconds (index 1) at which val_loss first reached ``target``."""
    return next((point[index] for point in curve if point[2] <= target), None)


def section(directory):
    """The report's section (benchmarks/report.py), or nothing when the series has no launch of this kind."""
    if not any(n.startswith("comm_modes-") and n.endswith(".json") for n in os.listdir(directory)):
        return []
    return ["", "## Communication modes (comm.mode)", "",
            "Target: 2% above the final val loss of `sync` in the same series. Wall time from the first step's "
            "start to the last step's end; \"wall vs unslowed\": against the same mode without the slowed rank.",
            "", table(directory)]


def table(directory):
    rows = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("comm_modes-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                rows += json.load(f)["results"]
    lines = ["| data | mode | slowed | s/step | MiB/step | final val loss | steps to target | s to target | "
             "wall s | wall vs unslowed | ranks named slow |", "|" + "---|" * 11]
    for data in sorted({r["data"] for r in rows}):
        series = [r for r in rows if r["data"] == data]
        sync = next((r for r in series if r["mode"] == "sync" and r["slow"] == "none"), None)
        # The target: 2% above the loss sync reached, so every mode is measured against it.
        target = sync["final_val_loss"] * 1.02 if sync and sync["final_val_loss"] is not None else None
        for r in series:
            base = next((b for b in series if b["slow"] == "none" and _label(b) == _label(r)), None)
            ratio = r["wall_s"] / base["wall_s"] if base and r["slow"] != "none" else None
            cells = [data, _label(r), r["slow"] if r["slow"] == "none" else f"{r['slow']} {r['slow_ms']:g} ms",
                     f"{r['step_time_mean_s']:.4f}" if r["step_time_mean_s"] else "-",
                     f"{r['bytes_per_step'] / 2 ** 20:.3f}", f"{r['final_val_loss']:.4f}",
                     str(_reach(r["curve"], target, 0) or "-") if target else "-",
                     f"{_reach(r['curve'], target, 1):.1f}" if target and _reach(r["curve"], target, 1) else "-",
                     f"{r['wall_s']:.1f}", f"{ratio:.2f}" if ratio else "-",
                     ",".join(map(str, r.get("slow_ranks_named") or [])) or "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
