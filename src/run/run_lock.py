"""One run per directory: an exclusive lock on the run directory for the life of the run.

Two runs writing into one directory interleave their checkpoints, logs and `.hydra/` config.
The lock is an `fcntl.flock` on `<run dir>/.run.lock`, which the kernel releases however the
process ends (even on kill -9), so a lock left by a dead process never blocks. The file records
who holds it (PID, host, start time) for the message that refuses a second run. Only rank 0 of
a distributed launch locks: the other ranks share its directory by design.

Hydra writes `.hydra/` and starts the log as soon as it has composed the config, before the
task runs. So a directory pinned on the command line (`hydra.run.dir=...`) is locked before
Hydra starts (`pinned_run_dir`), and the task then locks the directory it runs in, which for a
pinned one this process holds already.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from src.run.launch import process_rank
from src.utils.errors import UserFacingError

LOCK_FILE = ".run.lock"

# The run directories this process holds, by resolved path: the open descriptor of each lock.
_held: dict[Path, int] = {}


class RunDirInUse(UserFacingError):
    """Another live run holds the lock on this run directory."""


def holder_description(path: Path) -> str:
    """Who the lock file says holds it, in words."""
    try:
        holder = json.loads(path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        return f"process {holder['pid']} on {holder['host']} (since {started})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def acquire(run_dir: Path) -> int:
    """Lock `run_dir` and record this process as the holder; the open descriptor."""
    path = run_dir / LOCK_FILE
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise RunDirInUse(
                f"The run directory {run_dir} is in use by {holder_description(path)}: one run "
                f"per directory. Wait for it to finish, stop it, or choose another directory "
                f"(drop hydra.run.dir=... for a new one)."
            ) from None
        # The previous holder removes the file as it releases: a lock on the removed file
        # would lock nothing, so take the lock again on the file now at `path`.
        if path.exists() and os.stat(path).st_ino == os.fstat(descriptor).st_ino:
            break
        os.close(descriptor)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    os.ftruncate(descriptor, 0)
    # On a full disk the lock holds without the record, which only names the holder.
    with contextlib.suppress(OSError):
        os.write(descriptor, json.dumps(holder).encode())
    return descriptor


@contextmanager
def run_dir_lock(run_dir: str | Path | None) -> Iterator[None]:
    """Hold the lock on `run_dir` while the block runs, on rank 0 (nothing for None).

    Raises RunDirInUse when another live process holds it.
    """
    if run_dir is None or process_rank() != 0 or Path(run_dir).resolve() in _held:
        yield
        return
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _held[run_dir] = acquire(run_dir)
    try:
        yield
    finally:
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
        os.close(_held.pop(run_dir))  # releases the lock


def pinned_run_dir(argv: list[str]) -> Path | None:
    """Return the run directory that `argv` pins with `hydra.run.dir=<dir>`, where Hydra puts it.

    None for a multirun, without the override, or when its value needs the config to resolve.
    """
    if {"-m", "--multirun"} & set(argv):
        return None
    values = [arg.split("=", 1)[1] for arg in argv if arg.startswith("hydra.run.dir=")]
    if not values or "${" in values[-1]:
        return None
    return Path(values[-1].strip("'\""))
