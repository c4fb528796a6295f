"""Training: :class:`hpctrain.Trainer` and its parts; ``hpctrain train`` is :mod:`hpctrain.commands.train`.

* :mod:`.trainer`: the training loop, data-parallel over MPI ranks;
* :mod:`.setup`: a run's set-up before its first step, in the order every rank follows;
* :mod:`.run`: one call of ``Trainer.fit``: what set-up built, what the loop carries from step to step;
* :mod:`.steps`: how a step runs (whole, sharded or split model), behind one interface;
* :mod:`.comm_modes`: when ranks exchange what (``comm.mode``), and the ``stale`` mode;
* :mod:`.sync_mode`: ``sync``, the step interface of every mode; :mod:`.local_sgd`: ``local_sgd``;
* :mod:`.sharding`: sharded optimizer state and gradients (``comm.shard``, ZeRO stages 1 and 2);
* :mod:`.split`: steps of a model split into pipeline stages and tensor ranks (``[parallel]``);
* :mod:`.optimizers`: the optimizer, the parameters weight decay applies to, the learning-rate schedule;
* :mod:`.losses`: the loss and metrics, and how a batch goes through the model;
* :mod:`.evaluation`: what an evaluation measures, and how the ranks' parts add up;
* :mod:`.nonfinite`: a step whose averaged gradients are not finite (skip, roll back or stop);
* :mod:`.recipes`: the ``[train]`` switches compile, activation checkpointing and early stopping.
"""
