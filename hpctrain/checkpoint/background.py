"""``checkpoint.async_save``: a save's write, verification and commit in a thread, while training goes on; the
training thread has taken the copy first (:func:`.plan.copy_own_pieces`). The thread runs below training's
priority, on a communicator of its own; its error is raised at :meth:`BackgroundWriter.wait`."""
import atexit
import logging
import os
import threading
import time

from . import commit

log = logging.getLogger("hpctrain.checkpoint")

# Runs the async writer (and the fsync and writeback threads it starts, which inherit it) below training, so
# training's threads come first on a shared core. Measured on one rank pinned to one core (1.07 GiB): steps
# during a save waited 2.4-2.5 s on the run queue with the writer at training's priority, 0.26-0.27 s at +10,
# the save taking longer. On its own core the writer barely touches training either way (docs/performance.md).
WRITER_NICE = 10


def lower_priority(nice=WRITER_NICE):
    """Lower the calling thread's scheduling priority by ``nice`` (it alone: Linux's
    ``setpriority`` on a thread id); does nothing where that is not possible."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + nice))
    except (AttributeError, OSError):
        pass


def threads_ok(is_root):
    """MPI lets a second thread make MPI calls (MPI_THREAD_MULTIPLE); rank 0 warns where not."""
    from mpi4py import MPI

    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        return True
    if is_root:
        log.warning("checkpoint.async_save needs MPI_THREAD_MULTIPLE; this MPI gives level %d, "
                    "saving synchronously", MPI.Query_thread())
    return False


class BackgroundWriter:
    """One save at a time in a thread. ``buffers``: host copies of the last save's pieces, reused by the next
    (fresh memory costs a page fault per page); ``written``: seconds the last write took, once durable (for
    ``checkpoint.auto_interval``)."""

    def __init__(self, comm):
        self.comm, self.buffers, self.written = comm, {}, None
        self._thread = self._error = self._comm = None

    def start(self, plan, info, parallel, verify, retention, metric):
        if self._comm is None:
            self._comm = self.comm.Dup()  # the writer's collectives never meet training's
            # A run that ends without close() must not reach MPI_Finalize mid-write.
            atexit.register(self._join)
        self._thread = threading.Thread(target=self._run, args=(plan, info, parallel, verify, retention, metric),
                                        name="hpctrain-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self, plan, info, parallel, verify, retention, metric):
        started = time.monotonic()
        lower_priority()
        try:
            commit.write_and_publish(plan, info, self._comm, parallel, verify, retention, metric, background=True)
            self.written = time.monotonic() - started
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def _join(self):
        if self._thread is not None:
            self._thread.join()

    @property
    def saving(self):
        """True while this rank's background save is still running (not collective)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Wait for the save; raise its error (the same on every rank)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self):
        """Finish the save and release the writer's communicator."""
        try:
            self.wait()
        finally:
            self.buffers = {}
            if self._comm is not None:
                self._comm.Free()
                self._comm = None
