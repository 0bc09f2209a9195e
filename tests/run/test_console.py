"""The console of a run: Lightning's tips and repeats off (but in the log file), one model
summary, the config tree printed and saved, and a `--help` of the options a user picks."""

import io
import logging
import re
import warnings

import pytest
from hydra import compose, initialize_config_dir
from lightning.fabric.utilities.warnings import PossibleUserWarning

from src.run import console
from tests.helpers import ROOT, run_train

SHORT_RUN = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "logger=none"]
LIGHTNING_TABLE = re.compile(r"\|\s*Name\s*\|\s*Type\s*\|\s*Params")  # ModelSummary's header


def record(message: str, name: str = "lightning.pytorch.utilities.rank_zero", **extra):
    return logging.makeLogRecord({"name": name, "msg": message, "levelno": logging.INFO, **extra})


@pytest.mark.parametrize(
    "dropped",
    [
        record("💡 Tip: For seamless cloud logging and experiment tracking, try litlogger"),
        record("Seed set to 42", name="lightning.fabric.utilities.seed"),
        record("GPU available: True (cuda), used: True"),
        record("LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]"),
        record("Restoring states from the checkpoint path at /run/checkpoints/epoch_000.ckpt"),
        record("\n  | Name | Type | Params", name="lightning.pytorch.callbacks.model_summary"),
        record(
            "_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, use ...",
            name="py.warnings",
            category=FutureWarning,
        ),
        *[
            record(f"{file}: {message}", name="py.warnings", category=UserWarning)
            for file, message in [
                (
                    "data_connector.py:378",
                    "You have overridden `on_before_batch_transfer` in `LightningModule` but "
                    "have passed in a `LightningDataModule`.",
                ),
                ("data.py:123", "Your `IterableDataset` has `__len__` defined. In combination"),
                ("model_checkpoint.py:881", "Checkpoint directory /r/c exists and is not empty."),
                (
                    "result.py:433",
                    "It is recommended to use `self.log('perf/mfu', ..., sync_dist=True)` when "
                    "logging on epoch level in distributed setting",
                ),
            ]
        ],
    ],
    ids=[
        "tip",
        "seed",
        "devices",
        "local rank",
        "restoring",
        "lightning summary",
        "torch",
        "batch transfer hook",
        "stream length",
        "resumed folder",
        "per-rank throughput",
    ],
)
def test_quiet_console_drops_lightning_tips_repeats_and_library_warnings(dropped):
    assert not console.QuietConsole().filter(dropped), dropped.getMessage()


@pytest.mark.parametrize(
    "kept",
    [
        record("`Trainer.fit` stopped: `max_epochs=1` reached."),
        record("Loaded model weights from the checkpoint at /run/checkpoints/epoch_000.ckpt"),
        record("Effective batch: 64 samples per optimizer step"),
        record(
            "The 'train_dataloader' does not have many workers which may be a bottleneck.",
            name="py.warnings",
            category=PossibleUserWarning,
        ),
        record(
            "`trainer.some_flag` is deprecated, use `trainer.other_flag`",
            name="py.warnings",
            category=FutureWarning,
        ),
        record(  # the library's message text, but not the library's kind of warning
            "`isinstance(treespec, LeafSpec)` is deprecated",
            name="py.warnings",
            category=UserWarning,
        ),
        record(  # the user's own metric, which may need syncing across ranks
            "It is recommended to use `self.log('val/f1', ..., sync_dist=True)`",
            name="py.warnings",
            category=UserWarning,
        ),
    ],
    ids=[
        "fit stopped",
        "loaded weights",
        "own notice",
        "loader bottleneck",
        "config",
        "category",
        "user metric sync",
    ],
)
def test_quiet_console_keeps_what_a_user_acts_on(kept):
    assert console.QuietConsole().filter(kept), kept.getMessage()


