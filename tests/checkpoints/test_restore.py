"""restore(): a run rebuilt from its checkpoint alone, as the run had it; old checkpoints too."""

import inspect
import logging
import shutil
import stat
from typing import ClassVar

import pytest
import torch
from lightning.pytorch import Callback

from eval import evaluate
from scripts.generate import main as generate_main
from src.checkpoints.restore import restore
from src.data.corpus.tokenizers import ByteTokenizer, build_tokenizer, tokenizer_state
from src.data.text.pretraining import TextDataModule
from src.models.language.language_model import LanguageModel
from src.utils.errors import CheckpointError, ConfigError
from tests.helpers import (
    FAST,
    TINY_LM,
    compose_config,
    run_script,
    shakespeare_excerpt,
    text_lm_overrides,
)
from train import train


class KeepTrainedModule(Callback):
    """Keeps the module and its tokenizer as training left them (last.ckpt holds the same)."""

    trained: ClassVar[dict] = {}

    def on_train_end(self, trainer, pl_module):
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        KeepTrainedModule.trained = {"module": pl_module, "tokenizer": tokenizer}


KEEP = f"+callbacks.keep={{_target_: {__name__}.KeepTrainedModule}}"


def logits(module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module.eval()(inputs)


def resave(checkpoint: dict, path) -> str:
    torch.save(checkpoint, path)
    return str(path)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default classifier trained one epoch on the embedded digits: (last.ckpt, module)."""
    run_dir = tmp_path_factory.mktemp("digits")
    train(compose_config(run_dir, [*FAST, "test=false", KEEP]))
    return run_dir / "checkpoints" / "last.ckpt", KeepTrainedModule.trained["module"]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A tiny LM trained on Shakespeare with a BPE trained in the run; the run's tokenizer/
    folder is then moved away and the tokenizer cache deleted, so only the checkpoint has it.
    (last.ckpt, the trained module, its tokenizer, the moved tokenizer folder)."""
    root = tmp_path_factory.mktemp("bpe")
    overrides = [
        *FAST,
        *TINY_LM,
        *text_lm_overrides(shakespeare_excerpt(root, 20_000)),
        "data.tokenizer.kind=bpe",
        "data.tokenizer.vocab_size=300",
        "model.config.vocab_size=320",
        "data.max_seq_len=64",
        "data.batch_size=4",
        f"data.cache_dir={root / 'cache'}",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "test=false",
        KEEP,
    ]
    train(compose_config(root / "run", overrides))
    saved = root / "saved_tokenizer"
    shutil.move(root / "run" / "tokenizer", saved)
    shutil.rmtree(root / "cache")
    trained = KeepTrainedModule.trained
    return (
        root / "run" / "checkpoints" / "last.ckpt",
        trained["module"],
        trained["tokenizer"],
        saved,
    )


def test_a_restored_classifier_gives_the_trained_modules_logits(digits_run):
    last, trained = digits_run
    restored = restore(last)
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    assert not restored.model.training
    assert torch.equal(logits(restored.model, images), logits(trained, images)), "logits differ"
    assert restored.tokenizer is None
    assert type(restored.model.net) is type(trained.net)


def test_a_restored_lm_has_the_trained_logits_and_the_bpe_without_the_run_folder(bpe_run):
    last, trained, tokenizer, _ = bpe_run
    restored = restore(last)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(restored.model, ids), logits(trained, ids)), "logits differ"
    assert restored.tokenizer.fingerprint == tokenizer.fingerprint, "another tokenizer came back"
    assert restored.datamodule.tokenizer is restored.tokenizer
    assert restored.tokenizer.vocab_size == 300
    # generate.py decodes with it too, the run's tokenizer/ folder being gone.
    (text,) = generate_main(["--ckpt", str(last), "--prompt", "ROMEO:", "--max-new-tokens", "3"])
    assert text.startswith("ROMEO:"), text


@pytest.mark.slow
def test_export_writes_the_tokenizer_next_to_the_weights(bpe_run, tmp_path):
    last, _, tokenizer, _ = bpe_run
    run_script("scripts/export.py", [f"ckpt_path={last}", f"hydra.run.dir={tmp_path}"])
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "config.yaml").is_file()
    exported = build_tokenizer("pretrained", path=str(tmp_path / "tokenizer"))
    assert exported.fingerprint == tokenizer.fingerprint, "the exported tokenizer differs"


