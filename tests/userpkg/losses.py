import torch.nn.functional as F


def smooth_ce(output, target):
    """Cross-entropy with label smoothing: a loss hpctrain does not ship."""
    return F.cross_entropy(output, target, label_smoothing=0.1)
