"""Where a run resumes: the newest checkpoint of its directory that passes verification (a
damaged one is skipped with a warning naming the problem), and the branch of newer
checkpoints it leaves behind (moved to ``abandoned/``, :func:`.directory.start_branch`)."""
import logging

from ..errors import CheckpointError
from ..runtime.coordination import everywhere, on_root
from . import directory
from . import format as fmt

log = logging.getLogger("hpctrain.checkpoint")


def load_newest(path, planner, state, comm, is_root):
    """Collective: load the newest valid checkpoint of directory ``path`` into ``state`` with
    ``planner``; ``(file, header)``, or None when there is none. Raises the same
    :class:`CheckpointError` on every rank when every one is damaged."""
    candidates = on_root(lambda: directory.candidates(path), comm)
    problems = []
    for file in candidates:
        try:
            h = planner.load(file, state)
        except fmt.CheckpointCorrupt as exc:
            reason = str(exc).split("\nHINT:")[0]
            problems.append(reason)
            if is_root:
                log.warning("skipping checkpoint %s: %s; trying the previous one", file, reason)
            continue
        if problems and is_root:
            log.warning("resumed from %s, an older checkpoint, because newer ones are damaged", file)
        return file, h
    if problems:
        raise everywhere(CheckpointError(
            f"no valid checkpoint in {path}:\n  " + "\n  ".join(problems),
            hint="start fresh with checkpoint.resume=none, or name a file with checkpoint.resume=PATH"))
    return None


def continue_from(path, file, header, state, comm, is_root):
    """Collective, after ``file`` was loaded into ``state``: its newer siblings become an
    abandoned branch, and rank 0 says where the run resumed."""
    on_root(lambda: directory.start_branch(path, file, state.progress.step), comm)
    if is_root:
        a = header.root_attrs
        print(f"hpctrain: resumed from {file} at step {state.progress.step} (epoch {state.progress.epoch}), "
              f"written by {a.get('nranks', '?')} rank(s) ({a.get('io_mode', '?')})", flush=True)
