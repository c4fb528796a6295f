"""The exceptions hpctrain raises for user-facing problems: every message says what was found, what was
expected, and (after ``HINT:``) the fix."""

# Exit statuses of `hpctrain train` (README, "Exit status"); ``hpctrain launch`` restarts on
# some of them and not on others (:mod:`hpctrain.job.diagnosis`).
EXIT_OK, EXIT_OTHER, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_HUNG, EXIT_DIVERGED = 0, 1, 2, 3, 4, 5


class HpctrainError(Exception):
    """Base class: a problem the user can fix, reported without a deep traceback."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message, hint=None):
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nHINT: {hint}")


class ConfigError(HpctrainError, ValueError):
    """A configuration value or key is wrong."""


class LaunchError(HpctrainError):
    """The processes were started in a way that cannot form the expected job."""


class BackendUnavailable(HpctrainError):
    """A communication backend was asked for but is not installed or not usable."""


class CheckpointError(HpctrainError):
    """A checkpoint could not be written, read or verified."""


class RemoteError(HpctrainError):
    """Raised on the ranks that did not fail, when another rank failed in a shared step."""
