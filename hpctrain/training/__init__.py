"""The training loop (:mod:`.trainer`) and its parts; ``hpctrain train`` is :mod:`hpctrain.commands.train`."""