def test_an_export_into_a_folder_holding_an_earlier_one_is_refused_unless_overwrite(
    digits_run, tmp_path
):
    last, _ = digits_run
    folder = tmp_path / "export"

    def export_into_folder(*overrides, check=True):
        args = [f"ckpt_path={last}", f"hydra.run.dir={folder}", *overrides]
        return run_script("scripts/export.py", args, check=check)

    export_into_folder()
    earlier = (folder / "model.safetensors").stat()
    refused = export_into_folder("format=state_dict", check=False)
    assert refused.returncode == 1, refused.stderr[-2000:]
    last_line = refused.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        f"Error: {folder} already holds an export (config.yaml, model.safetensors)"
    ), last_line
    assert "overwrite=true" in last_line, last_line
    assert not (folder / "model.pt").exists()
    assert (folder / "model.safetensors").stat().st_ino == earlier.st_ino, "it was replaced"

    export_into_folder("overwrite=true")
    assert (folder / "model.safetensors").stat().st_ino != earlier.st_ino, "not written over"
    with (tmp_path / "plain").open("w"):
        plain_mode = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    files = [path for path in folder.iterdir() if path.is_file()]
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in files}
    assert set(modes.values()) == {plain_mode}, f"{modes}, not all {plain_mode:o}"


def test_overrides_change_keys_of_the_stored_config(digits_run):
    last, _ = digits_run
    restored = restore(last, ["data.batch_size=3", "+data.eval_batch_size=7"])
    assert restored.config.data.batch_size == 3 == restored.datamodule.batch_size
    assert restored.datamodule.eval_batch_size == 7
    with pytest.raises(ConfigError, match=r"data\.batch_sise is not in the checkpoint's config"):
        restore(last, ["data.batch_sise=3"])
    with pytest.raises(CheckpointError, match=r"do not fit .*shape mismatch"):
        restore(last, ["model.net.hidden_size=16"])


@pytest.mark.parametrize("override", ["model=cnn", "data=mnist"])
def test_choosing_a_config_group_again_is_refused(digits_run, override):
    with pytest.raises(ConfigError, match=f"{override}: a checkpoint's weights only fit"):
        restore(digits_run[0], [override])


def test_eval_applies_key_overrides_and_refuses_group_choices(digits_run, tmp_path):
    last = digits_run[0]
    batched_by_5 = evaluate(
        compose_config(tmp_path / "a", [f"ckpt_path={last}", "data.batch_size=5"], "eval")
    )
    as_trained = evaluate(compose_config(tmp_path / "c", [f"ckpt_path={last}"], "eval"))
    # The batch size changes how the test split is cut, not what the model scores on it.
    accuracy = as_trained["metrics"]["test/acc"]
    assert batched_by_5["metrics"]["test/acc"] == pytest.approx(accuracy, abs=1e-6)
    assert accuracy > 0.3, "a trained digits classifier scores far above chance (0.1)"
    with pytest.raises(ConfigError, match="model=cnn: a checkpoint's weights only fit"):
        evaluate(compose_config(tmp_path / "b", [f"ckpt_path={last}", "model=cnn"], "eval"))


def test_an_old_checkpoint_with_retired_model_keys_and_no_optimizer_restores(
    digits_run, tmp_path, caplog
):
    last, trained = digits_run
    checkpoint = torch.load(last, weights_only=True)
    model = checkpoint["run_config"]["config"]["model"]
    del model["optimizer"]  # not needed for inference
    model |= {"lr": 0.001, "retired_option": 1}
    with caplog.at_level(logging.WARNING):
        restored = restore(resave(checkpoint, tmp_path / "old.ckpt"))
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(restored.model, images), logits(trained, images)), "logits differ"
    assert "no longer takes, left out: lr, retired_option" in caplog.text


