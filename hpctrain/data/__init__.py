"""Data: which samples each rank reads (:mod:`.sampler`), datasets (:mod:`.datasets`, :mod:`.generated`,
token streams in :mod:`.tokens`), what a batch is (:mod:`.batches`), batches read ahead by worker processes
(:mod:`.loading`)."""
from .datasets import ArrayDataset, HDF5Dataset, as_dataset, build_data, open_datasets, open_splits
from .generated import generate, make_digits_h5, make_teacher_h5
from .sampler import ShardSampler, eval_shard
from .tokens import TokenWindows, open_token_splits

__all__ = ["ArrayDataset", "HDF5Dataset", "ShardSampler", "TokenWindows", "as_dataset", "build_data", "eval_shard",
           "generate", "make_digits_h5", "make_teacher_h5", "open_datasets", "open_splits", "open_token_splits"]
