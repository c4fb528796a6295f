"""Optimizers a user might bring (train.optimizer = "userpkg.optim:NAME"), and wrong ones."""
import torch


def grouped_adamw(model, lr, weight_decay):
    """AdamW with decay on the weights only, and half the learning rate for the biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": weights, "weight_decay": weight_decay},
                              {"params": biases, "weight_decay": 0.0, "lr": lr / 2}], lr=lr)


def not_an_optimizer(model, lr, weight_decay):
    return [p for p in model.parameters()]


def no_lr(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)
