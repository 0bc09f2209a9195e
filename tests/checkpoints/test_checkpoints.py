"""Checkpoints are written atomically, never run code when loaded, and `last.ckpt` is a
second name of the newest periodic checkpoint, not a second copy."""

import errno
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import hydra
import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from PIL import Image

from src.checkpoints import io as checkpoint_io
from src.checkpoints.io import save_atomically
from src.checkpoints.restore import restore
from src.run.resume import checked_ckpt_path
from src.run.trainer import build_trainer, plain_config
from src.utils import files
from src.utils.errors import CheckpointError
from src.utils.files import link_atomically, write_atomically
from src.utils.weights import load_checkpoint
from tests.helpers import (
    FAST,
    assert_same_tensors,
    compose_config,
    run_script,
    run_train,
)


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


@pytest.mark.slow
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
    expected = f"{script} should print one 'Error: Refusing to load {path} ...' line, got:\n"
    assert len(errors) == 1, f"{expected}{result.stderr[-2000:]}"
    assert f"Refusing to load {path}" in errors[0], f"{expected}{result.stderr[-2000:]}"


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


def write_forever(path: Path, saved) -> None:
    """Save a 16 MB checkpoint over and over, a new version each time; `saved` is set once the
    first save is complete."""
    version = 0
    while True:
        version += 1
        big = torch.full((4_000_000,), float(version))  # 16 MB: a save takes a while
        save_atomically({"version": version, "weights": big}, path)
        saved.set()


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    # Each writer is forked from the warm interpreters' server (tests/warm_interpreter.py), which
    # has imported torch and Lightning: it starts in a second where a fresh one takes several.
    processes = multiprocessing.get_context("forkserver")
    for delay in (0.9, 1.3, 1.7):
        saved = processes.Event()
        writer = processes.Process(target=write_forever, args=(path, saved))
        writer.start()
        assert saved.wait(timeout=300), "the writer completed no save"
        time.sleep(delay - 0.8)
        writer.kill()  # SIGKILL
        writer.join()
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


# -- last.ckpt: a link to the newest periodic checkpoint ----------------------------------------

STEPS_PER_EPOCH = 20  # digits: 1,280 training images in batches of 64


class RecordStartStep(Callback):
    """Remembers the step training started from: a resumed run starts past 0 (None: a fit
    resumed at its end trains nothing)."""

    step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def fit_digits(run_dir, overrides=(), ckpt_path=None):
    """A digits run fitted in this process; its trainer and the step it started from."""
    cfg = compose_config(run_dir, [*FAST, "logger=csv", "test=false", *overrides])
    trainer = build_trainer(cfg, run_config=(plain_config(cfg), []))
    start = RecordStartStep()
    trainer.callbacks.append(start)
    model, datamodule = hydra.utils.instantiate(cfg.model), hydra.utils.instantiate(cfg.data)
    trainer.fit(
        model, datamodule=datamodule, ckpt_path=checked_ckpt_path(ckpt_path, trainer, model)
    )
    return trainer, start.step


def step_files(folder):
    return sorted(path.name for path in folder.glob("step_*.ckpt"))


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """The checkpoint folder of a digits run of two epochs, one periodic checkpoint kept."""
    run_dir = tmp_path_factory.mktemp("run")
    fit_digits(run_dir, ["trainer.max_epochs=2"])
    return run_dir


def test_last_checkpoint_is_the_newest_step_file_under_a_second_name(two_epochs):
    folder = two_epochs / "checkpoints"
    newest = folder / f"step_{2 * STEPS_PER_EPOCH:08d}.ckpt"
    # The first epoch's step file was rotated out (save_top_k=1) after last.ckpt linked to it.
    assert step_files(folder) == [newest.name], step_files(folder)
    last = folder / "last.ckpt"
    assert last.samefile(newest), "last.ckpt is a separate copy of the newest step file"
    assert last.stat().st_nlink == 2
    loaded, expected = load_checkpoint(last), load_checkpoint(newest)
    assert loaded["global_step"] == 2 * STEPS_PER_EPOCH
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


def test_ckpt_path_last_resumes_from_the_linked_last_checkpoint(two_epochs, tmp_path):
    _trainer, start = fit_digits(two_epochs, ["trainer.max_epochs=3"], ckpt_path="last")
    assert start == 2 * STEPS_PER_EPOCH, f"resumed at step {start}"
    folder = two_epochs / "checkpoints"
    newest = folder / f"step_{3 * STEPS_PER_EPOCH:08d}.ckpt"
    assert step_files(folder) == [newest.name]
    assert (folder / "last.ckpt").samefile(newest)


def test_a_preemption_save_replaces_last_checkpoint_and_leaves_its_step_file(tmp_path):
    preempted_at = STEPS_PER_EPOCH + 5
    signaller = [
        "+callbacks.signal._target_=tests.helpers.SignalAtStep",
        f"+callbacks.signal.step={preempted_at}",
        "+callbacks.signal.name=SIGTERM",
    ]
    fit_digits(tmp_path, ["trainer.max_epochs=2", *signaller])
    folder = tmp_path / "checkpoints"
    step_file = folder / f"step_{STEPS_PER_EPOCH:08d}.ckpt"
    assert step_files(folder) == [step_file.name]
    assert not (folder / "last.ckpt").samefile(step_file)
    # Saved after the step the signal arrived in, or the next (callback order decides).
    saved_at = load_checkpoint(folder / "last.ckpt")["global_step"]
    assert preempted_at <= saved_at <= preempted_at + 1, f"last.ckpt at step {saved_at}"
    assert load_checkpoint(step_file)["global_step"] == STEPS_PER_EPOCH, "save went into it"


