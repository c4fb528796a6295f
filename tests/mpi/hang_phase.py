"""A rank stuck outside the training step: rank 1 sleeps for an hour inside one phase while
rank 0 waits for it in that phase's collective. The watchdog (train.step_timeout) must end
the job with status 4, naming the rank, the host and the phase.

    mpirun -n 2 python tests/mpi/hang_phase.py OUT_DIR PHASE TIMEOUT

PHASE: ``evaluation`` (rank 1 reads its validation shard forever), ``background-save`` (rank 1's
background checkpoint writer never returns, so the final wait for it never ends), ``stop``
(rank 1's stop_requested() never returns) or ``resume`` (rank 1 never finishes loading).
"""
import sys
import time

from hpctrain import ArrayDataset, Trainer, load_config
from hpctrain.checkpoint import commit, manager
from synthetic_data import synthetic

out, phase, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])


def stuck(where):
    print(f"rank 1: stuck in {where}", flush=True)
    time.sleep(3600)


class StuckVal(ArrayDataset):
    def read(self, indices):
        if trainer.world.rank == 1:
            stuck("reading the validation set")
        return super().read(indices)


overrides = ["model.in_features=8", "model.hidden=8", "model.num_classes=2", "train.batch_size=8",
             "train.max_steps=6", "train.eval_every=0", "comm.backend=mpi", f"train.step_timeout={timeout}",
             f"run.root={out}/runs", "checkpoint.every_steps=0", "checkpoint.on_epoch_end=false"]
val = synthetic(64, 2, classes=2)
if phase == "evaluation":
    overrides += ["train.eval_every=4"]
    val = StuckVal(val.x, val.y)
elif phase == "background-save":
    overrides += ["checkpoint.async_save=true"]
    write_verified = commit.write_verified

    def write_verified_stuck(plan, info, comm, parallel, verify, background=False):
        if background and comm.Get_rank() == 1:
            stuck("the background checkpoint writer")
        return write_verified(plan, info, comm, parallel, verify, background=background)

    commit.write_verified = write_verified_stuck
elif phase == "resume":
    resume = manager.CheckpointManager.resume

    def resume_stuck(self, state):
        if self.world.rank == 1:
            stuck("resume")
        # Rank 0 has nothing to load and would otherwise arm its next phase (monitor set-up, a collective that
        # waits for rank 1) at the same moment: its watchdog could then fire first and name that phase. Lingering
        # here (well under the timeout) lets the hung rank's watchdog fire first, as on a real, slower load.
        time.sleep(min(2.0, timeout / 3))
        return resume(self, state)

    manager.CheckpointManager.resume = resume_stuck
cfg = load_config(None, overrides)
trainer = Trainer(cfg, train_data=synthetic(256, 1, classes=2), val_data=val)
if phase == "stop":
    trainer.stop_requested = lambda: trainer.world.rank == 1 and trainer.state.progress.step == 3 \
        and stuck("stop_requested()")
trainer.fit()
print(f"rank {trainer.world.rank}: finished", flush=True)
