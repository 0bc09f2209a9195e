"""notebooks/quickstart.ipynb runs end to end on this interpreter, writing its runs under tmp."""

import json
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from src.run.config.compose import ROOT

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
KERNEL = "pytorch-template"


def register_kernel(jupyter_dir):
    """A kernel spec named as the notebook's that runs this interpreter, found first through
    JUPYTER_PATH, so the test does not depend on `make kernel` having run."""
    spec = jupyter_dir / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python (PyTorch template)", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))


def test_notebook_is_stored_without_outputs_for_the_template_kernel():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert notebook.metadata.kernelspec.name == KERNEL
    assert notebook.metadata.kernelspec.display_name == "Python (PyTorch template)"
    stored = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in stored)


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tmp_path, monkeypatch):
    register_kernel(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("QUICKSTART_RUNS", str(tmp_path / "runs"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=120,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any failure
    [session] = (tmp_path / "runs").iterdir()
    for path in (
        "simplenet/plots/curves.png",
        "simplenet/simplenet.safetensors",
        "cnn_profile/profile/report.json",
    ):
        assert (session / path).is_file(), f"the notebook wrote no {path}"
