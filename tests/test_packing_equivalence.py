"""The proofs that packing keeps training semantics, on the dense and the hybrid Qwen-style LM:
packed rows give the logits, loss and gradients of each document trained on alone."""

import pytest
import torch

from src.data.collate import collate_rows
from src.utils.packing_checks import (
    DEFAULT_LENGTHS,
    batches,
    leak_canary,
    logits_of,
    random_documents,
    run_checks,
)
from tests.test_qwen_model import perturbed_model, tiny_config

ROW_LENGTH = 64  # four DeltaNet chunks of 16: documents start and end inside chunks


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def checks(request):
    torch.manual_seed(0)
    model = perturbed_model(tiny_config(request.param))
    return run_checks(model, random_documents(97, DEFAULT_LENGTHS), ROW_LENGTH)


def test_packed_logits_equal_each_document_alone(checks):
    assert checks["logits_vs_alone"] < 1e-5


def test_packed_logits_equal_the_padded_batch(checks):
    assert checks["logits_vs_padded"] < 1e-5


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(checks):
    assert checks["loss_vs_padded"] < 1e-5
    assert checks["grads_vs_padded"] < 1e-4
    assert checks["grads_worst_parameter"] < 1e-3  # no layer is singled out


def test_different_packings_give_the_same_step_loss(checks):
    assert checks["loss_across_packings"] < 1e-5


def test_changing_one_document_changes_no_other_document_at_all(checks):
    assert checks["leak_canary"] == 0.0


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
