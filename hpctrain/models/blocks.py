"""Dense transformer blocks. Their parallel versions (:mod:`hpctrain.parallel.tensor`) share their parameter
names and shapes, so a model of these trains in one process or tensor-parallel, and checkpoints either way."""
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError


class MLPBlock(nn.Module):
    """Dense transformer MLP: ``fc2(gelu(fc1(x)))``. Split it with :class:`ParallelMLP`."""

    def __init__(self, width, hidden):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SelfAttention(nn.Module):
    """Dense multi-head self-attention over ``(batch, sequence, width)``; ``causal`` masks
    the future. Split it by heads with :class:`ParallelSelfAttention`."""

    def __init__(self, width, heads, causal=False):
        super().__init__()
        if width % heads:
            raise ConfigError(f"attention width {width} is not a multiple of its {heads} heads")
        self.width, self.heads, self.causal = width, heads, causal
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def _attend(self, q, k, v, heads):
        b, n, _ = q.shape
        d = self.width // self.heads

        def split(t):
            return t.view(b, n, heads, d).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=self.causal)
        return out.transpose(1, 2).reshape(b, n, heads * d)

    def forward(self, x):
        out = self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads)
        return self.out_proj(out)
