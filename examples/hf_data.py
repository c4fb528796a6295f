"""Dict samples for examples/hf_classifier.toml: snippets of the standard library's sources, each labelled with
the package it comes from (0: json, 1: email, 2: asyncio), as bytes (token ids 0-255) of 16 to 62 bytes, with
an attention mask: the shape of a tokenized Hugging Face dataset, made here with nothing to download."""
import os
import sysconfig

import numpy as np

PACKAGES = ("json", "email", "asyncio")
CLS = 1  # the first token of every sample (bytes 0-255 are the vocabulary; byte 1 never occurs in the sources)


class Snippets:
    """``dataset[i] -> {"input_ids": [...], "attention_mask": [...], "labels": int}`` (lists, as Hugging Face
    datasets give them)."""

    def __init__(self, texts, labels, seed, count, shortest=16, longest=62):
        rng = np.random.default_rng(seed)
        self.samples = []
        for _ in range(count):
            label = int(rng.integers(len(texts)))
            text = texts[label]
            length = int(rng.integers(shortest, longest + 1))
            start = int(rng.integers(0, len(text) - length))
            ids = [CLS] + list(text[start:start + length])
            self.samples.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels[label]})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _sources(package):
    root = os.path.join(sysconfig.get_paths()["stdlib"], package)
    parts = []
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests"))
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                parts.append(f.read())
    return b"".join(parts)


def snippets(train_samples=4096, val_samples=512):
    """``[data] factory = "hf_data:snippets"``: (train, val); the two halves of each package's sources apart."""
    whole = [_sources(p) for p in PACKAGES]
    halves = [(t[:len(t) * 9 // 10], t[len(t) * 9 // 10:]) for t in whole]
    labels = list(range(len(PACKAGES)))
    return (Snippets([h[0] for h in halves], labels, seed=0, count=train_samples),
            Snippets([h[1] for h in halves], labels, seed=1, count=val_samples))


def pad(samples):
    """``[data] collate = "hf_data:pad"``: one batch, input_ids and attention_mask padded with 0 to the longest
    (what transformers' DataCollatorWithPadding does with a tokenizer)."""
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = torch.as_tensor(s["input_ids"])
        mask[row, :len(s["attention_mask"])] = torch.as_tensor(s["attention_mask"])
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.as_tensor([s["labels"] for s in samples])}
