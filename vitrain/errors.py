"""User-facing errors: each one is a single line that names the field or file and the fix."""


class VitrainError(Exception):
    """Bad input from the user; the CLI prints it as one line and exits with code 2."""


class ConfigError(VitrainError):
    """A config value is unknown, of the wrong type or impossible."""


class DataError(VitrainError):
    """A data source is missing, empty or holds a file that cannot be read."""


class CheckpointError(VitrainError):
    """A checkpoint is missing, unreadable or belongs to another model."""
