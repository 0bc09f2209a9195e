"""Errors caused by input the user can fix; the entry points print them without a traceback."""

import functools
import logging
from collections.abc import Callable, Iterator
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


def exit_on_user_error(main: Callable) -> Callable:
    """Make an entry point print a UserFacingError in one line and exit with status 1.

    No traceback reaches the console, even for an error wrapped by Hydra's instantiate. Inside a
    Hydra multirun the error is raised as it is instead: the sweep records the job as failed and
    goes on (an Optuna search tries other values) rather than exiting mid-sweep; except a
    LaunchError, which every job would hit.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Exception as error:
            cause = first_cause(error, UserFacingError)
            if cause is None or (_in_multirun() and not isinstance(cause, LaunchError)):
                raise
            log_to_files(error)
            raise SystemExit(f"Error: {user_message(cause)}") from None

    return wrapper


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


def log_to_files(error: BaseException) -> None:
    """Write `error` with its traceback to the run's log files only (train.log), for a bug report.

    The console gets one line.
    """
    exc_info = (type(error), error, error.__traceback__)
    record = logging.getLogger(__name__).makeRecord(
        __name__, logging.ERROR, __file__, 0, "Stopped by:", (), exc_info
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


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


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


class DataError(UserFacingError, ValueError):
    """A dataset that exists but cannot be used: corrupt, empty or inconsistent."""
