"""Two models a user might bring: a classifier, and a per-position sequence regressor."""
from torch import nn


def classifier(in_features=16, width=32, classes=4):
    return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, classes))


class Smoother(nn.Module):
    """(B, T) floats in, (B, T) floats out: a learned 1-D convolution."""

    def __init__(self, kernel):
        super().__init__()
        self.conv = nn.Conv1d(1, 1, kernel, padding=kernel // 2)

    def forward(self, x):
        return self.conv(x[:, None, :])[:, 0, :]


def smoother(kernel=3):
    return Smoother(kernel)


def not_a_model(**kwargs):
    return "a string"


class SelfScoring(nn.Module):
    """A classifier that computes its own loss when given targets, in the ways models do: ``"tuple"``
    (logits, loss) as nanoGPT's GPT, ``"object"`` with .loss and .logits (real Hugging Face models:
    test_huggingface*.py), ``"scalar"`` the loss alone; ``"logits"`` ignores the targets (a mistake). Without targets: the logits."""

    def __init__(self, in_features, width, classes, style):
        super().__init__()
        self.net, self.style = classifier(in_features, width, classes), style

    def forward(self, x, targets=None):
        logits = self.net(x)
        if targets is None or self.style == "logits":
            return logits
        loss = nn.functional.cross_entropy(logits, targets)
        if self.style == "object":
            from types import SimpleNamespace
            return SimpleNamespace(loss=loss, logits=logits)
        return (logits, loss) if self.style == "tuple" else loss


def self_scoring(in_features=16, width=32, classes=4, style="tuple"):
    return SelfScoring(in_features, width, classes, style)