def test_relinking_last_checkpoint_never_writes_into_the_file_it_named(tmp_path):
    old, new, last = tmp_path / "step_1.ckpt", tmp_path / "step_2.ckpt", tmp_path / "last.ckpt"
    old.write_bytes(b"old state")
    new.write_bytes(b"new state")
    link_atomically(old, last)
    link_atomically(new, last)
    assert last.samefile(new)
    assert old.read_bytes() == b"old state"
    old.unlink()  # rotated out: last.ckpt never named it anyway, and a link never dangles
    save_atomically({"step": 3}, last)
    assert new.read_bytes() == b"new state", "an atomic save to last.ckpt wrote into step_2"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step_2.ckpt"]


def test_without_hard_links_last_checkpoint_is_a_copy(tmp_path, monkeypatch):
    def refuse(source, destination):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(files.os, "link", refuse)
    step, last = tmp_path / "step_1.ckpt", tmp_path / "last.ckpt"
    step.write_bytes(b"state")
    link_atomically(step, last)
    assert last.read_bytes() == b"state"
    assert not last.samefile(step)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step_1.ckpt"]


# -- the final state: every fit ends with it in last.ckpt ----------------------------------------

EVERY_3_STEPS = [
    "trainer.max_epochs=2",
    "callbacks.last_checkpoint.every_n_train_steps=3",
    "callbacks.last_checkpoint.every_n_epochs=null",
]  # saves at steps 3, 6, ..., 39 of 40: the interval misses the last


def checkpoint_files(folder):
    """Every name in a checkpoint folder (hidden ones included), and the step of last.ckpt."""
    names = sorted(path.name for path in folder.iterdir())
    return names, load_checkpoint(folder / "last.ckpt")["global_step"]


def seeded_fit(run_dir, overrides):
    """`fit_digits` from the weights every run of these tests starts from."""
    seed_everything(0)
    return fit_digits(run_dir, overrides)


def assert_same_network(expected, checkpoint):
    for name, tensor in expected["state_dict"].items():
        if name.startswith("net."):
            assert torch.equal(checkpoint["state_dict"][name], tensor), f"{name} differs"


@pytest.fixture(scope="module")
def every_3_steps(tmp_path_factory):
    """The checkpoint folder of an uninterrupted digits run of 40 steps saving every 3."""
    run_dir = tmp_path_factory.mktemp("every_3")
    seeded_fit(run_dir, EVERY_3_STEPS)
    return run_dir / "checkpoints"


def test_last_checkpoint_holds_the_final_step_though_the_interval_misses_it(every_3_steps):
    final = every_3_steps / f"step_{2 * STEPS_PER_EPOCH:08d}.ckpt"
    names, step = checkpoint_files(every_3_steps)
    # Relinked after every validation, last.ckpt leaves no temporary link behind.
    assert names == ["epoch_001.ckpt", "last.ckpt", final.name], names
    assert step == 2 * STEPS_PER_EPOCH
    assert (every_3_steps / "last.ckpt").samefile(final)


@pytest.mark.parametrize("signalled_at", [25, 39], ids=["mid-epoch", "before the last step"])
def test_a_run_preempted_and_resumed_ends_with_the_uninterrupted_runs_checkpoints(
    every_3_steps, tmp_path, signalled_at
):
    signaller = [
        "+callbacks.signal._target_=tests.helpers.SignalAtStep",
        f"+callbacks.signal.step={signalled_at}",
        "+callbacks.signal.name=SIGTERM",
    ]
    trainer, _ = seeded_fit(tmp_path, [*EVERY_3_STEPS, *signaller])
    assert trainer.global_step == signalled_at + 1, "the signal did not stop the run"
    fit_digits(tmp_path, EVERY_3_STEPS, ckpt_path="last")
    folder = tmp_path / "checkpoints"
    assert checkpoint_files(folder) == checkpoint_files(every_3_steps)
    expected = load_checkpoint(every_3_steps / "last.ckpt")
    assert_same_network(expected, load_checkpoint(folder / "last.ckpt"))


def test_a_fit_continued_from_its_final_checkpoint_trains_as_one_longer_fit(
    every_3_steps, tmp_path
):
    seeded_fit(tmp_path, [*EVERY_3_STEPS, "trainer.max_epochs=1"])  # ends on step 20, not 18
    _, start = fit_digits(tmp_path, EVERY_3_STEPS, ckpt_path="last")
    assert start == STEPS_PER_EPOCH, f"resumed at step {start}"
    expected = load_checkpoint(every_3_steps / "last.ckpt")
    continued = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert continued["global_step"] == expected["global_step"]
    assert_same_network(expected, continued)
    assert_same_tensors(expected["optimizer_states"], continued["optimizer_states"], "optimizer")
