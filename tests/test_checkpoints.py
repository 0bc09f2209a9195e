"""Checkpoints are written atomically and never run code when loaded."""

import errno
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from PIL import Image

from src.checkpoints import io as checkpoint_io
from src.checkpoints.io import save_atomically
from src.checkpoints.restore import restore
from src.utils.errors import CheckpointError
from src.utils.files import write_atomically
from src.utils.weights import load_checkpoint
from tests.helpers import FAST, ROOT, run_script, run_train


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


# Every entry point that reads a checkpoint or weights file: (script, its arguments), with
# {ckpt} the malicious file (.ckpt, or .pt for a `model.pretrained` state dict) and {image} an
# image. Each must refuse the file in its weights-only load, before anything else unpickles it.
ENTRY_POINTS = {
    "eval": ("eval.py", ["ckpt_path={ckpt}"]),
    "train-resume": ("train.py", ["ckpt_path={ckpt}"]),
    "train-resume-last": ("train.py", ["ckpt_path=last"]),  # {ckpt} is the run's last.ckpt
    "predict": ("predict.py", ["ckpt_path={ckpt}", "input={image}"]),
    "generate": ("scripts/generate.py", ["--ckpt", "{ckpt}"]),
    "export": ("scripts/export.py", ["ckpt_path={ckpt}"]),
    "evaluate_lm": ("scripts/evaluate_lm.py", ["ckpt_path={ckpt}", "tasks=[sft_choice]"]),
    "train-pretrained-ckpt": ("train.py", ["model.pretrained={ckpt}"]),
    "train-pretrained-pt": ("train.py", ["model.pretrained={ckpt}"]),
}
HYDRA_APPS = ("eval.py", "train.py", "predict.py", "scripts/export.py", "scripts/evaluate_lm.py")


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_the_entry_points_refuse_a_malicious_checkpoint(
    tmp_path, malicious_checkpoint, entry_point
):
    path, marker = malicious_checkpoint
    if entry_point.endswith("-pt"):
        path = path.rename(path.with_suffix(".pt"))
    if entry_point.endswith("-last"):  # where ckpt_path=last looks: Lightning would unpickle it
        (tmp_path / "run" / "checkpoints").mkdir(parents=True)
        path = path.rename(tmp_path / "run" / "checkpoints" / "last.ckpt")
    image = tmp_path / "digit.png"
    Image.new("L", (28, 28)).save(image)
    script, template = ENTRY_POINTS[entry_point]
    args = [arg.format(ckpt=path, image=image) for arg in template]
    if script == "train.py":
        result = run_train([*args, *FAST], tmp_path / "run", check=False)
    else:
        if script in HYDRA_APPS:
            args.append(f"hydra.run.dir={tmp_path / 'run'}")
        result = run_script(script, args, check=False)

    assert not marker.exists(), f"{script} {' '.join(args)} ran the checkpoint's pickled code"
    assert result.returncode != 0, f"{script} accepted {path}:\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, f"{script} crashed:\n{result.stderr[-3000:]}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"Refusing to load {path}" in errors[0], (
        f"{script} should print one 'Error: Refusing to load {path} ...' line, got:\n"
        f"{result.stderr[-2000:]}"
    )


@pytest.mark.parametrize(
    "target",
    ["builtins.open", "src.utils.files.write_atomically"],
    ids=["outside the template", "a function of the template"],
)
def test_a_checkpoint_config_cannot_name_a_callable_to_run(tmp_path, target):
    # Loads with weights_only=True (plain values only), yet names a callable to build.
    marker = tmp_path / "code-ran"
    path = tmp_path / "config.ckpt"
    arguments = {"file": str(marker), "mode": "w"} if target == "builtins.open" else {
        "path": str(marker), "write": "", "what": "payload"}  # fmt: skip
    model = {"_target_": target, **arguments}
    run_config = {"config": {"model": model, "data": {}}, "overrides": []}
    torch.save({"state_dict": {}, "run_config": run_config}, path)
    with pytest.raises(CheckpointError, match=f"Refusing to restore .*{target}"):
        restore(path)
    assert not marker.exists(), "restoring the checkpoint called the `_target_` its config names"


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


def test_a_save_removes_temporary_files_of_dead_processes_but_not_of_live_ones(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = tmp_path / f".last.ckpt.tmp-{dead}"
        in_progress = tmp_path / f".last.ckpt.tmp-{live.pid}"
        for path in (left, in_progress):
            path.write_bytes(b"partial")
        write_atomically(tmp_path / "last.ckpt", b"new")
        assert not left.exists(), "a dead process's leftover was kept"
        assert in_progress.read_bytes() == b"partial", "a live process's save was deleted"
        assert (tmp_path / "last.ckpt").read_bytes() == b"new"
    finally:
        live.kill()
        live.wait()
