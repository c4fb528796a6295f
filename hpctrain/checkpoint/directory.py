"""The checkpoint directory of a run: its files (``ckpt-<step>.h5``, ``latest``), the branches a resume leaves
behind (``abandoned/``), and what a killed save left (temp files). Rank 0 only; nothing is collective."""
import logging
import os
import time

from ..errors import CheckpointError
from ..runtime import fsutil
from .content import format as fmt

log = logging.getLogger("hpctrain.checkpoint")

BRANCH_RECORD = "branch.json"  # in each abandoned/<branch>/ folder: when, and from where the run went on


def write_latest(directory, name):
    """Point ``latest`` at ``name``, atomically and durably."""
    fsutil.write_text(os.path.join(directory, fmt.LATEST), name + "\n")


def read_latest(directory):
    """The checkpoint name ``latest`` holds, or None: no ``latest``, or it names no file of this directory."""
    return _checkpoint_name(_pointer(directory))


def _checkpoint_name(pointer):
    return pointer if pointer is not None and fmt.parse_step(pointer) is not None else None


def _pointer(directory):
    try:
        with open(os.path.join(directory, fmt.LATEST), errors="replace") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def scan(directory):
    """``[(step, file name)]`` of the checkpoints in ``directory``, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(fmt.parse_step(n), n) for n in names]
    return sorted(((s, n) for s, n in found if s is not None), reverse=True)


def newest_step(directory):
    """The step ``checkpoint.resume=auto`` starts from: the newest checkpoint's (0: none)."""
    found = scan(directory)
    return found[0][0] if found else 0


def check_writable(directory):
    try:
        os.makedirs(directory, exist_ok=True)
        probe = fsutil.temp_name(os.path.join(directory, ".probe"))
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} is not writable ({exc})",
                              hint="set checkpoint.directory to a writable place (on a cluster: "
                                   "scratch, not $HOME), or fix its permissions") from exc


def remove_stale_temps(directory):
    """Delete temp files that a killed save left behind. Safe at resume: nothing of this
    run is being written yet, and the run lock keeps other jobs out of the directory."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if fsutil.TMP_MARK in name and (name.startswith("ckpt-") or name.startswith(fmt.LATEST)):
            log.warning("removing %s, left by a save that did not finish", name)
            fsutil.remove_quietly(os.path.join(directory, name))


def candidates(directory):
    """Checkpoints of the current branch, newest first. ``latest`` is not trusted over the directory: a save
    whose ``latest`` update failed left a newer complete file, and abandoned branches were moved aside."""
    found = scan(directory)
    pointer = _pointer(directory)  # read once: what it holds, then whether that is a checkpoint name
    latest = _checkpoint_name(pointer)
    if pointer is not None and latest is None:
        # Only a ckpt-<step>.h5 beside it counts: never a path that leads out of the directory.
        log.warning("%s names %r, which is not a checkpoint file name of this directory (ckpt-<step>.h5): "
                    "ignored; %s", os.path.join(directory, fmt.LATEST), pointer[:200],
                    f"resuming from the newest checkpoint there, {found[0][1]}" if found else
                    "there is no checkpoint there, so the run starts from step 0")
    if latest is not None and found and latest != found[0][1]:
        log.warning("%s names %s, but %s is newer (a save whose `latest` update failed, or `latest` was "
                    "edited); resuming from the newest valid checkpoint",
                    os.path.join(directory, fmt.LATEST), latest, found[0][1])
    return [os.path.join(directory, n) for _, n in found]


def start_branch(directory, path, step):
    """After loading ``path`` (step ``step``): checkpoints of ``directory`` at ``step`` or later (other than
    ``path``) belong to the branch the run left. They move to ``abandoned/<time>-from-<step>/`` with a
    ``branch.json`` record, never resumed automatically nor deleted by retention. ``latest`` names ``path``
    first, so the next resume finishes what a crash cut short."""
    try:
        _move_newer(directory, path, step)
    except OSError as exc:
        raise CheckpointError(
            f"resumed from {path}, but the newer checkpoints of the branch left behind could not be moved "
            f"to {os.path.join(directory, fmt.ABANDONED)}: {exc}",
            hint="make the checkpoint directory writable; until they are moved, retention would count "
                 "them as the newest checkpoints") from exc


def _move_newer(directory, path, step):
    same_dir = os.path.dirname(path) == directory
    name = os.path.basename(path)
    newer = [(s, n) for s, n in scan(directory) if s >= step and not (same_dir and n == name)]
    current = read_latest(directory)
    if same_dir and current != name:
        write_latest(directory, name)
    if not newer:
        return
    if not same_dir and current is not None:
        fsutil.remove_quietly(os.path.join(directory, fmt.LATEST))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = os.path.join(directory, fmt.ABANDONED, f"{stamp}-from-{step:08d}")
    os.makedirs(dest, exist_ok=True)
    for _, n in newer:
        os.replace(os.path.join(directory, n), os.path.join(dest, n))
    for moved in (dest, os.path.dirname(dest), directory):
        fsutil.fsync_path(moved, directory=True)
    fsutil.write_text(os.path.join(dest, BRANCH_RECORD), fmt.to_json({
        "abandoned": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "resumed_from": path,
        "resumed_step": step, "files": [n for _, n in sorted(newer)]}) + "\n")
    log.warning("the run continues from step %d (%s): %d newer checkpoint(s) of the abandoned branch "
                "(steps %s) moved to %s; resume=auto never takes them and retention never deletes them",
                step, name, len(newer), ", ".join(str(s) for s, _ in sorted(newer)), dest)
