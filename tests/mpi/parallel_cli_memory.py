"""Each rank builds only the layers of its pipeline stage: a model larger than the limit
set here for one rank's memory trains on 4 stages.

    mpirun -n 4 python tests/mpi/parallel_cli_memory.py

The model is 8 linear layers of 1536 x 1536 (9 MiB each, 72 MiB in all); the limit is
32 MiB of parameters per rank and 40 MiB of growth of the peak resident memory (ru_maxrss)
while the stage is built. Then, as a check that the measurement would see it, the whole
model is built densely in the same process and must push the peak past that limit.
Prints ``RANK r UNDER LIMIT ...`` and ``RANK r WHOLE MODEL OVER LIMIT``.
"""

import torch
from torch import nn

from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.monitoring.timing import peak_rss_bytes as peak_rss
from hpctrain.parallel import HybridParallel, Layout
from hpctrain.models.stack import LayerStack

WIDTH, LAYERS = 1536, 8
MIB = 2 ** 20
LIMIT = 32 * MIB   # parameter bytes per rank; the model has 72 MiB
RSS_LIMIT = 40 * MIB


def main():
    torch.set_num_threads(1)
    built = []

    def layer(i):
        built.append((i, torch.empty(0).device.type))  # which layers were made, on which device
        return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh())

    stack = LayerStack(LAYERS, layer, seed=0)
    full = LAYERS * WIDTH * WIDTH * 4
    assert full > 2 * LIMIT
    # A tiny split model first: the imports and communicators of the first one are not the stage's.
    HybridParallel(LayerStack(4, lambda i: nn.Linear(2, 2)), Layout(stages=4), nn.MSELoss(),
                   lambda p: torch.optim.SGD(p, lr=0.01)).close()
    built.clear()
    before = peak_rss()
    hp = HybridParallel(stack, Layout(stages=4), nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.01),
                        micro_batches=2)
    grew = peak_rss() - before
    rank = hp.grid.rank
    params = sum(p.numel() * p.element_size() for p in hp.module.parameters())
    real = sorted(i for i, device in built if device != "meta")
    start, stop = hp.pipeline.bounds[hp.grid.stage]
    assert real == list(range(start, stop)), f"rank {rank} built layers {real}, its stage is {start}..{stop - 1}"
    assert params <= LIMIT, f"rank {rank} holds {params / MIB:.1f} MiB of parameters, limit {LIMIT / MIB:.0f} MiB"
    assert grew <= RSS_LIMIT, f"rank {rank}: peak memory grew {grew / MIB:.1f} MiB building its stage"
    print(f"RANK {rank} UNDER LIMIT params {params / MIB:.1f} MiB, peak grew {grew / MIB:.1f} MiB "
          f"(model {full / MIB:.0f} MiB)", flush=True)

    # The measurement would have caught a rank that built everything.
    before = peak_rss()
    whole = stack.sequential()
    grew = peak_rss() - before
    assert grew > RSS_LIMIT, f"rank {rank}: building the whole model grew the peak by only {grew / MIB:.1f} MiB"
    print(f"RANK {rank} WHOLE MODEL OVER LIMIT {grew / MIB:.1f} MiB", flush=True)
    del whole

    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    loss = hp.train_step(x, y)
    print(f"RANK {rank} TRAINED loss {loss:.4f}", flush=True)
    hp.close()


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main()
