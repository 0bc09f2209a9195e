"""Errors caused by input the user can fix, each with a message that says how.

The entry points print them in one line (src/utils/error_boundary.py).
"""

from collections.abc import Iterator
from typing import TypeVar

ErrorType = TypeVar("ErrorType", bound=BaseException)


class UserFacingError(Exception):
    """Bad input (config, data, checkpoint) with a message that says how to fix it."""


class ConfigError(UserFacingError, ValueError):
    """A config value that cannot work, with the key, the value and what was expected."""


class LaunchError(ConfigError):
    """A way of launching that no job of a sweep can run: it ends a multirun at once."""


class CheckpointError(UserFacingError, RuntimeError):
    """A checkpoint that cannot be written or read, with what to do about it."""


class MissingFileError(UserFacingError, FileNotFoundError):
    """A file or folder the run needs is not where the config says."""


def cause_chain(error: BaseException | None) -> Iterator[BaseException]:
    """Yield `error`, then each error beneath it, outermost first.

    Beneath an error lies the one it was raised from (`raise ... from`), else the one being
    handled when it was raised.
    """
    seen: set[int] = set()
    # Python breaks loops of contexts, not of causes (`a.__cause__ = b; b.__cause__ = a`).
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def first_cause(error: BaseException, kind: type[ErrorType]) -> ErrorType | None:
    """Find the first `kind` error in `error`'s cause chain, `error` itself included."""
    return next((cause for cause in cause_chain(error) if isinstance(cause, kind)), None)


def first_line(error: BaseException) -> str:
    """The first line of the error's message, or its type's name when it has none."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__


def user_message(error: UserFacingError) -> str:
    """Return the error's message as the user needs it.

    One raised in a DataLoader worker reaches the main process with the worker's traceback as its
    message ("Caught DataError in DataLoader worker process 0. Original Traceback ..."): its last
    line holds the message.
    """
    message = str(error)
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        last = message.strip().splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return message


class DataError(UserFacingError, ValueError):
    """A dataset that exists but cannot be used: corrupt, empty or inconsistent."""
