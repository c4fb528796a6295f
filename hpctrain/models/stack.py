"""A model as a stack of layers built one at a time, so that a pipeline stage builds only its own layers and a
model larger than one rank's memory can be split. Layer ``i`` is built under a generator seeded from
``(seed, i)``: the same weights on every rank and layout, whichever layers a rank builds, in any order.

>>> stack = LayerStack(8, lambda i: nn.Linear(64, 64), seed=0)
>>> [name for name, _ in stack.sequential(2, 4).named_children()]   # layers 2 and 3 only
['2', '3']
>>> dense = stack.sequential()            # the whole model in one process (tests, exports)
"""
from collections import OrderedDict

import numpy as np
import torch
from torch import nn


def layer_seed(seed, index):
    return int(np.random.SeedSequence([int(seed), int(index), 0x5EED]).generate_state(1)[0])


class LayerStack:
    """``count`` layers, layer ``i`` made by ``build(i)`` and named ``names[i]`` (default ``"i"``)."""

    def __init__(self, count, build, seed=0, names=None):
        self.count, self._build, self.seed = int(count), build, int(seed)
        self.names = [str(i) for i in range(self.count)] if names is None else list(names)
        if len(self.names) != self.count:
            raise ValueError(f"{len(self.names)} names for {self.count} layers")

    def __len__(self):
        return self.count

    def build(self, index, device=None):
        """Layer ``index``, built under its own seed (the caller's generator is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(self.seed, index))
            if device is None:
                return self._build(index)
            with torch.device(device):
                return self._build(index)

    def parameter_counts(self):
        """Parameters per layer (``balance = "params"``) from layers built on the meta device (no memory)."""
        return [sum(p.numel() for p in self.build(i, device="meta").parameters()) for i in range(self.count)]

    def layers(self):
        """The layers one at a time (a generator): at most one is alive if the caller drops it."""
        return (self.build(i) for i in range(self.count))

    def sequential(self, start=0, stop=None):
        """Layers ``start .. stop-1`` as an ``nn.Sequential`` under their names in the whole model."""
        stop = self.count if stop is None else stop
        return nn.Sequential(OrderedDict((self.names[i], self.build(i)) for i in range(start, stop)))
