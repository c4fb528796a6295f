"""A small GPT-style byte-level language model, trained on Python's own standard library.

The corpus exists offline on every machine with Python: the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (site-packages left out), sorted by path and joined, the
first ``max_bytes`` of them. The last ``val_fraction`` of those bytes is the validation split
(the last files in that order: text the model never trains on). The first call of :func:`corpus`
caches the bytes as HDF5 (rank 0; the other ranks are only called once it is written).

Target: validation loss below 1.65 nats per byte (2.38 bits per byte) after the 600 steps of
examples/byte_gpt.toml on 2 ranks. Measured: 1.499 (2.16 bits, 60% of next bytes right), with
3.6 CPU-minutes over the 2 ranks on a busy 2-core machine (load average 12-18; on an idle one that
should be about 2 minutes of wall time, not measured). A model that has
learnt nothing scores ln 256 = 5.55 nats; gzip -9 compresses the validation bytes to 1.44 bits
per byte, so this short run is a test of the machinery, not a good language model: train longer
(train.max_steps, a larger model.kwargs.width) for one.

    mpirun -n 2 hpctrain train examples/byte_gpt.toml
    mpirun -n 2 hpctrain train examples/byte_gpt.toml comm.compression=fp16      # fp16 gradients
    mpirun -n 2 hpctrain train examples/byte_gpt.toml train.precision=bf16       # bf16 autocast
    mpirun -n 2 hpctrain train examples/byte_gpt.toml model.kwargs.width=192 model.kwargs.layers=6
    sbatch slurm/preemptible.sbatch examples/byte_gpt.toml                       # under Slurm

Resume on another number of ranks (the global batch is fixed: train.global_batch_size), and
export the weights as a plain state dict:

    mpirun -n 2 hpctrain train examples/byte_gpt.toml run.run_dir=runs/gpt train.max_steps=200
    mpirun -n 1 hpctrain train examples/byte_gpt.toml run.run_dir=runs/gpt
    hpctrain ckpt export runs/gpt/checkpoints/$(cat runs/gpt/checkpoints/latest) --to gpt.pt

The model and metric are plain PyTorch (the data factory borrows hpctrain's atomic file write);
the configuration is what names them:
``model.factory = "byte_gpt:gpt"``, ``data.factory = "byte_gpt:corpus"``,
``train.metrics = "byte_gpt:bits_per_byte"``, with ``run.python_path = ["examples"]``.
"""
import math
import os
import sysconfig

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


# ---------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a 4x MLP, each with a residual."""

    def __init__(self, width, heads, dropout):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """Bytes ``(B, T)`` in, next-byte logits ``(B, T, 256)`` out (and the loss, given the targets)."""

    def __init__(self, block=64, width=128, layers=4, heads=4, dropout=0.0):
        super().__init__()
        self.token = nn.Embedding(256, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.token.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith("proj.weight") else 1))

    def forward(self, x, targets=None):
        """The logits; with ``targets`` (``train.loss = "model"``) also the mean next-byte loss, as nanoGPT."""
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.blocks(self.token(x) + self.position(positions))
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt(block=64, width=128, layers=4, heads=4, dropout=0.0):
    """``[model] factory = "byte_gpt:gpt"``."""
    if width % heads:
        raise ValueError(f"width {width} is not divisible by heads {heads}")
    return ByteGPT(block, width, layers, heads, dropout)


# ---------------------------------------------------------------- the data
class ByteBlocks:
    """Non-overlapping blocks of ``block + 1`` bytes: input the first ``block``, target the
    next byte at each position. In memory (a few MB); ``read(indices) -> (x, y)``."""

    def __init__(self, data, block):
        self.data, self.block = np.asarray(data, dtype=np.uint8), int(block)

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def read(self, indices):
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.block
        rows = torch.from_numpy(self.data[starts + np.arange(self.block + 1)].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


def stdlib_bytes(max_bytes):
    """The first ``max_bytes`` of the standard library's ``*.py`` files, sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    chunks, size = [], 0
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8), root


def corpus(path="runs/data/stdlib-bytes.h5", block=64, max_bytes=4_000_000, val_fraction=0.05):
    """``[data] factory = "byte_gpt:corpus"``: (train, val) byte blocks, cached in ``path``."""
    import h5py

    from hpctrain.runtime.fsutil import replaced

    wanted = {"max_bytes": max_bytes, "val_fraction": val_fraction}
    if os.path.exists(path):
        with h5py.File(path, "r") as f:
            cached = {k: f.attrs.get(k) for k in wanted}
            if cached == wanted:
                return ByteBlocks(f["train"][:], block), ByteBlocks(f["val"][:], block)
    data, root = stdlib_bytes(max_bytes)
    cut = int(len(data) * (1 - val_fraction))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replaced(path) as tmp, h5py.File(tmp, "w") as f:  # a temp name, renamed once complete
        f["train"], f["val"] = data[:cut], data[cut:]
        f.attrs.update(wanted, source=root)
    return ByteBlocks(data[:cut], block), ByteBlocks(data[cut:], block)


def prepare_tokens(directory="runs/data/stdlib-tokens", max_bytes=4_000_000, val_fraction=0.02):
    """``train.bin`` and ``val.bin`` in ``directory``: the corpus's bytes as uint16 tokens, as nanoGPT's
    prepare scripts write them (``data.kind = "tokens"`` reads them; examples/byte_gpt_tokens.toml)."""
    from hpctrain.runtime.fsutil import replaced

    data, _ = stdlib_bytes(max_bytes)
    cut = int(len(data) * (1 - val_fraction))
    os.makedirs(directory, exist_ok=True)
    for name, part in (("train.bin", data[:cut]), ("val.bin", data[cut:])):
        with replaced(os.path.join(directory, name)) as tmp:
            part.astype(np.uint16).tofile(tmp)
    return directory


# ---------------------------------------------------------------- the metric
def bits_per_byte(output, target):
    """``[train] metrics = "byte_gpt:bits_per_byte"``: summed over tokens, so exact over ranks."""
    nats = F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="sum")
    return {"bits_per_byte": (float(nats) / math.log(2), target.numel())}


if __name__ == "__main__":  # python examples/byte_gpt.py prepare [DIRECTORY]
    import sys

    if sys.argv[1:2] != ["prepare"]:
        sys.exit("usage: python examples/byte_gpt.py prepare [DIRECTORY]   (writes train.bin and val.bin)")
    print(f"wrote train.bin and val.bin in {prepare_tokens(*sys.argv[2:3])}")
