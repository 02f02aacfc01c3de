"""Errors a user can fix. The CLI turns each into one line naming the field, and exit code 2."""


class ConfigError(Exception):
    """Bad configuration or input: `field` is the dotted config key (or CLI argument) at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, unsafe to load, or does not match the model."""


class ResumeMismatchError(CheckpointError):
    """The store holds an older checkpoint than the operator expected (exit code 4)."""
