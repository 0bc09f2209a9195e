"""Learning-rate scaling with the effective batch (`+optimizer.scale_lr`)."""

import logging
import math

import hydra
import pytest

from src.run.lr_scaling import apply_lr_scaling, devices_per_node, scaled_lr
from src.utils.errors import ConfigError
from tests.helpers import compose_config

SCALING = ["+optimizer.scale_lr=linear", "+optimizer.reference_batch_size=64"]


@pytest.mark.parametrize(
    ("batch", "rule", "expected"),
    [(128, "linear", 2e-3), (32, "linear", 5e-4), (256, "sqrt", 2e-3), (64, "sqrt", 1e-3)],
)
def test_scaled_lr_follows_the_rule(batch, rule, expected):
    assert math.isclose(scaled_lr(1e-3, batch, 64, rule), expected)


@pytest.mark.parametrize(
    ("devices", "accelerator", "expected"),
    [(4, "gpu", 4), ("2", "cpu", 2), ([0, 2], "gpu", 2), ("0,1,3", "gpu", 3), ("auto", "cpu", 1)],
)
def test_devices_per_node_reads_every_form_of_trainer_devices(devices, accelerator, expected):
    assert devices_per_node(devices, accelerator) == expected


def test_a_composed_config_scales_the_optimizer_lr_and_hides_the_keys_from_it(tmp_path, caplog):
    overrides = [
        *SCALING,
        "optimizer=sgd",
        "data.batch_size=32",
        "trainer=ddp_cpu",
        "trainer.num_nodes=2",
        "trainer.accumulate_grad_batches=3",
    ]
    cfg = compose_config(tmp_path, overrides)
    with caplog.at_level(logging.INFO, logger="src.run.lr_scaling"):
        apply_lr_scaling(cfg)
    assert math.isclose(cfg.optimizer.lr, 0.01 * 384 / 64)
    assert "optimizer.lr 0.01 scaled to 0.06 for effective batch 384 (reference 64, linear)" in (
        caplog.text
    )
    optimizer = hydra.utils.instantiate(cfg.model).configure_optimizers()  # no unknown keys
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.06)


def test_the_language_model_lr_is_scaled_in_the_optimizer_config_like_any_other(tmp_path):
    cfg = compose_config(
        tmp_path, ["experiment=lm_shakespeare", "+optimizer.scale_lr=sqrt", SCALING[1]]
    )
    apply_lr_scaling(cfg)  # lm_shakespeare: batch 16 on one device, optimizer=adamw_lm at 2e-3
    scaled = 2e-3 * math.sqrt(16 / 64)
    assert math.isclose(cfg.optimizer.lr, scaled)
    assert "scale_lr" not in cfg.optimizer
    assert "lr" not in cfg.model, "the LM has no learning rate of its own"
    configured = hydra.utils.instantiate(cfg.model).configure_optimizers()
    assert configured["lr_scheduler"]["scheduler"].base_lrs == pytest.approx([scaled, scaled])


def test_without_scale_lr_nothing_changes(tmp_path):
    cfg = compose_config(tmp_path, ["+optimizer.reference_batch_size=64", "data.batch_size=128"])
    apply_lr_scaling(cfg)
    assert cfg.optimizer.lr == 1e-3
    assert "reference_batch_size" not in cfg.optimizer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+optimizer.scale_lr=cubic", SCALING[1]], "is not a rule"),
        ([SCALING[0]], "+optimizer.reference_batch_size=<int>"),
    ],
)
def test_a_wrong_scaling_config_says_what_to_set(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        apply_lr_scaling(compose_config(tmp_path, overrides))
