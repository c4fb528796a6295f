"""An example trained as shipped, to the target it states (``make bench``; the suite trains the same example
for a few steps only, tests/test_user_code_mpi.py).

    mpirun -n 2 python benchmarks/example_targets.py --example byte_gpt --out results.json [--max-steps N]

``byte_gpt``: examples/byte_gpt.toml, whose docstring states a validation loss below 1.65 nats per byte after
its 600 steps on 2 ranks. Writes the final validation loss, the target, whether it was reached, the steps and
the seconds of the run (rank 0).
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

from common import ROOT, init

EXAMPLES = {  # name: (configuration, the metric it states a target for, the target: below it)
    "byte_gpt": ("examples/byte_gpt.toml", "val_loss", 1.65),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="byte_gpt")
    parser.add_argument("--max-steps", type=int, default=None, help="fewer steps than shipped (BENCH_QUICK)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    world = init()
    from hpctrain import Trainer, load_config
    from hpctrain.runtime.coordination import on_root

    config, metric, target = EXAMPLES[args.example]
    work = on_root(lambda: tempfile.mkdtemp(prefix="hpctrain-example-"), world.comm)
    overrides = [f"run.run_dir={work}/run", f"data.kwargs.path={work}/data.h5", "monitor.progress=log"]
    if args.max_steps:
        overrides.append(f"train.max_steps={args.max_steps}")
    os.chdir(ROOT)  # the configuration's paths (run.python_path) are relative to the checkout
    cfg = load_config(os.path.join(ROOT, config), overrides)
    t0 = time.perf_counter()
    result = Trainer(cfg, world=world).fit()
    seconds = time.perf_counter() - t0
    reached = result.metrics.get(metric, math.inf)
    doc = {"example": args.example, "config": config, "ranks": world.size, "steps": result.steps,
           "shipped": not args.max_steps, "metric": metric, "value": reached, "target_below": target,
           "reached": reached < target, "seconds": round(seconds, 1)}
    if world.is_root:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"example_targets {args.example}: {metric} {reached:.4f} after {result.steps} steps "
              f"(target < {target}: {'reached' if doc['reached'] else 'NOT reached'}), {seconds:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
