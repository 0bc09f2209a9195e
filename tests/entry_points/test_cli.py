"""The command line as users type it: each test runs train.py / eval.py in a subprocess."""

import json
import re

import pytest

from src.run.launch import register_launch_resolvers
from tests.helpers import FAST, ROOT, run_script, run_train


@pytest.mark.slow
def test_multirun_runs_each_job_in_its_own_dir_and_summarises_the_sweep(tmp_path):
    run_train(["-m", "model=simplenet,cnn", f"hydra.sweep.dir={tmp_path}", *FAST])
    for job in ("0", "1"):
        record = json.loads((tmp_path / job / "metrics.json").read_text())
        assert "test/acc" in record["metrics"]
    summary = (tmp_path / "summary.md").read_text()
    assert "model=simplenet" in summary
    assert "model=cnn" in summary
    assert "(best)" in summary
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert len(rows) == 3
    assert "val/acc_best" in rows[0]


@pytest.mark.slow
def test_a_job_with_bad_input_fails_alone_and_the_sweep_goes_on(tmp_path):
    result = run_train(
        [
            "-m",
            "data.val_fraction=1.5,0.2",  # the first jobs fail
            "model=simplenet,cnn",
            f"hydra.sweep.dir={tmp_path}",
            *FAST,
        ],
        check=False,
    )
    assert result.returncode != 0
    assert "data.val_fraction" in result.stderr  # the failed job's error, as raised
    finished = [job for job in "0123" if (tmp_path / job / "metrics.json").exists()]
    assert len(finished) == 2  # the two jobs with a valid fraction


@pytest.mark.slow
def test_train_then_eval_from_the_command_line(tmp_path):
    run_train(["model=cnn", *FAST], tmp_path / "train")
    trained = json.loads((tmp_path / "train" / "metrics.json").read_text())
    run_script(
        "eval.py", [f"ckpt_path={trained['best_model_path']}", f"hydra.run.dir={tmp_path / 'eval'}"]
    )
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["metrics"]["test/acc"] == pytest.approx(trained["metrics"]["test/acc"])


@pytest.mark.slow
def test_wrongly_typed_value_names_the_key_and_the_expected_type_without_a_traceback():
    result = run_train(["trainer.max_epochs=ten"], check=False)
    assert result.returncode != 0
    assert "trainer.max_epochs='ten'" in result.stderr
    assert "expects int" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_eval_with_a_missing_checkpoint_says_what_to_pass(tmp_path):
    result = run_script(
        "eval.py",
        [f"ckpt_path={tmp_path / 'missing.ckpt'}", f"hydra.run.dir={tmp_path}"],
        check=False,
    )
    assert result.returncode != 0
    assert "is not a file" in result.stderr
    assert "checkpoints/last.ckpt" in result.stderr


def test_runs_default_to_timestamped_dirs_under_logs_train_runs(monkeypatch):
    from hydra import compose, initialize_config_dir

    monkeypatch.delenv("PROJECT_LOG_DIR", raising=False)  # as outside the tests
    register_launch_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    pattern = rf"{re.escape(str(ROOT))}/logs/train/runs/\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{{6}}"
    assert re.fullmatch(pattern, cfg.hydra.run.dir), cfg.hydra.run.dir


def test_project_log_dir_moves_every_run_dir(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir

    monkeypatch.setenv("PROJECT_LOG_DIR", str(tmp_path / "scratch"))
    register_launch_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith(f"{tmp_path / 'scratch'}/train/runs/"), cfg.hydra.run.dir
