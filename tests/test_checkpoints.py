"""Checkpoints are written atomically and never run code when loaded."""

import errno
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from src.checkpoints import io as checkpoint_io
from src.checkpoints.io import load_checkpoint, save_atomically
from src.utils.errors import CheckpointError
from tests.helpers import ROOT, run_script


class Payload:
    """Unpickling this object creates a file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture
def malicious_checkpoint(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": Payload(marker)}, path)
    return path, marker


def test_a_pickled_payload_is_refused_and_never_runs(malicious_checkpoint):
    path, marker = malicious_checkpoint
    with pytest.raises(CheckpointError, match="Refusing to load"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_the_entry_points_refuse_a_malicious_checkpoint(tmp_path, malicious_checkpoint, script):
    path, marker = malicious_checkpoint
    overrides = [f"ckpt_path={path}", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1"]
    result = run_script(script, overrides, check=False)
    assert result.returncode != 0
    assert "Refusing to load" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def test_a_truncated_checkpoint_is_reported_as_corrupt(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"weights": torch.randn(1000)}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_atomically({"version": torch.tensor(1)}, path)

    def fill_the_disk(obj, file):
        file.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_io.torch, "save", fill_the_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        save_atomically({"version": torch.tensor(2)}, path)
    assert load_checkpoint(path)["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


WRITER = textwrap.dedent("""
    import sys, torch
    from src.checkpoints.io import save_atomically
    version = 0
    while True:
        version += 1
        big = torch.full((4_000_000,), float(version))  # 16 MB: a save takes a while
        save_atomically({"version": version, "weights": big}, sys.argv[1])
        print(version, flush=True)
""")


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    for delay in (0.9, 1.3, 1.7):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        writer.stdout.readline()  # at least one complete save
        time.sleep(delay - 0.8)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        checkpoint = load_checkpoint(path)
        assert torch.all(checkpoint["weights"] == checkpoint["version"])
