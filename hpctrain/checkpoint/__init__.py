"""Checkpoints: one self-describing HDF5 file per checkpoint, written collectively by all
ranks through parallel HDF5, made durable and pointed to by ``latest`` by rank 0.

    from hpctrain.checkpoint import CheckpointManager
    mgr = CheckpointManager(run_dir / "checkpoints", world, cfg.checkpoint, run_config)
    mgr.resume(state)                      # cfg.resume: "auto", "none" or a path
    mgr.maybe_save(state, epoch_end=True, metrics={"val_loss": 0.31})
    mgr.close()                            # waits for a background save

The layout, lowest first; each part imports only those listed before it
(``CHECKPOINT_LAYERS`` in ``tests/test_structure.py``):

    content/     what a checkpoint holds: format, the job's metadata, a state's snapshot, the write plan
    io/          bytes on disk: the HDF5 file, writer, reader, direct and mapped writes, I/O settings
    policy       when to save, what to keep (pure rules)
    interval     how often, from measured save cost and step time (``checkpoint.auto_interval``)
    directory    the checkpoint directory: its files, ``latest``, abandoned branches, stale temp files
    commit       the one save pipeline: prepare, write, verify, rename, ``latest``, retention
    planners/    who writes and reads which part of a file, per kind of state; ``save_checkpoint``...; the
                 names a planner outside the package (split models') may use
    background   ``checkpoint.async_save``: the writer thread
    local/       the node-local level (``checkpoint.local``): snapshots between the files, recovery
    manager      ``CheckpointManager``: a run's saves, and where it resumes

A change to when or what to save stays at the top; tuning for a file system stays in ``io/``.
The file layout is in ``docs/checkpoint-format.md``; ``hpctrain ckpt`` lists, inspects,
verifies and exports checkpoints; the walk of a save and a load: ``docs/architecture.md``.
"""
from .content.format import CheckpointCorrupt, NonFiniteState
from .manager import CheckpointManager
from .planners.replicated import load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = ["CheckpointManager", "save_checkpoint", "load_checkpoint", "verify_checkpoint", "CheckpointCorrupt",
           "NonFiniteState"]
