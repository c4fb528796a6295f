"""The arithmetic of a run's size, pure: a global batch over ranks and accumulation (:func:`resolve_global_batch`),
the replicas a split makes (:func:`replicas_of`), and the step budget of epochs and steps (:func:`step_budget`)."""
from ..errors import ConfigError


def resolve_global_batch(global_batch, ranks, accumulation=1):
    """``(batch_size, accumulation, note)`` that make ``global_batch = batch_size x ranks x accumulation`` on
    ``ranks`` ranks: the smallest accumulation >= the configured one for which the global batch divides
    evenly, so the same samples make each step on any number of ranks. ``note``: what changed, or ``None``.
    Pure; raises :class:`ConfigError` naming what to set when no accumulation fits.

    >>> resolve_global_batch(48, 3, 1)
    (16, 1, None)
    >>> resolve_global_batch(64, 4, 3)[:2]
    (4, 4)
    """
    per_rank = global_batch // ranks
    chosen = None
    if global_batch % ranks == 0:
        chosen = next((a for a in range(accumulation, per_rank + 1) if per_rank % a == 0), None)
    if chosen is None:
        per_step = ranks * accumulation
        lower = max(per_step, global_batch // per_step * per_step)
        raise ConfigError(
            f"train.global_batch_size = {global_batch} is not divisible by ranks x accumulation = {ranks} x "
            f"{accumulation} = {per_step}, nor by {ranks} x any larger accumulation",
            hint=f"use a multiple of {per_step} (e.g. {lower} or {lower + per_step}), run on a number of ranks "
                 f"that divides it, or set the per-rank train.batch_size instead. A global batch divisible by "
                 f"every rank count a relaunch may use (e.g. 48 for 1 to 4 ranks) trains the same on each")
    note = None if chosen == accumulation else (
        f"train.accumulation {accumulation} -> {chosen}: the global batch {global_batch} over {ranks} "
        f"ranks is {per_rank} per rank, which {accumulation} micro-batches do not divide")
    return per_rank // chosen, chosen, note


def replicas_of(stages, tensor, size):
    """The replicas of ``stages x tensor`` ranks each that ``size`` ranks make (pure)."""
    per_replica = stages * tensor
    if size % per_replica:
        raise ConfigError(
            f"{size} ranks cannot be divided into replicas of {stages} stage(s) x "
            f"{tensor} tensor-parallel rank(s) = {per_replica} ranks each "
            f"({size} is not a multiple of {per_replica})",
            hint=f"launch a multiple of {per_replica} ranks (e.g. mpirun -n "
                 f"{per_replica * max(1, size // per_replica)}), or change parallel.stages / parallel.tensor")
    return size // per_replica


def step_budget(t, steps_per_epoch, step=0, epoch=0, left_in_epoch=None):
    """``(epochs or None, last step, what ends the run)`` for ``[train]`` ``t``: the first of ``train.epochs``
    epochs and ``train.max_steps`` steps where both are set, one epoch where neither is; ``epochs`` is None
    where ``max_steps`` alone is the budget (the epochs follow from it). A resumed run is at ``step``, in
    ``epoch``, with ``left_in_epoch`` steps of it to go (steps per epoch change with the rank count).

    >>> from hpctrain.config.schema import LoopConfig
    >>> step_budget(LoopConfig(max_steps=50), 22)
    (None, 50, 'train.max_steps = 50')
    >>> step_budget(LoopConfig(epochs=2, max_steps=50), 22)
    (2, 44, 'train.epochs = 2')
    >>> step_budget(LoopConfig(epochs=2), 44, step=11, epoch=0, left_in_epoch=40)
    (2, 95, 'train.epochs = 2')
    """
    left = steps_per_epoch if left_in_epoch is None else left_in_epoch

    def after(epochs):
        return step + (left + (epochs - epoch - 1) * steps_per_epoch if epoch < epochs else 0)

    if not t.epochs and not t.max_steps:
        return 1, after(1), "one epoch: neither train.epochs nor train.max_steps is set"
    if t.max_steps and (not t.epochs or t.max_steps < after(t.epochs)):
        return t.epochs or None, t.max_steps, f"train.max_steps = {t.max_steps}"
    return t.epochs, after(t.epochs), f"train.epochs = {t.epochs}"
