"""`python train.py experiment=lm_dpo`: preference tuning from the command line logs TRL's
metrics under train/, val/ and test/, holds its reference as the objective says (a frozen copy
in checkpoints, the base under LoRA, or values precomputed beside the token store), and a run
killed mid-training resumes exactly."""

import json

import pytest

from eval import evaluate
from src.models.language.preference.objective import PAIR_METRICS
from tests.helpers import (
    FOUR_LM_STEPS,
    RESUMABLE_EVERY_STEP,
    assert_same_tensors,
    compose_config,
    killed_run,
    trained_state,
)
from tests.models.support import save_tiny_base


def dpo_run(tmp_path, *extra: str) -> list[str]:
    """A few steps of DPO on a small synthetic preference set, with a tiny model."""
    return [
        "experiment=lm_dpo",
        "data.synthetic_count=160",
        "data.max_seq_len=64",
        "data.batch_size=4",
        f"data.cache_dir={tmp_path / 'cache'}",
        *FOUR_LM_STEPS,
        *extra,
    ]


@pytest.fixture(scope="module")
def frozen_copy_run(tmp_path_factory):
    """A DPO run against a frozen copy of the model: its run folder and final state."""
    run_dir = tmp_path_factory.mktemp("frozen_copy")
    return run_dir, trained_state(dpo_run(run_dir), run_dir)


def test_lm_dpo_trains_and_logs_trl_metrics_under_train_val_and_test(frozen_copy_run):
    tmp_path, (checkpoint, metrics) = frozen_copy_run
    for stage in ("train", "val", "test"):
        missing = [m for m in ("loss", *PAIR_METRICS) if f"{stage}/{m}" not in metrics]
        assert not missing, f"{stage}: {missing} not in {sorted(metrics)}"
    assert 0 <= metrics["val/rewards/accuracies"] <= 1
    assert metrics["val/acc_best"] >= metrics["val/rewards/accuracies"]
    margins = metrics["val/rewards/chosen"] - metrics["val/rewards/rejected"]
    assert metrics["val/rewards/margins"] == pytest.approx(margins, abs=1e-5)
    report = json.loads((tmp_path / "data_report.json").read_text())
    assert (
        report["data/tokens_input"] == report["data/tokens_kept"] + report["data/tokens_truncated"]
    )
    reference = {k for k in checkpoint["state_dict"] if k.startswith("objective.reference.net.")}
    assert reference, "the frozen copy is not in the checkpoint"


def test_precomputed_reference_values_train_and_test_as_the_frozen_copy_does(
    tmp_path, frozen_copy_run
):
    """The values computed before training serve the test after it too, not values of the
    trained weights: the metrics are the frozen copy's, to rounding."""
    checkpoint, metrics = trained_state(
        dpo_run(tmp_path, "data.precompute_ref_logps=true"), tmp_path
    )
    assert not [k for k in checkpoint["state_dict"] if k.startswith("objective.reference.net.")]
    assert checkpoint["state_dict"]["objective.reference.weights_key"].any(), "no reference named"
    assert len(list((tmp_path / "cache").glob("store-*/ref-logps-*.bin"))) == 1
    expected = frozen_copy_run[1][1]
    for key in ("train/loss", "val/rewards/margins", "test/rewards/chosen", "test/loss"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-4), key
    best = json.loads((tmp_path / "metrics.json").read_text())["best_model_path"]
    evaluated = evaluate(compose_config(tmp_path / "eval", [f"ckpt_path={best}"], "eval"))
    assert evaluated["metrics"]["test/rewards/chosen"] == metrics["test/rewards/chosen"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """TINY_LM's network with random weights, as a transformers folder."""
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("precomputed", [False, True], ids=["adapters off", "precomputed"])
def test_a_lora_run_compares_with_its_base_and_keeps_no_copy(tmp_path, tiny_base, precomputed):
    run = dpo_run(
        tmp_path,
        "adapter=lora",
        f"model.pretrained={tiny_base}",
        "test=false",
        f"data.precompute_ref_logps={str(precomputed).lower()}",
    )
    checkpoint, metrics = trained_state(run, tmp_path)
    assert not [k for k in checkpoint["state_dict"] if k.startswith("objective.reference.net.")]
    assert metrics["val/rewards/margins"] != 0, "the adapters moved no reward off the base's"


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["frozen copy", "precomputed"])
def test_a_dpo_run_killed_mid_training_resumes_exactly(tmp_path, reference):
    """As tests/checkpoints/test_resume.py; the precomputed values are found again, not redone."""
    run = dpo_run(
        tmp_path,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        *RESUMABLE_EVERY_STEP,
        *(["data.precompute_ref_logps=true"] if reference == "precomputed" else []),
    )
    expected_checkpoint, expected_metrics = trained_state(run, tmp_path / "whole")
    # Killed after step 5, it resumes from step 4: after the validation of step 3.
    last = killed_run(run, tmp_path / "killed", kill_step=5)
    stored = sorted((tmp_path / "cache").glob("store-*/ref-logps-*.bin"))
    assert len(stored) == (reference == "precomputed")
    written = [path.stat().st_mtime_ns for path in stored]
    checkpoint, metrics = trained_state(run, tmp_path / "killed", f"ckpt_path={last}")
    assert [path.stat().st_mtime_ns for path in stored] == written, "computed again on resume"
    assert checkpoint["global_step"] == expected_checkpoint["global_step"] == 6
    assert_same_tensors(expected_checkpoint["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(
        expected_checkpoint["optimizer_states"], checkpoint["optimizer_states"], "optimizer"
    )
    assert metrics == expected_metrics
