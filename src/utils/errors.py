"""Errors caused by input the user can fix; the entry points print them without a traceback."""


class UserFacingError(Exception):
    """Bad input (config, data, checkpoint) with a message that says how to fix it."""


class ConfigError(UserFacingError, ValueError):
    """A config value that cannot work, with the key, the value and what was expected."""


class CheckpointError(UserFacingError, RuntimeError):
    """A checkpoint that cannot be written or read, with what to do about it."""


class MissingFileError(UserFacingError, FileNotFoundError):
    """A file or folder the run needs is not where the config says."""