def test_a_checkpoint_naming_modules_from_before_the_regrouping_restores(digits_run, tmp_path):
    last, trained = digits_run
    checkpoint = torch.load(last, weights_only=True)
    config = checkpoint["run_config"]["config"]
    assert config["model"]["net"]["_target_"].startswith("src.models.vision."), config["model"]
    # As written before src/models and src/data were grouped by domain.
    config["model"]["_target_"] = "src.models.classifier.ImageClassifier"
    config["model"]["net"]["_target_"] = config["model"]["net"]["_target_"].replace(".vision", "")
    config["data"]["_target_"] = "src.data.digits.DigitsDataModule"
    restored = restore(resave(checkpoint, tmp_path / "old.ckpt"))
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(restored.model, images), logits(trained, images)), "logits differ"


def test_an_old_byte_level_lm_checkpoint_restores_with_bytes(bpe_run, tmp_path, caplog):
    last, trained, _, _ = bpe_run
    # As a run with the byte tokenizer wrote it before tokenizers were kept in checkpoints.
    checkpoint = torch.load(last, weights_only=True)
    del checkpoint[TextDataModule.__qualname__]["tokenizer"]
    checkpoint["run_config"]["config"]["data"]["tokenizer"]["kind"] = "byte"
    model = checkpoint["run_config"]["config"]["model"]
    model |= {"lr": 0.001, "retired_option": 1}
    with caplog.at_level(logging.WARNING):
        restored = restore(resave(checkpoint, tmp_path / "old.ckpt"))
    assert isinstance(restored.tokenizer, ByteTokenizer)
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(restored.model, ids), logits(trained, ids)), "logits differ"
    takes = inspect.signature(LanguageModel).parameters
    retired = [key for key in model if not key.startswith("_") and key not in takes]
    assert "retired_option" in retired
    assert f"left out: {', '.join(retired)}" in caplog.text


def test_an_old_bpe_checkpoint_names_the_tokenizer_folder_to_pass(bpe_run, tmp_path):
    last, _trained, tokenizer, saved = bpe_run
    checkpoint = torch.load(last, weights_only=True)
    del checkpoint[TextDataModule.__qualname__]["tokenizer"]
    old = resave(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(CheckpointError, match=r"predates tokenizers in checkpoints.*tokenizer/"):
        restore(old)
    with pytest.raises(SystemExit, match="--tokenizer <run dir>/tokenizer"):
        generate_main(["--ckpt", old, "--prompt", "ROMEO:", "--max-new-tokens", "3"])
    # The remedies the message names: the folder as an override, or generate.py's --tokenizer.
    pretrained = ["data.tokenizer.kind=pretrained", f"data.tokenizer.path={saved}"]
    assert restore(old, pretrained).tokenizer.fingerprint == tokenizer.fingerprint
    args = ["--ckpt", old, "--tokenizer", str(saved), "--prompt", "ROMEO:", "--max-new-tokens", "3"]
    (text,) = generate_main(args)
    assert text.startswith("ROMEO:"), text


def test_a_resumed_text_datamodule_tokenises_with_the_checkpoints_tokenizer(tmp_path):
    """Lightning sets a datamodule up before it loads the checkpoint's state: a different
    tokenizer built by setup is replaced, and the documents tokenised again with the stored
    one, exactly as a datamodule given that state before setup tokenises them."""
    corpus = shakespeare_excerpt(tmp_path, 20_000)

    def module(vocab_size: int) -> TextDataModule:
        options = {"kind": "bpe", "vocab_size": vocab_size}
        return TextDataModule(paths=[str(corpus)], max_seq_len=64, tokenizer=options)

    trained = module(300)
    trained.setup()
    state = trained.state_dict()
    assert state == {"tokenizer": tokenizer_state(trained.tokenizer)}

    resumed = module(280)  # setup trains another BPE
    resumed.setup()
    resumed.load_state_dict(state)
    restored = module(280)  # restore() loads the state first: no BPE is trained
    restored.load_state_dict(state)
    restored.setup()
    for datamodule in (resumed, restored):
        assert datamodule.tokenizer.fingerprint == trained.tokenizer.fingerprint
        for got, expected in zip(
            datamodule.datasets["train"].samples, trained.datasets["train"].samples, strict=True
        ):
            assert torch.equal(got.tokens, expected.tokens), "tokenised with another tokenizer"
