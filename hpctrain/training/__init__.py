"""The training loop (``trainer``) and the ``hpctrain train`` command (``command``)."""
