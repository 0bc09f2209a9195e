"""The proofs that packing keeps training semantics, on the dense and the hybrid Qwen-style LM:
packed rows give the logits, loss and gradients of each document trained on alone. The one
place for them: each guarantee is proved once, here."""

import pytest
import torch

from scripts.check_packing import main as check_packing_main
from src.data.packing.checks import (
    DEFAULT_LENGTHS,
    TOLERANCES,
    batches,
    leak_canary,
    logits_of,
    random_documents,
    run_checks,
)
from src.data.packing.collate import collate_rows
from src.data.text.pretraining import TextDataModule
from src.models.language.language_model import LanguageModel
from src.models.language.qwen import QwenLM
from tests.helpers import perturbed_model, quiet_trainer, shakespeare_excerpt, tiny_config

ROW_LENGTH = 64  # four DeltaNet chunks of 16: documents start and end inside chunks


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def checks(request):
    torch.manual_seed(0)
    model = perturbed_model(tiny_config(request.param))
    return run_checks(model, random_documents(97, DEFAULT_LENGTHS), ROW_LENGTH)


def assert_within_tolerance(checks, *names):
    for name in names:
        assert checks[name] <= TOLERANCES[name], f"{name}: {checks[name]:.3e}"


def test_packed_logits_equal_each_document_alone(checks):
    assert_within_tolerance(checks, "logits_vs_alone")


def test_packed_logits_equal_the_padded_batch(checks):
    assert_within_tolerance(checks, "logits_vs_padded")


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(checks):
    # grads_worst_parameter: no layer is singled out by the overall relative error.
    assert_within_tolerance(checks, "loss_vs_padded", "grads_vs_padded", "grads_worst_parameter")


def test_different_packings_give_the_same_step_loss(checks):
    assert_within_tolerance(checks, "loss_across_packings")


def test_changing_one_document_changes_no_other_document_at_all(checks):
    assert checks["leak_canary"] == 0.0, "not even a rounding difference is allowed"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_the_canary_sees_a_leak_when_boundaries_are_dropped(model_type):
    """Without cu_seqlens the rows are plain causal sequences, and the canary must notice."""
    model = perturbed_model(tiny_config(model_type))
    packed, _ = batches(random_documents(97, DEFAULT_LENGTHS), ROW_LENGTH)
    assert leak_canary(model, packed) == 0.0
    assert leak_canary(model, {**packed, "cu_seqlens": None}) > 1e-3


def test_a_split_document_sees_its_own_positions():
    """A continuation of a split document is positioned where it was in the document."""
    model = perturbed_model(tiny_config("qwen3"))
    (document,) = random_documents(97, [30])
    whole = collate_rows([[document]], pad_id=0)
    with torch.no_grad():
        reference = logits_of(model, whole)[0, 20:30]
        continuation = {
            "input_ids": document.tokens[20:][None],
            "position_ids": torch.arange(20, 30)[None],
            "cu_seqlens": None,
        }
        shifted = logits_of(model, continuation)[0]
    # Same positions, but the continuation cannot see the first 20 tokens: logits differ...
    assert (shifted - reference).abs().max() > 1e-3
    # ...while RoPE is relative, so positions 20.. and 0.. agree when the context is the same.
    restarted = {**continuation, "position_ids": torch.arange(10)[None]}
    with torch.no_grad():
        assert (logits_of(model, restarted)[0] - shifted).abs().max() < 1e-4


def printed_verdicts(printed: str) -> dict[str, str]:
    """Check name -> verdict ("ok" or "FAILED"), from the table check_packing.py prints."""
    rows = [line.split() for line in printed.splitlines()]
    return {row[0]: row[-1] for row in rows if row and row[0] in TOLERANCES}


def test_check_packing_reports_every_check_for_a_model_config(capsys):
    results = check_packing_main(
        ["model=qwen3_next_tiny", "model.config.hidden_size=32", "--row-length", "48",
         "--lengths", "1,13,17,30,5"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert set(results) == set(TOLERANCES)
    assert printed_verdicts(printed) == dict.fromkeys(TOLERANCES, "ok"), printed
    assert "packing is safe for this model" in printed


def test_check_packing_fails_a_model_that_leaks(monkeypatch, capsys):
    leaky = QwenLM.forward

    def ignore_boundaries(self, input_ids, position_ids=None, cu_seqlens=None, cache=None):
        return leaky(self, input_ids, position_ids=position_ids, cache=cache)

    monkeypatch.setattr(QwenLM, "forward", ignore_boundaries)
    with pytest.raises(SystemExit) as exit_info:
        check_packing_main(["model=qwen3_tiny", "model.config.hidden_size=32"])
    assert exit_info.value.code == 1
    verdicts = printed_verdicts(capsys.readouterr().out)
    assert verdicts["leak_canary"] == verdicts["logits_vs_alone"] == "FAILED", verdicts


def test_validation_loss_is_the_same_packed_and_padded(tmp_path):
    corpus = shakespeare_excerpt(tmp_path, 20000)
    losses = {}
    for packing in (True, False):
        data = TextDataModule(
            paths=[str(corpus)], max_seq_len=64, packing=packing, batch_size=4, val_fraction=0.2
        )
        torch.manual_seed(0)
        model = LanguageModel(config=tiny_config("qwen3_next", vocab_size=320).to_dict())
        (metrics,) = quiet_trainer().validate(model, datamodule=data, verbose=False)
        losses[packing] = metrics["val/loss"]
    assert abs(losses[True] - losses[False]) < 1e-5 * losses[False]
