"""Every exception ends in one line naming the log that holds its traceback; a multirun goes on.

A bug is injected as a callback of this module (`+callbacks.bug._target_=...`), so that each
entry point meets an exception that no check of the template knows.
"""

import json
import os

import pytest
from lightning.pytorch import Callback

from src.run.config.composition_errors import hydra_raises
from src.utils.error_boundary import TRACEBACKS_ASKED
from tests.helpers import FAST, run_script, run_train

BUG = [
    "+callbacks.bug._target_=tests.run.test_error_boundary.BugAtFitStart",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "test=false",
]


class BugAtFitStart(Callback):
    """A callback with a bug: an IndexError with a two-line message when fitting starts."""

    def on_fit_start(self, trainer, pl_module):
        raise IndexError("list index out of range\nsecond line of the message")


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_an_unexpected_exception_ends_in_one_line_that_names_the_log(tmp_path):
    result = run_train([*FAST, *BUG], tmp_path, check=False)

    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last_line(result) == (
        "Error: train.py stopped on an unexpected IndexError: list index out of range "
        f"(full traceback: {tmp_path / 'train.log'})"
    )
    log = (tmp_path / "train.log").read_text()
    assert "Traceback" in log, log[-2000:]
    assert "in on_fit_start" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("asked", "env"),
    [(["extras.quiet=false"], None), ([], {"HYDRA_FULL_ERROR": "1"})],
    ids=["extras.quiet=false", "HYDRA_FULL_ERROR=1"],
)
def test_a_user_who_asks_for_the_traceback_gets_it(tmp_path, asked, env):
    options = {"env": {**os.environ, **env}} if env else {}
    result = run_train([*FAST, *BUG, *asked], tmp_path, check=False, **options)

    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" in result.stderr, result.stderr[-3000:]
    assert "IndexError: list index out of range" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("asked", [False, True])
def test_hydras_own_refusal_is_one_line_unless_the_user_asks_for_the_traceback(tmp_path, asked):
    options = {"env": {**os.environ, "HYDRA_FULL_ERROR": "1"}} if asked else {}
    result = run_train(["model=resnet9000"], tmp_path, check=False, **options)

    assert result.returncode == 1, result.stderr[-3000:]
    assert ("Traceback" in result.stderr) == asked, result.stderr[-3000:]
    if not asked:
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("Error: model has no option 'resnet9000'"), line


@pytest.mark.parametrize("asked", [None, "0", "1"])
def test_while_hydra_raises_the_users_choice_is_kept_and_then_all_is_as_it_was(monkeypatch, asked):
    monkeypatch.delenv(TRACEBACKS_ASKED, raising=False)
    if asked is None:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", asked)
    with hydra_raises():
        assert os.environ["HYDRA_FULL_ERROR"] == "1"
        assert os.environ[TRACEBACKS_ASKED] == ("1" if asked == "1" else "0")
    assert os.environ.get("HYDRA_FULL_ERROR") == asked
    assert TRACEBACKS_ASKED not in os.environ


@pytest.mark.slow
def test_a_script_outside_hydra_names_a_log_of_its_own(tmp_path):
    env = {**os.environ, "PROJECT_LOG_DIR": str(tmp_path / "logs")}
    missing = tmp_path / "missing.ckpt"
    result = run_script("scripts/generate.py", ["--ckpt", str(missing)], check=False, env=env)

    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = last_line(result)
    assert line.startswith(f"Error: Checkpoint '{missing}' does not exist."), line
    [log] = (tmp_path / "logs" / "errors").glob("generate-*.log")
    assert line.endswith(f"(full traceback: {log})"), line
    assert "Traceback" in log.read_text()


@pytest.mark.slow
def test_a_sweep_runs_every_job_writes_its_summary_and_exits_1_when_one_failed(tmp_path):
    args = ["-m", *FAST, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    args += ["test=false", "optimizer.lr=0.01,-1,0.02", f"hydra.sweep.dir={tmp_path}"]
    result = run_train(args, check=False)

    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Job 1 failed: torch.optim.Adam refuses this config" in result.stderr
    assert last_line(result) == (
        f"Error: 1 of 3 jobs of the sweep failed (job 1): their errors are in "
        f"{tmp_path / 'summary.md'}."
    )
    assert all((tmp_path / job / "metrics.json").is_file() for job in "02"), "a job was lost"
    error = json.loads((tmp_path / "1" / "error.json").read_text())
    assert "Invalid learning rate: -1" in error["error"]
    assert "Traceback" in (tmp_path / "1" / "train.log").read_text()
    rows = (tmp_path / "summary.md").read_text().splitlines()
    assert "| failed: torch.optim.Adam refuses this config" in next(
        r for r in rows if r.startswith("| 1 ")
    )
    assert sum(row.endswith("| ok |") for row in rows) == 2
    assert "optimizer.lr" in (tmp_path / "summary.csv").read_text()
