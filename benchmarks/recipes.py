"""What data workers, ``train.compile`` and ``train.activation_checkpointing`` change, each variant in a process
of its own (``make bench``; the peak resident memory is a process's own), run by benchmarks/run_all.py in
alternated rounds so that a change in the machine's load hits every variant alike.

    mpirun -n 1 python benchmarks/recipes.py --variant VARIANT --out results.json [--steps N]

Data (an MLP step, a map-style dataset whose ``__getitem__`` spends 1 ms of CPU per sample, as decoding and
augmenting an image does): ``data-memory`` (the same samples without the cost: the data already in memory),
``data-inline`` (``data.workers = 0``: read between steps, as before), ``data-workers`` (``data.workers = 2``).
Model (a GPT-2 from its configuration, 6 layers, 4 samples of 256 tokens a step, the model's own loss): ``gpt-eager``,
``gpt-compile`` (``train.compile``: the first step, which compiles, is reported apart), ``gpt-recompute``
(``train.activation_checkpointing``). Writes the median step time of the timed steps, each step's time, the
first step's time and the peak resident memory of the process.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

from common import init

VARIANTS = ("data-memory", "data-inline", "data-workers", "gpt-eager", "gpt-compile", "gpt-recompute")
COST = 0.001  # seconds of CPU per sample read


class Decoded:
    """A map-style dataset of (x, label) whose every read spends ``cost`` seconds of CPU."""

    def __init__(self, n, features, cost):
        import numpy as np

        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, features)).astype("float32")
        self.y = rng.integers(0, 10, n)
        self.cost = cost

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.cost:
            until = time.thread_time() + self.cost
            while time.thread_time() < until:  # CPU, as a decoder spends it (not a sleep)
                pass
        return self.x[i], int(self.y[i])


class StepTimes:
    def __init__(self):
        self.ends = [time.perf_counter()]

    def on_step(self, state, metrics, phase_times):
        self.ends.append(time.perf_counter())


def config(variant, work, steps):
    base = {"run": {"run_dir": f"{work}/run"}, "checkpoint": {"on_epoch_end": False, "on_finish": False},
            "monitor": {"progress": "off"}, "train": {"max_steps": steps, "optimizer": "adamw", "lr": 1e-3}}
    if variant.startswith("data-"):
        base["model"] = {"name": "mlp", "in_features": 512, "hidden": 2048, "depth": 3, "num_classes": 10}
        base["train"].update(batch_size=32)
        base["data"] = {"workers": 2 if variant == "data-workers" else 0}
    else:
        base["model"] = {"factory": "hpctrain.models.huggingface:from_config",
                         "kwargs": {"architecture": "GPT2LMHeadModel", "vocab_size": 256, "n_positions": 256,
                                    "n_embd": 128, "n_layer": 6, "n_head": 4}}
        base["data"] = {"kind": "tokens", "path": f"{work}/train.bin", "block_size": 256}
        base["train"].update(batch_size=4, loss="model", compile=variant == "gpt-compile",
                             activation_checkpointing=variant == "gpt-recompute")
    return base


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    world = init()
    import numpy as np

    from hpctrain import Trainer, TrainConfig
    from hpctrain.runtime.system import usable_cpus

    work = tempfile.mkdtemp(prefix="hpctrain-recipes-")
    data = None
    if args.variant.startswith("data-"):
        data = Decoded(32 * (args.steps + 2), 512, 0.0 if args.variant == "data-memory" else COST)
    else:
        np.random.default_rng(0).integers(0, 256, 4 * 257 * (args.steps + 2)).astype(np.uint16).tofile(
            f"{work}/train.bin")
    cfg = TrainConfig.from_dict(config(args.variant, work, args.steps))
    times = StepTimes()
    Trainer(cfg, train_data=data, world=world, callbacks=[times], checkpoints=None).fit()
    steps = np.diff(times.ends).tolist()
    timed = steps[2:]  # the first two: start-up, compilation, workers' first batches
    doc = {"variant": args.variant, "steps": len(steps), "step_s_median": statistics.median(timed),
           "step_s": [round(s, 5) for s in timed], "first_step_s": steps[0],
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "cost_per_sample_s": COST if args.variant in ("data-inline", "data-workers") else 0.0,
           "cores": usable_cpus(), "load_avg": list(os.getloadavg())}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "step_s"}))


def section(docs):
    """The report's lines: each variant's median step time over the rounds (min-max), and the ratios."""
    by = {}
    for name, doc in docs.items():
        if name.startswith("recipes-"):  # a data variant launched unbound is a row of its own
            cores = doc.get("cores", 1)
            by.setdefault(doc["variant"] + (f", {cores} cores" if cores > 1 else ""), []).append(doc)
    if not by:
        return []

    def row(variant, against=None):
        runs = by.get(variant, [])
        if not runs:
            return f"| {variant} | - | - | - | - |"
        med = [r["step_s_median"] * 1e3 for r in runs]
        ratio = "-"
        if against and by.get(against):
            base = statistics.median(r["step_s_median"] for r in by[against])
            ratios = [r["step_s_median"] / base for r in runs]
            ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        return (f"| {variant} | {statistics.median(med):.1f} ({min(med):.1f}-{max(med):.1f}) | {ratio} | {rss:.0f} | "
                f"{statistics.median(r['first_step_s'] for r in runs):.2f} |")

    def data_rows(suffix):
        return [row("data-memory" + suffix), row("data-inline" + suffix, "data-memory" + suffix),
                row("data-workers" + suffix, "data-memory" + suffix)]

    loads = sorted({round(r["load_avg"][0], 2) for runs in by.values() for r in runs})
    return ["", "## Data workers, compile, activation checkpointing (benchmarks/recipes.py)", "",
            f"Median step time over {max(len(v) for v in by.values())} rounds (min-max of the rounds' medians); "
            f"1-minute load average at the launches' ends: {loads[0]}-{loads[-1]}.", "",
            "| variant | step ms | ratio | peak RSS MiB | first step s |", "|---|---|---|---|---|",
            *data_rows(""),
            *[r for c in sorted({k.split(", ", 1)[1] for k in by if ", " in k}) for r in data_rows(f", {c}")],
            row("gpt-eager"), row("gpt-compile", "gpt-eager"), row("gpt-recompute", "gpt-eager")]


if __name__ == "__main__":
    sys.exit(main())
