"""Compressors: what goes on the wire and what comes back."""
import pytest

torch = pytest.importorskip("torch")

from hpctrain.backends.compression import FP16Compressor, NoneCompressor, get_compressor  # noqa: E402
from hpctrain.errors import ConfigError  # noqa: E402


def test_none_is_the_identity():
    t = torch.randn(100)
    wire, ctx = NoneCompressor.compress(t)
    assert wire is t and NoneCompressor.decompress(wire, ctx) is t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fp16_round_trip_halves_bytes_and_keeps_three_digits(dtype):
    t = torch.randn(1000, dtype=torch.float64).to(dtype)
    wire, ctx = FP16Compressor.compress(t)
    assert wire.dtype == torch.float16 and wire.element_size() == 2
    back = FP16Compressor.decompress(wire, ctx)
    assert back.dtype == dtype and back.shape == t.shape
    rel = ((back.double() - t.double()).abs() / t.double().abs().clamp_min(1e-3)).max()
    assert rel <= (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)


def test_fp16_leaves_half_and_integer_tensors_alone():
    for t in (torch.randn(4, dtype=torch.float16), torch.arange(4)):
        wire, ctx = FP16Compressor.compress(t)
        assert wire is t and FP16Compressor.decompress(wire, ctx) is t


def test_fp16_overflows_beyond_its_range():
    # Why gradient_predivide_factor exists: sums above 65504 do not fit.
    wire, _ = FP16Compressor.compress(torch.tensor([70000.0]))
    assert torch.isinf(wire).all()


def test_get_compressor_by_name():
    assert get_compressor("none") is NoneCompressor and get_compressor("fp16") is FP16Compressor
    with pytest.raises(ConfigError, match="unknown compression 'int8'"):
        get_compressor("int8")


def test_mpi_fp16_sum_operator_adds_as_float16():
    import numpy as np

    from hpctrain.backends.mpi_backend import _fp16_sum

    a = np.array([1.5, -2.0, 1000.0], dtype=np.float16)
    b = np.array([0.25, 1.0, 65000.0], dtype=np.float16)
    inout = bytearray(b.tobytes())
    _fp16_sum(memoryview(a.tobytes()), memoryview(inout), None)
    out = np.frombuffer(bytes(inout), dtype=np.float16)
    assert out[:2].tolist() == [1.75, -1.0] and np.isinf(out[2])
