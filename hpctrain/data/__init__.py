"""Training data: which samples each rank reads (:mod:`.sampler`), datasets and how a run opens
them (:mod:`.datasets`), the data sets hpctrain generates (:mod:`.generated`)."""
from .datasets import ArrayDataset, HDF5Dataset, as_dataset, build_data, open_datasets, open_splits
from .generated import generate, make_digits_h5, make_teacher_h5
from .sampler import ShardSampler, eval_shard

__all__ = ["ArrayDataset", "HDF5Dataset", "ShardSampler", "as_dataset", "build_data", "eval_shard", "generate",
           "make_digits_h5", "make_teacher_h5", "open_datasets", "open_splits"]
