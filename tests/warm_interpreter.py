"""`python <script> <args>` in a warm interpreter: forked from one that has imported the libraries.

A fresh `python train.py ...` spends seconds importing torch, Lightning and Hydra before its own
code runs, and the slow tests start a few hundred of them. Here each script runs in a process
that multiprocessing's forkserver forks from a server that imported those libraries once per test
worker: the script still gets a process of its own (its own pid, environment, working directory,
sys.argv and exit code), and none of the project's modules, which it imports afresh. Exits as
Python's do: non-daemon threads joined, atexit handlers run, output flushed.

What the preloaded libraries read from the environment at import, they read from the server's:
`run_script` therefore runs a script with an environment of its own (`env=...`) the cold way.
"""

import atexit
import functools
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

# Imported once by the server, then shared by every script forked from it.
PRELOADED = ["torch", "torchmetrics", "lightning.pytorch", "hydra", "omegaconf"]

_server = multiprocessing.get_context("forkserver")
_server.set_forkserver_preload(PRELOADED)


@functools.cache
def fresh_search_path() -> list[str]:
    """What a fresh interpreter's sys.path holds after its first entry (the script's folder)."""
    shown = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(shown.stdout)


def _exec_script(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    output: tuple[str, str],
    new_session: bool,
    search_path: list[str],
) -> None:
    """In the forked process: become `python <argv>` in `cwd` with `env`, then exit as it would."""
    for fd, path in zip((1, 2), output, strict=True):
        with open(path, "wb") as file:
            os.dup2(file.fileno(), fd)
    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    # A fresh interpreter's path, its first entry the script's folder, as `python script` has it.
    sys.path[:] = [os.path.dirname(script), *search_path]
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports it
        traceback.print_exc()
        code = 1
    # What interpreter shutdown does before exiting, which os._exit below would skip.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_warm(
    argv: Sequence[str],
    cwd: Path | str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    start_new_session: bool = False,
) -> subprocess.CompletedProcess:
    """`python <argv>` in a warm interpreter, its output captured as text, as subprocess.run does.

    Raises subprocess.TimeoutExpired, after killing it, when it runs past `timeout` seconds.
    """
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        output = (os.path.join(folder, "stdout"), os.path.join(folder, "stderr"))
        process = _server.Process(
            target=_exec_script,
            args=(list(argv), str(cwd), env, output, start_new_session, fresh_search_path()),
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        stdout, stderr = (Path(path).read_text(errors="replace") for path in output)
    return subprocess.CompletedProcess([sys.executable, *argv], process.exitcode, stdout, stderr)
