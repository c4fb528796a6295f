"""hpctrain: data-parallel PyTorch training on HPC clusters."""
__version__ = "0.1.0"
