"""Gradient compressors for the mpi4py backend: what goes on the wire. A compressor is stateless:
``compress(t) -> (wire, ctx)`` and ``decompress(wire, ctx) -> t``; ``ctx`` carries what ``decompress`` needs
to restore the original (here: the dtype).

>>> import torch
>>> fp16 = get_compressor("fp16")
>>> wire, ctx = fp16.compress(torch.ones(3))              # float32 -> float16
>>> wire.dtype, fp16.decompress(wire, ctx).dtype
(torch.float16, torch.float32)

The Horovod backend uses Horovod's own compressors (``hvd.Compression``), chosen by the same names."""
from ..config.schema import COMPRESSIONS
from ..errors import ConfigError


class NoneCompressor:
    """Sends tensors as they are."""

    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Sends floating-point tensors as float16: half the bytes, about 3 significant digits. Sums of many large
    gradients can overflow float16 (max 65504): then divide first (``comm.gradient_predivide_factor``)."""

    name = "fp16"

    @staticmethod
    def compress(tensor):
        import torch

        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


_COMPRESSORS = {"none": NoneCompressor, "fp16": FP16Compressor}


def get_compressor(name):
    """The compressor called ``name`` (``none`` or ``fp16``)."""
    if name not in _COMPRESSORS:
        raise ConfigError(f"unknown compression {name!r}; expected one of {', '.join(COMPRESSIONS)}",
                          hint='set comm.compression = "none" or "fp16"')
    return _COMPRESSORS[name]
