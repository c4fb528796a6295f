"""hpctrain.allocator: glibc's thresholds set once per process unless the user chose."""
import subprocess
import sys

from hpctrain import allocator


def test_left_alone_when_the_user_chose():
    assert allocator.why_not({"HPCTRAIN_MALLOC": "system"}) == "HPCTRAIN_MALLOC=system"
    assert allocator.why_not({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "MALLOC_MMAP_THRESHOLD_ is set"
    assert allocator.why_not({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == "jemalloc is preloaded"


def _said(env_extra):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "HPCTRAIN_MALLOC"))}
    env.update(env_extra)
    code = "from hpctrain import allocator; print(allocator.tune()); print(allocator.tune())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.splitlines()


def test_tuned_once_and_said():
    first, again = _said({})
    assert first == again == "malloc keeps blocks up to 256 MiB for reuse (HPCTRAIN_MALLOC=system: glibc's defaults)"
    assert _said({"HPCTRAIN_MALLOC": "system"})[0] == "malloc as it is (HPCTRAIN_MALLOC=system)"
