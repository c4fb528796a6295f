"""The one pipeline of every save, data-parallel, sharded or split model: rank 0 checks the directory and
names a temp file (:func:`prepare`); every rank writes its share of it, and the ranks re-read and compare the
checksums while every rank fsyncs it (:func:`write_verified`); rank 0 renames it into place and fsyncs the
directory (:func:`rename_into_place`), then moves ``latest`` the same way and applies the retention
(:func:`publish`, :class:`Retention`). A failure on any rank raises :class:`CheckpointError` on all, removes
the temp file and leaves the previous checkpoint and ``latest`` as they were."""
import logging
import os

from .. import settings
from ..errors import CheckpointError
from ..runtime import fsutil
from ..runtime.coordination import on_root
from .content import format as fmt
from .content import metadata
from .directory import check_writable, read_latest, scan, write_latest
from .io import reader, writer
from .io.agreement import agree
from .io.iosettings import io_of
from .policy import select_keep

log = logging.getLogger("hpctrain.checkpoint")


def io_mode(comm):
    """``(parallel, forced)``: write collectively where h5py has MPI-IO, unless
    ``HPCTRAIN_CKPT_SERIAL`` forces rank 0 to write alone."""
    forced = settings.get_bool("CKPT_SERIAL")
    return not forced and writer.h5py_parallel(), forced


def prepare(final, comm, parallel, run_config=None, metrics=None, reason="manual", step=0, extra=None, io=None):
    """Rank 0: check the directory, choose the temp name, gather metadata and RNG states.
    ``extra``: more attributes of ``/``; ``io``: the file's layout and MPI-IO hints (:mod:`.iosettings`)."""
    check_writable(os.path.dirname(final))
    meta = metadata.root_metadata(comm.Get_size(), run_config, metrics, reason, step,
                                  "mpio" if parallel else "serial", comm.Get_size() if parallel else 1)
    meta.update(extra or {})
    return {"final": final, "tmp": fsutil.temp_name(final), "meta": meta, "rng": metadata.rng_states(), "io": io}


def write_verified(plan, info, comm, parallel, verify, background=False):
    """Collective: write the temp file and check it; remove it on any failure.
    ``background``: small, independent write calls, so that training runs between them."""
    tmp = info["tmp"]
    call_bytes = writer.CALL_BYTES if background else writer.FOREGROUND_CALL_BYTES
    io = io_of(info)
    try:
        # The disk starts writing the file back while it is written, not only at the fsync.
        stop_writeback = fsutil.early_writeback(tmp) if parallel or comm.Get_rank() == 0 else lambda: None
        try:
            checksums = writer.write_file(tmp, plan, comm, parallel, call_bytes, collective=not background,
                                          io=io)
        finally:
            stop_writeback()
        # Every rank fsyncs while the ranks re-read and checksum: the disk writes back while the CPUs verify.
        synced = writer.sync_started(tmp, parallel, comm.Get_rank())
        try:
            if verify:
                expected = {d.path: c for d, c in zip(plan.datasets, checksums)}
                reader.verify_written(tmp, expected, comm, parallel, direct=io.direct_writes())
        finally:
            problems = synced()
        agree(problems, comm, tmp, "syncing")
    except BaseException:
        if comm.Get_rank() == 0:
            fsutil.remove_quietly(tmp)
        raise


def rename_into_place(info):
    """Rank 0: the written and verified temp file becomes the checkpoint, durably."""
    tmp, final = info["tmp"], info["final"]
    try:
        fsutil.durable_rename(tmp, final)
    except OSError as exc:
        fsutil.remove_quietly(tmp)
        raise CheckpointError(f"could not move {tmp} to {final}: {exc}",
                              hint="the previous checkpoint and `latest` are untouched") from exc
    return final


def publish(info, retention, metric=None):
    """Rank 0: the checkpoint in place, then ``latest`` moved to it, then what ``retention``
    (:class:`Retention`) no longer keeps deleted."""
    final = rename_into_place(info)
    directory, name = os.path.split(final)
    retention.remember(name, metric)
    previous = read_latest(directory)
    try:
        write_latest(directory, name)
    except OSError as exc:
        raise CheckpointError(
            f"{final} was written and verified, but {os.path.join(directory, fmt.LATEST)} could not be "
            f"updated ({exc}): it still names {previous or 'no checkpoint'}; old checkpoints were not "
            f"removed. resume=auto takes the newest valid checkpoint in the directory, {name}; tools that "
            f"read `latest` see {previous or 'none'}",
            hint=f"fix the cause (space, permissions) in {directory}; the next successful save moves "
                 f"`latest`") from exc
    try:
        retention.apply()
    except OSError as exc:  # the new checkpoint is safe; old ones stay a while longer
        log.warning("retention: %s", exc)
    return final


def write_and_publish(plan, info, comm, parallel, verify, retention, metric=None, background=False):
    """Collective: a checkpoint of a run, from its plan to ``latest`` and retention."""
    write_verified(plan, info, comm, parallel, verify, background=background)
    return on_root(lambda: publish(info, retention, metric), comm)


def begin(path, comm, parallel, **meta):
    """Collective: rank 0's :func:`prepare` of the checkpoint ``path`` (``meta``: its arguments),
    handed to every rank: what each rank's plan needs (root attributes, rank 0's generators)."""
    path = os.path.abspath(os.fspath(path))
    return on_root(lambda: prepare(path, comm, parallel, **meta), comm)


def write_into_place(plan, info, comm, parallel, verify=True):
    """Collective: one checkpoint file written, verified and renamed into place, without
    ``latest`` or retention. Returns the file's path."""
    write_verified(plan, info, comm, parallel, verify)
    return on_root(lambda: rename_into_place(info), comm)


class Retention:
    """What ``[checkpoint]`` keeps of ``directory`` (rank 0): the rules of :func:`select_keep`,
    with the metric of each checkpoint remembered from its save or read from its header once."""

    def __init__(self, directory, cfg):
        self.directory, self.cfg, self._metrics = directory, cfg, {}

    def remember(self, name, metric):
        self._metrics[name] = metric

    def _metric_of(self, name):
        if name not in self._metrics:
            try:
                h = reader.read_header(os.path.join(self.directory, name))
                self._metrics[name] = h.metrics.get(self.cfg.best_metric)
            except CheckpointError:
                self._metrics[name] = None
        return self._metrics[name]

    def apply(self):
        """Delete what the rules no longer keep (never the file ``latest`` names)."""
        found = scan(self.directory)
        c = self.cfg
        keep = select_keep([(s, self._metric_of(n) if c.keep_best > 0 else None) for s, n in found],
                           c.keep_last, c.keep_best, c.best_mode, c.milestone_every)
        latest = read_latest(self.directory)
        for step, name in found:
            if step not in keep and name != latest:
                fsutil.remove_quietly(os.path.join(self.directory, name))
                self._metrics.pop(name, None)
                log.info("retention: removed %s", name)