@pytest.fixture
def console_loggers(monkeypatch):
    """Lightning's loggers and `warnings.showwarning` restored after the test."""
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    loggers = [logging.getLogger(name) for name in console.CONSOLE_LOGGERS]
    saved = [(lg, list(lg.handlers), lg.propagate, lg.level) for lg in loggers]
    yield loggers
    for logger, handlers, propagate, level in saved:
        logger.handlers[:] = handlers
        logger.propagate, logger.level = propagate, level


def test_quiet_console_hides_a_tip_that_the_log_file_still_gets(tmp_path, console_loggers):
    log_file = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(log_file)
    try:
        console.set_up_console(quiet=True)
        screen = io.StringIO()
        for logger in console_loggers:
            for handler in logger.handlers:
                if type(handler) is logging.StreamHandler:
                    handler.setStream(screen)
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        rank_zero.info("💡 Tip: try a cloud service")
        rank_zero.info("`Trainer.fit` stopped: `max_epochs=1` reached.")
        warnings.showwarning(
            PossibleUserWarning("few workers: a bottleneck"), PossibleUserWarning, "x.py", 1
        )
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    logged = (tmp_path / "train.log").read_text()
    assert "Tip" not in screen.getvalue()
    assert "Tip" in logged
    for line in ("`Trainer.fit` stopped", "a bottleneck"):
        assert line in screen.getvalue(), line
        assert line in logged, line


def help_of(config_name: str) -> str:
    """What `python <entry point> --help` prints: the help template Hydra fills in."""
    console.register_help_resolver(ROOT / "conf")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, return_hydra_config=True)
        return cfg.hydra.help.template


def options_of(help_text: str, group: str) -> list[str]:
    section = help_text.split(f"\n{group} (now:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^  (\S+)  ", section, flags=re.MULTILINE)


def test_help_lists_the_callbacks_a_user_picks_not_the_pieces_of_default():
    text = help_of("train")
    options = options_of(text, "callbacks")
    assert {"default", "none", "early_stopping", "ema"} <= set(options), options
    assert not {"rng_state", "finite_check", "model_checkpoint", "plots"} & set(options), options
    assert "callbacks.<name>=null" in text  # how to turn one off
    assert "+group=option" in text
    assert re.search(r"^tune\n  lr_find ", text, flags=re.MULTILINE)


def test_help_of_predict_lists_no_training_groups_and_its_own_settings():
    text = help_of("predict")
    assert "model (now:" not in text
    assert "callbacks" not in text
    assert "compile" not in text
    assert "top_k: 3" in text
    assert "input: ???" in text


@pytest.mark.slow
def test_a_run_prints_one_summary_and_the_config_tree_but_no_tips(tmp_path):
    result = run_train(SHORT_RUN, tmp_path)
    shown = result.stdout + result.stderr
    assert "💡 Tip" not in shown
    assert "Seed set to" not in shown
    assert "Layer summary" in shown
    assert not LIGHTNING_TABLE.search(shown)
    assert "Config (all of it:" in shown
    assert "model: simplenet" in shown
    assert "max_epochs: 1" in (tmp_path / "config_tree.txt").read_text()
    logged = (tmp_path / "train.log").read_text()
    assert "💡 Tip" in logged
    assert LIGHTNING_TABLE.search(logged)
    assert "Seed set to 42" in logged


@pytest.mark.slow
def test_extras_quiet_false_shows_the_tips_and_both_summaries(tmp_path):
    result = run_train([*SHORT_RUN, "extras.quiet=false"], tmp_path)
    shown = result.stdout + result.stderr
    assert "💡 Tip" in shown
    assert "Layer summary" in shown
    assert LIGHTNING_TABLE.search(shown)


@pytest.mark.slow
def test_help_from_the_command_line_lists_options_and_hydra_help_still_works():
    shown = run_train(["--help"]).stdout
    assert "callbacks (now: default)" in shown
    assert "  none  " in shown
    assert "rng_state  " not in shown
    assert "== Flags ==" in run_train(["--hydra-help"]).stdout
