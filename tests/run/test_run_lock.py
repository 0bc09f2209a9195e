"""One run per directory: a second run into a directory in use is refused, and a lock never
outlives its process."""

import json
import multiprocessing
import os
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from src.run.run_lock import LOCK_FILE, RunDirInUse, run_dir_lock
from tests.helpers import FAST, run_train


def hold_the_lock(run_dir: Path, locked) -> None:
    with run_dir_lock(run_dir):
        locked.set()
        time.sleep(120)


def holding_process(run_dir) -> BaseProcess:
    """A process that holds the lock on `run_dir` until it is killed. Forked from the warm
    interpreters' server (tests/warm_interpreter.py), which has imported the libraries: it starts
    in a second where a fresh one takes several."""
    processes = multiprocessing.get_context("forkserver")
    locked = processes.Event()
    process = processes.Process(target=hold_the_lock, args=(run_dir, locked))
    process.start()
    assert locked.wait(timeout=120), "the holder took no lock"
    return process


@pytest.mark.slow
def test_a_directory_locked_by_a_live_process_is_refused_naming_it(tmp_path):
    holder = holding_process(tmp_path)
    try:
        try:
            with run_dir_lock(tmp_path):
                raise AssertionError("a second lock on a directory in use was granted")
        except RunDirInUse as error:
            message = str(error)
        assert f"in use by process {holder.pid} on " in message, message
        assert str(tmp_path) in message, message
        assert "hydra.run.dir" in message, message
    finally:
        holder.kill()
        holder.join()


@pytest.mark.slow
def test_the_lock_of_a_process_killed_with_sigkill_does_not_block_the_next_run(tmp_path):
    holder = holding_process(tmp_path)
    holder.kill()  # SIGKILL
    holder.join()
    recorded = json.loads((tmp_path / LOCK_FILE).read_text())
    assert recorded["pid"] == holder.pid  # the dead process's record is still there
    with run_dir_lock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists(), "the lock file outlived the run"


@pytest.mark.slow
def test_a_second_training_into_a_run_dir_in_use_is_refused_before_hydra_writes_there(
    tmp_path,
):
    holder = holding_process(tmp_path)
    try:
        (tmp_path / ".hydra").mkdir()
        (tmp_path / ".hydra" / "config.yaml").write_text("the first run's config\n")
        result = run_train([*FAST], tmp_path, check=False, timeout=120)
    finally:
        holder.kill()
        holder.join()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: The run directory"), last_line
    assert f"in use by process {holder.pid}" in last_line, last_line
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "the first run's config\n"
    assert not (tmp_path / "checkpoints").exists()


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    try:
        with run_dir_lock(tmp_path):
            raise ValueError("the run failed")
    except ValueError:
        pass
    assert not (tmp_path / LOCK_FILE).exists(), "a failed run left its lock file"
    with run_dir_lock(tmp_path):  # raises RunDirInUse if the lock were still held
        pass
