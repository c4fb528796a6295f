"""The ``hpctrain`` subcommands, one module each with ``main(argv) -> int``: ``train``, ``launch``,
``ckpt``, ``report``, ``doctor``, ``examples`` (the table is :mod:`hpctrain.cli`)."""
