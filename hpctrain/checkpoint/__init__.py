"""Checkpoints: one self-describing HDF5 file per checkpoint, written collectively by all
ranks through parallel HDF5, made durable and pointed to by ``latest`` by rank 0.

    from hpctrain.checkpoint import CheckpointManager
    mgr = CheckpointManager(run_dir / "checkpoints", world, cfg.checkpoint, run_config)
    mgr.resume(state)                      # cfg.resume: "auto", "none" or a path
    mgr.maybe_save(state, epoch_end=True, metrics={"val_loss": 0.31})
    mgr.close()                            # waits for a background save

The file layout is in ``docs/checkpoint-format.md``; ``hpctrain ckpt`` lists, inspects,
verifies and exports checkpoints. The modules, lowest first: ``docs/architecture.md``.
"""
from .content.format import CheckpointCorrupt, NonFiniteState
from .manager import CheckpointManager
from .planners.replicated import load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = ["CheckpointManager", "save_checkpoint", "load_checkpoint", "verify_checkpoint", "CheckpointCorrupt",
           "NonFiniteState"]
