"""User-facing errors.

A :class:`PosttrainError` is a mistake the user can fix (a bad key, a missing file, an impossible
batch size). The CLI prints its message and exits with status 2, without a traceback unless
``--debug`` is given. Internal invariants use ``assert`` instead.
"""


class PosttrainError(Exception):
    """An error caused by user input, with a message that says what to do."""


class ConfigError(PosttrainError, ValueError):
    """A configuration file or override is wrong."""


class DataError(PosttrainError):
    """A dataset is missing, malformed or empty."""


class CheckpointError(PosttrainError):
    """A checkpoint cannot be read or written."""
