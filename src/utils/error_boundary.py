"""Where every entry point ends an exception: one line on the console, the traceback in a log.

A UserFacingError (src/utils/errors.py) is printed with its message, which says what to do;
any other exception with what failed, its type and first line. Either way the line names the
log file that holds the full traceback, and the exit status is 1. `HYDRA_FULL_ERROR=1` (any
entry point) or `extras.quiet=false` (a Hydra one) lets the traceback through instead.

Inside a Hydra multirun a failed job is recorded instead (its line on the console, its traceback
in its log, its message in `error.json`) and the sweep goes on to its other jobs: Hydra's basic
sweeper would stop at the first failure and lose the rest, and an Optuna search counts the job's
trial as failed. The sweep summary lists it and makes the sweep exit 1
(src/run/search/sweep_summary.py). A LaunchError, which every job would hit, ends the sweep
at once.
"""

import functools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from src.utils.errors import LaunchError, UserFacingError, first_cause, user_message

# Written in a failed job's directory: {"error": its one-line message, "log": the traceback's file}.
ERROR_FILE = "error.json"
# Whether the user asked for tracebacks (their HYDRA_FULL_ERROR), where an entry point set
# HYDRA_FULL_ERROR=1 itself so that Hydra raises its errors (src/run/config/composition_errors.py).
TRACEBACKS_ASKED = "PROJECT_FULL_ERROR"
# Set on an exception a task's config asked to see whole (extras.quiet=false), which Hydra
# raises on to the entry point, whose boundary cannot read that config.
TRACEBACK_SHOWN = "_show_traceback"


def exit_in_one_line(main: Callable) -> Callable:
    """Make an entry point end any exception in one line naming its log, with exit status 1."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except Exception as error:
            if _show_traceback(args) or getattr(error, TRACEBACK_SHOWN, False):
                raise
            raise _one_line_exit(error) from None

    return wrapper


def end_job_in_one_line(task: Callable) -> Callable:
    """`exit_in_one_line` for the task of a Hydra app, but a failed job of a multirun goes on.

    The job is recorded (`record_job_failure`) and returns None, so that the sweep runs its other
    jobs.
    """

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except Exception as error:
            if _show_traceback(args):
                setattr(error, TRACEBACK_SHOWN, True)  # for the entry point's own boundary
                raise
            if _in_multirun() and not first_cause(error, LaunchError):
                record_job_failure(error)
                return None
            raise _one_line_exit(error) from None

    return wrapper


def _one_line_exit(error: BaseException) -> SystemExit:
    return SystemExit(f"Error: {one_line(error)} (full traceback: {log_traceback(error)})")


def one_line(error: BaseException) -> str:
    """What went wrong, in one line: a UserFacingError's message, else what failed and how."""
    cause = first_cause(error, UserFacingError)
    if cause is not None:
        return " ".join(user_message(cause).split())
    lines = [line for line in user_message(error).splitlines() if line.strip()]  # type: ignore[arg-type]
    if len(lines) > 1 and lines[0].endswith(":"):  # "Error in call to target 'X':" and why
        lines = [f"{lines[0]} {lines[1]}"]
    detail = f": {' '.join(lines[0].split())[:300]}" if lines else ""
    script = Path(sys.argv[0]).name or "python"
    return f"{script} stopped on an unexpected {type(error).__name__}{detail}"


def log_traceback(error: BaseException) -> str:
    """Write `error` with its traceback to the run's log files, else to a log of its own.

    Returns the path of one file that holds it, relative to the working directory where it is
    under it.
    """
    exc_info = (type(error), error, error.__traceback__)
    record = logging.getLogger(__name__).makeRecord(
        __name__, logging.ERROR, __file__, 0, "Stopped by:", (), exc_info
    )
    paths = []
    for handler in logging.getLogger().handlers:
        # A handler into os.devnull (pytest's, say) keeps nothing to point the user to.
        if isinstance(handler, logging.FileHandler) and handler.baseFilename != os.devnull:
            handler.handle(record)
            paths.append(handler.baseFilename)
    if not paths:
        paths.append(_own_log(logging.Formatter().format(record)))
    return _shown(Path(paths[0]))


def record_job_failure(error: BaseException) -> None:
    """A multirun job's failure: one console line, the traceback in its log, `error.json`."""
    from hydra.core.hydra_config import HydraConfig

    job = HydraConfig.get().job
    message = one_line(error)
    log_path = log_traceback(error)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    (output_dir / ERROR_FILE).write_text(json.dumps({"error": message, "log": log_path}) + "\n")
    print(f"Job {job.num} failed: {message} (full traceback: {log_path})", file=sys.stderr)


def read_job_error(job_dir: Path) -> str | None:
    """The one-line error a failed job recorded in `job_dir`, if it recorded one."""
    path = job_dir / ERROR_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text())["error"])
    except (ValueError, KeyError, TypeError):
        return f"{path} is unreadable"


def _show_traceback(args: tuple) -> bool:
    """Whether the user asked for tracebacks: HYDRA_FULL_ERROR=1, or a task's extras.quiet=false."""
    if os.environ.get(TRACEBACKS_ASKED, os.environ.get("HYDRA_FULL_ERROR")) == "1":
        return True
    config = args[0] if args else None
    extras = config.get("extras") if hasattr(config, "get") else None  # type: ignore[union-attr]
    return hasattr(extras, "get") and extras.get("quiet", True) is False  # type: ignore[union-attr]


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _own_log(text: str) -> str:
    """Write `text` to <log dir>/errors/<script>-<time>.log, else to the temp folder.

    The log dir is the runs' own (conf/paths/default.yaml): PROJECT_LOG_DIR where it is set,
    else logs/ under PROJECT_ROOT.
    """
    name = f"{Path(sys.argv[0]).stem or 'python'}-{time.strftime('%Y-%m-%d_%H-%M-%S')}.log"
    root = Path(os.environ.get("PROJECT_ROOT", "."))
    log_dir = Path(os.environ.get("PROJECT_LOG_DIR", root / "logs"))
    for folder in (log_dir / "errors", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            with path.open("a") as file:
                file.write(text + "\n")
            return str(path)
        except OSError:
            continue
    return "(no writable folder for a log)"


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
