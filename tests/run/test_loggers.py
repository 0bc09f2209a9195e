"""`logger=mlflow` and `logger=wandb`: the configs compose, and where the package is installed a
digits run writes its metrics and config inside the run directory, where MLflow's client reads
them back with the checkpoint and `wandb sync` finds the offline run. `logger=none` trains too."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from src.utils.errors import ConfigError
from tests.helpers import FAST, compose_config
from train import train

RUN = [*FAST, "test=false"]


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_logger_config_composes_next_to_tensorboard(tmp_path, name):
    cfg = compose_config(tmp_path, [f"logger=[tensorboard,{name}]"])
    assert set(cfg.logger) == {"tensorboard", name}
    assert cfg.logger[name]._target_.startswith("lightning.pytorch.loggers.")
    where = cfg.logger[name].get("tracking_uri") or cfg.logger[name].get("save_dir")
    assert str(tmp_path) in where, f"{name} writes outside the run dir: {where}"


def test_mlflow_run_records_params_metrics_and_checkpoint_in_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    run_dir = tmp_path / "run"
    record = train(compose_config(run_dir, [*RUN, "logger=mlflow", "logger.mlflow.log_model=true"]))
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert run.data.metrics["val/acc"] == pytest.approx(record["metrics"]["val/acc"])
    assert run.data.params["data/batch_size"] == "64"
    # The last checkpoint, read back through MLflow's client, is the file the run saved.
    saved = client.download_artifacts(run.info.run_id, "last/last.ckpt", str(tmp_path / "dl"))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert Path(saved).read_bytes() == last.read_bytes(), "MLflow holds another checkpoint"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dl", "run"]


@pytest.mark.slow
def test_wandb_offline_run_is_written_in_the_run_dir_for_wandb_sync(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    try:
        train(compose_config(run_dir, [*RUN, "logger=wandb"]))
    finally:
        wandb.finish()  # the next run in this process must not log into this one
    [records] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = read_when_written(records, b"val/acc")
    assert b"val/acc" in data, f"{records}: {len(data)} bytes"
    assert b"batch_size" in data, f"{records}: {len(data)} bytes"
    # `wandb sync` finds it an offline run yet to upload (uploading needs a W&B server).
    offline_run = records.parent
    listed = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(offline_run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = listed.stdout + listed.stderr
    assert listed.returncode == 0, output
    assert "Would sync 1 run(s)" in output, output


def read_when_written(path, marker, timeout_s=10.0):
    """The file once it holds `marker`: wandb's service may still be writing the run's records
    when `wandb.finish()` returns."""
    deadline = time.monotonic() + timeout_s
    while marker not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return data


def test_a_logger_whose_extra_is_missing_names_the_install_command(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import mlflow
    from lightning_utilities.core.imports import RequirementCache

    monkeypatch.setattr(mlflow, "_MLFLOW_AVAILABLE", RequirementCache("mlflow-not-installed"))
    cfg = compose_config(tmp_path, [*FAST, "logger=mlflow"])
    with pytest.raises(
        ConfigError, match=r'mlflow \(MLFlowLogger\) needs a package .* "\.\[loggers\]"'
    ):
        train(cfg)


def test_logger_none_trains_with_the_default_callbacks_and_still_writes_metrics(tmp_path):
    record = train(compose_config(tmp_path, [*RUN, "logger=none"]))
    assert record["metrics"]["val/acc"] > 0.1  # ten digit classes: above chance
    assert not list(tmp_path.glob("tensorboard*"))
    assert (tmp_path / "metrics.json").is_file()
