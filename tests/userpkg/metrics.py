def abs_error(output, target):
    """Sum of absolute errors over every position, and how many positions: val_abs_error."""
    return {"abs_error": (float((output - target).abs().sum()), target.numel()),
            "max_error_mean": float((output - target).abs().amax(dim=1).mean())}
