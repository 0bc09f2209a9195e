"""Bad input to every entry point, run as a user runs it: one table, one row per mistake.

Each row runs the script as a user types it and checks what the error boundary promises
(src/utils/error_boundary.py): exit status 1, no traceback on the console, one last line
`Error: <what and what to do> (full traceback: <log>)` whose log holds the traceback, and every
file that was there before (the checkpoint, the user's inputs, an earlier export) unchanged.
train.py's own table, in-process, is tests/entry_points/test_bad_input.py.
"""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from src.models.language.qwen import QwenLM
from tests.entry_points.support import assert_unchanged, files_and_contents
from tests.helpers import FAST, ROOT, compose_config, run_script, tiny_config
from train import train


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A classifier checkpoint, a tiny language-model folder and an image, made once."""
    folder = tmp_path_factory.mktemp("inputs")
    run = [*FAST, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
    train(compose_config(folder / "run", run))
    QwenLM(tiny_config("qwen3")).save_pretrained(folder / "lm")
    (folder / "notes.txt").write_text("not an image\n")
    save_file({"fc1.weight": torch.zeros(4, 4)}, folder / "model.safetensors")
    return {
        "ckpt": folder / "run" / "checkpoints" / "last.ckpt",
        "lm": folder / "lm",
        "text": folder / "notes.txt",
        "weights": folder / "model.safetensors",
        "folder": folder,
    }


def cut_checkpoint(inputs, tmp_path) -> Path:
    whole = inputs["ckpt"].read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(whole[: len(whole) // 3])
    return tmp_path / "cut.ckpt"


def random_bytes(inputs, tmp_path) -> Path:
    (tmp_path / "noise.ckpt").write_bytes(bytes(range(256)) * 12)
    return tmp_path / "noise.ckpt"


def earlier_export(inputs, tmp_path) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"an earlier export")
    return tmp_path / "out"


# script, its arguments ({ckpt}, {lm}, {text}, {weights}, {tmp}, {made}: what `make` wrote),
# `make` (or None), words the one line must hold.
CASES = {
    # Hydra's refusals of the command line, each in one line (src/run/config/composition_errors.py)
    "an option a group lacks": (
        "train.py",
        ["model=resnet9000"],
        None,
        ["model has no option 'resnet9000': choose one of cnn,", "(closest: resnet18)"],
    ),
    "a mistyped key": (
        "train.py",
        ["trainer.max_epoch=3"],
        None,
        ["trainer.max_epoch is not a key of the config: did you mean trainer.max_epochs=3?"],
    ),
    "a key no config has": (
        "eval.py",
        ["ckpt_path={ckpt}", "trainer.zzzzzz=1"],
        None,
        ["trainer.zzzzzz is not a key of the config", "add it with +trainer.zzzzzz="],
    ),
    "an override Hydra cannot read": (
        "predict.py",
        ["ckpt_path={ckpt}", "data.batch_size=["],
        None,
        ["data.batch_size=[ is not an override Hydra can read", "quote the value"],
    ),
    "a config group set to null": (
        "train.py",
        ["experiment=lm_grpo", "reward=null"],
        None,
        ["reward=null: reward is a config group; choose one of its options: exact_match, "],
    ),
    "a chosen config group set to null": (
        "train.py",
        ["logger=null"],
        None,
        ["logger=null: logger is a config group", "tensorboard, wandb (logger=none leaves it out)"],
    ),
    "a learning-rate monitor without a logger": (
        "train.py",
        ["~logger"],
        None,
        ["callbacks.lr_monitor writes the learning rate to a logger, and this run has none"],
    ),
    "a list that could be a sweep": (
        "train.py",
        ["model=cnn,simplenet"],
        None,
        ["Ambiguous value for argument 'model=cnn,simplenet'", "--multirun"],
    ),
    "an argument the model does not take": (
        "train.py",
        ["+model.hidden=64"],
        None,
        ["model.hidden is not an argument of", "ImageClassifier", "remove it (~model.hidden)"],
    ),
    "an argument the optimizer does not take": (
        "train.py",
        ["+optimizer.lrr=0.1"],
        None,
        ["optimizer.lrr is not an argument of torch.optim.Adam", "did you mean optimizer.lr?"],
    ),
    "an export format that does not exist": (
        "scripts/export.py",
        ["ckpt_path={ckpt}", "format=onnx2"],
        None,
        ["format", "onnx2"],
    ),
    "eval without ckpt_path": ("eval.py", [], None, ["Required config value not set: ckpt_path"]),
    "eval on a missing file": (
        "eval.py",
        ["ckpt_path={tmp}/gone.ckpt"],
        None,
        ["ckpt_path='", "gone.ckpt' is not a file"],
    ),
    "eval on a folder": ("eval.py", ["ckpt_path={tmp}"], None, ["is not a file"]),
    "eval on random bytes": (
        "eval.py",
        ["ckpt_path={made}"],
        random_bytes,
        ["is not a PyTorch checkpoint"],
    ),
    "eval on a cut checkpoint": (
        "eval.py",
        ["ckpt_path={made}"],
        cut_checkpoint,
        ["cut.ckpt is not a readable checkpoint (truncated or corrupt"],
    ),
    "eval on a weights file": (
        "eval.py",
        ["ckpt_path={weights}"],
        None,
        ["safetensors weights file"],
    ),
    "eval with another model": (
        "eval.py",
        ["ckpt_path={ckpt}", "model=cnn"],
        None,
        ["model=cnn: a checkpoint's weights only fit the model"],
    ),
    "eval in batches of -1": (
        "eval.py",
        ["ckpt_path={ckpt}", "data.batch_size=-1"],
        None,
        ["data.batch_size must be a positive integer, got -1"],
    ),
    "eval at a misspelt precision": (
        "eval.py",
        ["ckpt_path={ckpt}", "trainer.precision=bf17"],
        None,
        ["expects one of", "Fix it with trainer.precision=bf16, say"],
    ),
    "predict without input": (
        "predict.py",
        ["ckpt_path={ckpt}"],
        None,
        ["Required config value not set: input"],
    ),
    "predict on a missing input": (
        "predict.py",
        ["ckpt_path={ckpt}", "input={tmp}/gone.png"],
        None,
        ["gone.png"],
    ),
    "predict on a text file": (
        "predict.py",
        ["ckpt_path={ckpt}", "input={text}"],
        None,
        ["notes.txt"],
    ),
    "predict on random bytes": (
        "predict.py",
        ["ckpt_path={made}", "input={text}"],
        random_bytes,
        ["is not a PyTorch checkpoint"],
    ),
    "export in an unknown format": (
        "scripts/export.py",
        ["ckpt_path={ckpt}", "format=onnx"],
        None,
        ["format='onnx' is not one of safetensors, state_dict, merged, peft"],
    ),
    "export into an earlier export": (
        "scripts/export.py",
        ["ckpt_path={ckpt}", "hydra.run.dir={made}"],
        earlier_export,
        ["overwrite=true"],
    ),
    "export a classifier for transformers": (
        "scripts/export.py",
        ["ckpt_path={ckpt}", "format=merged"],
        None,
        ["language model"],
    ),
    "export a classifier as peft": (
        "scripts/export.py",
        ["ckpt_path={ckpt}", "format=peft"],
        None,
        ["LoRA"],
    ),
    "export a cut checkpoint": (
        "scripts/export.py",
        ["ckpt_path={made}"],
        cut_checkpoint,
        ["truncated or corrupt"],
    ),
    "generate no tokens": (
        "scripts/generate.py",
        ["--hf", "{lm}", "--max-new-tokens", "0"],
        None,
        ["--max-new-tokens 0: give a whole number of at least 1"],
    ),
    "generate a negative number of samples": (
        "scripts/generate.py",
        ["--hf", "{lm}", "--num-samples", "-2"],
        None,
        ["--num-samples -2: give a whole number of at least 1"],
    ),
    "generate among the top 0": (
        "scripts/generate.py",
        ["--hf", "{lm}", "--top-k", "0"],
        None,
        ["--top-k 0: give a whole number of at least 1"],
    ),
    "generate at a negative temperature": (
        "scripts/generate.py",
        ["--hf", "{lm}", "--temperature", "-1"],
        None,
        ["--temperature -1.0: give 0 for greedy decoding or a positive value"],
    ),
    "generate from an empty prompt": (
        "scripts/generate.py",
        ["--hf", "{lm}", "--prompt", ""],
        None,
        ["--prompt encodes to no tokens"],
    ),
    "generate from a missing folder": (
        "scripts/generate.py",
        ["--hf", "{tmp}/no_model"],
        None,
        ["no_model"],
    ),
    "generate with a classifier": (
        "scripts/generate.py",
        ["--ckpt", "{ckpt}"],
        None,
        ["not of a language model", "predict.py ckpt_path="],
    ),
    "lm-eval on a negative limit": (
        "scripts/evaluate_lm.py",
        ["ckpt_path={ckpt}", "tasks=[sft_choice]", "limit=-5"],
        None,
        ["limit=-5: give at most how many examples per task"],
    ),
    "lm-eval with negative few-shot examples": (
        "scripts/evaluate_lm.py",
        ["ckpt_path={ckpt}", "tasks=[sft_choice]", "num_fewshot=-1"],
        None,
        ["num_fewshot=-1: give the number of examples shown before each question"],
    ),
    "lm-eval in batches of 0": (
        "scripts/evaluate_lm.py",
        ["ckpt_path={ckpt}", "tasks=[sft_choice]", "batch_size=0"],
        None,
        ["batch_size=0: give a whole number of at least 1, or auto"],
    ),
    "lm-eval on a missing checkpoint": (
        "scripts/evaluate_lm.py",
        ["ckpt_path={tmp}/gone.ckpt", "tasks=[sft_choice]"],
        None,
        ["gone.ckpt"],
    ),
    "train resuming a cut checkpoint": (
        "train.py",
        ["ckpt_path={made}", "trainer.max_epochs=1"],
        cut_checkpoint,
        ["truncated or corrupt"],
    ),
    "train from a missing pretrained file": (
        "train.py",
        ["model.pretrained={tmp}/gone.ckpt", "trainer.max_epochs=1"],
        None,
        ["gone.ckpt"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_entry_point_ends_a_mistake_in_one_line_naming_its_log(tmp_path, inputs, case):
    script, arguments, make, words = CASES[case]
    made = make(inputs, tmp_path) if make else None
    values = {key: value for key, value in inputs.items() if key != "folder"}
    args = [arg.format(**values, tmp=tmp_path, made=made) for arg in arguments]
    if script != "scripts/generate.py" and not any(a.startswith("hydra.run.dir") for a in args):
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    before = files_and_contents(tmp_path, inputs["folder"])

    result = run_script(script, args, check=False)

    assert result.returncode == 1, f"{case}: exit {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr + result.stdout, f"{case}: {result.stderr[-2000:]}"
    assert "HYDRA_FULL_ERROR" not in result.stderr, f"{case}: Hydra's own report: {result.stderr}"
    line = result.stderr.strip().splitlines()[-1]
    logged = re.fullmatch(r"Error: (.+) \(full traceback: (.+)\)", line)
    assert logged, f"{case}: not the boundary's line: {line}"
    for word in words:
        assert word in logged[1], f"{case}: {word!r} not in: {line}"
    assert "Traceback (most recent call last)" in (ROOT / logged[2]).read_text(), logged[2]
    assert_unchanged(before, tmp_path, inputs["folder"], case=case)
