"""A monitored metric that nothing logs is refused before training, with the closest key."""

import pytest

import train as train_module
from src.run.metric_keys import declared_metric_keys
from src.utils.errors import ConfigError
from tests.helpers import FAST, TINY_LM, compose_config, shakespeare_excerpt, text_lm_overrides
from train import train

STEPS = [
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
]
# The namespaces the model and the exact-match callback declare; Lightning's and the
# throughput callback's keys (lr-Adam, perf/...) are not theirs.
DECLARED_NAMESPACES = ("train/", "val/", "test/", "moe/")


def lm_run(tmp_path, *model):
    corpus = shakespeare_excerpt(tmp_path, 20_000)
    return [*model, *text_lm_overrides(corpus), "data.batch_size=2", "trainer.limit_test_batches=2"]


@pytest.mark.parametrize(
    "run",
    [
        lambda tmp_path: [],
        lambda tmp_path: lm_run(tmp_path, *TINY_LM),
        lambda tmp_path: lm_run(tmp_path, "model=qwen3_moe_tiny"),
    ],
    ids=["classifier", "dense LM", "mixture-of-experts LM"],
)
def test_a_model_declares_exactly_the_metrics_a_run_logs(tmp_path, monkeypatch, run):
    declared = {}

    def keep_declared(cfg, model, datamodule, callbacks):
        declared["keys"] = declared_metric_keys(model, datamodule, callbacks)

    monkeypatch.setattr(train_module, "check_metric_keys", keep_declared)
    record = train(compose_config(tmp_path / "run", [*FAST, *STEPS, *run(tmp_path)]))
    logged = {key for key in record["metrics"] if key.startswith(DECLARED_NAMESPACES)}
    assert logged <= declared["keys"], "logs a metric it does not declare"
    # Sent by expert parallelism's all-to-alls only, which a one-process run has none of.
    unlogged = {"moe/dispatched_bytes"} if "moe/load_max_over_mean" in logged else set()
    assert declared["keys"] - logged == unlogged


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (
            "optimized_metric=val/acc_bset",
            "optimized_metric='val/acc_bset' is not a metric this "
            "run logs: did you mean optimized_metric=val/acc_best?",
        ),
        (
            "callbacks.model_checkpoint.monitor=val_acc",
            "did you mean callbacks.model_checkpoint.monitor=val/acc?",
        ),
        (
            "callbacks.early_stopping.monitor=val/accuracy",
            "did you mean callbacks.early_stopping.monitor=val/acc?",
        ),
    ],
    ids=["a typo of the sweep's metric", "Lightning's old key style", "a name of another library"],
)
def test_a_monitored_metric_nothing_logs_is_refused_before_training(tmp_path, override, words):
    cfg = compose_config(tmp_path, [*FAST, *STEPS, "callbacks=[default,early_stopping]", override])
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    assert words in str(refused.value), refused.value
    assert "val/loss" in str(refused.value), "the keys the run logs are listed"
    assert not (tmp_path / "checkpoints").exists(), "training started"


@pytest.mark.parametrize("monitor", ["lr-Adam", "step", "perf/time_to_first_step_s"])
def test_keys_that_other_loggers_log_are_not_refused(tmp_path, monitor):
    cfg = compose_config(
        tmp_path, [*FAST, *STEPS, f"callbacks.model_checkpoint.monitor={monitor}", "test=false"]
    )
    assert train(cfg)["metrics"]
