"""`logger=mlflow` against a real MLflow tracking server, started by the test on 127.0.0.1 with
a SQLite store, as a team's shared server would run: the run's params, metrics and checkpoint
are read back through MLflow's client over HTTP, the checkpoint stored by the server."""

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import FAST, compose_config
from train import train

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def tracking_server(tmp_path) -> Iterator[tuple[str, Path]]:
    """The URI of a throwaway server (mlflow-skinny's own server code, with Flask installed),
    and the folder where it stores artifacts."""
    pytest.importorskip("mlflow")
    pytest.importorskip("flask_cors", reason="the MLflow server needs flask and flask-cors")
    port, artifacts = free_port(), tmp_path / "server-artifacts"
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"),
            *("--port", str(port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}"),
            *("--artifacts-destination", str(artifacts)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                said = (tmp_path / "server.log").read_text()[-2000:]
                pytest.fail(f"the MLflow server did not start: {said}")
            time.sleep(0.5)
        yield uri, artifacts
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_a_run_logs_params_metrics_and_its_checkpoint_to_a_tracking_server(
    tmp_path, monkeypatch, tracking_server
):
    from mlflow.tracking import MlflowClient

    uri, artifacts = tracking_server
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    overrides = [
        *FAST,
        "test=false",
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={uri}",
        "logger.mlflow.artifact_location=null",  # the server's artifact store
        "logger.mlflow.log_model=true",
    ]
    record = train(compose_config(run_dir, overrides))
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["val/acc"] == pytest.approx(record["metrics"]["val/acc"])
    assert run.data.params["data/batch_size"] == "64"
    steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")]
    assert max(steps) == 19  # the epoch's last step
    # The last checkpoint went through the server into its store, and comes back byte-equal.
    saved = client.download_artifacts(run.info.run_id, "last/last.ckpt", str(tmp_path / "dl"))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert Path(saved).read_bytes() == last.read_bytes()
    [stored] = artifacts.rglob("last.ckpt")
    assert stored.read_bytes() == last.read_bytes()
    assert not (run_dir / "mlflow_artifacts").exists()
