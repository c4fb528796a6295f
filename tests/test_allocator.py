"""hpctrain.runtime.allocator: glibc's thresholds set once per process when asked for
(``HPCTRAIN_MALLOC=reuse``), unless the user tuned the allocator otherwise."""
import subprocess
import sys

from hpctrain.runtime import allocator

REUSE = {"HPCTRAIN_MALLOC": "reuse"}


def test_asked_for_and_left_alone_when_the_user_chose():
    assert allocator.why_not({}).startswith("glibc's defaults; HPCTRAIN_MALLOC=reuse")
    assert allocator.why_not(REUSE) is None
    assert allocator.why_not({**REUSE, "MALLOC_MMAP_THRESHOLD_": "65536"}) == "MALLOC_MMAP_THRESHOLD_ is set"
    assert allocator.why_not({**REUSE, "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == \
        "jemalloc is preloaded"


def _said(env_extra):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "HPCTRAIN_MALLOC"))}
    env.update(env_extra)
    code = "from hpctrain.runtime import allocator; print(allocator.tune()); print(allocator.tune())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.splitlines()


def test_tuned_once_and_said():
    first, again = _said(REUSE)
    assert first == again == "malloc keeps blocks up to 256 MiB for reuse (HPCTRAIN_MALLOC=reuse)"
    assert _said({})[0].startswith("malloc as it is (glibc's defaults;")


def test_a_phase_reuses_blocks_and_gives_them_back():
    code = ("import numpy as np\n"
            "from hpctrain.runtime import allocator\n"
            "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
            "with allocator.reusing_large_blocks():\n"
            "    for _ in range(3):\n"
            "        a = np.ones(40 << 20, dtype=np.uint8); del a\n"  # 40 MiB: above glibc's own mmap limit
            "    inside = rss()\n"
            "print(inside - rss() > (30 << 20))\n")  # kept inside, given back after
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
