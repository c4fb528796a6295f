import importlib
import sys

from .job import warmpool


def _warm():
    """What a rank imports before its first step: done once in the warm pool, for every rank forked from it."""
    for module in ("commands.train", "training.trainer"):
        importlib.import_module(f".{module}", __package__)


# a rank offered a warm pool runs there (this process stands in for it); the pool itself serves from here
argv = warmpool.enter(sys.argv[1:], _warm)

from .cli import main  # noqa: E402  (after the pool: its forked ranks have these imports done)

sys.exit(main(argv))
