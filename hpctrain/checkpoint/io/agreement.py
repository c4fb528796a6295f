"""How every rank of a collective read or write comes to raise the same :class:`CheckpointError`:
each rank collects what failed on it and keeps taking part in the collective calls; at fixed
points the ranks agree (:func:`agree`), and the error names every rank's failure and the fix."""
from ...errors import CheckpointError
from ...runtime.coordination import raise_if_any


def describe_error(exc):
    return f"{type(exc).__name__}: {exc}"


def agree(errors, comm, path, what):
    """Raise the same CheckpointError on every rank if any rank has errors."""
    raise_if_any(errors, comm, lambda problems: CheckpointError(
        f"{what} {path} failed:\n  " + "\n  ".join(problems[:20]), hint=hint_for(problems)))


def hint_for(problems):
    """The fix for what the ranks report (a full disk, permissions), as a HINT."""
    text = " ".join(problems)
    if "No space left" in text or "ENOSPC" in text or "errno = 28" in text:
        return "the file system is full: free space, lower checkpoint.keep_last, or point checkpoint.directory elsewhere"
    if "Permission denied" in text or "Read-only" in text:
        return "make the checkpoint directory writable by the job, or set checkpoint.directory"
    return "the previous checkpoint and `latest` are untouched; see the messages above for the failing rank"

