"""What the tests of the writers of a rank's parts (tests/test_directio.py, tests/test_mapped.py) share: a file
to write into, and writes of random bytes with the bytes the file must then hold."""
import numpy as np
import pytest

MiB = 1 << 20


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"\xff" * (40 * MiB))
    return path


def writes(writer, path, spans, seed=0):
    """Write random bytes at ``spans`` ``[(offset, length)]``; the file's bytes as they must now be (zeros
    between its old end and a write past it)."""
    rng = np.random.default_rng(seed)
    expected = bytearray(path.read_bytes())
    for offset, length in spans:
        data = rng.integers(0, 256, length, dtype=np.uint8)
        writer.write(offset, data)
        end = offset + length
        expected[len(expected):end] = b"\0" * max(0, end - len(expected))
        expected[offset:end] = data.tobytes()
    return bytes(expected)
