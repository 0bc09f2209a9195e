"""The LM's loss without full logits, and activation checkpointing: both change memory, never
the numbers."""

import copy

import pytest
import torch
import torch.nn.functional as F

from src.models.language.language_model import LanguageModel
from src.models.language.qwen import QwenLM
from src.utils.contracts import IGNORE_INDEX
from src.utils.errors import ConfigError
from tests.helpers import perturbed_model, tiny_config

ROWS, LENGTH = 2, 24
CHUNK = 7  # rows of logits at a time: several chunks, the last one short


def packed_batch(vocab: int, packed: bool) -> dict[str, torch.Tensor]:
    """Two rows of token ids and shifted labels. Packed: documents of 10 + 14 and 6 + 18 tokens
    (cu_seqlens), each document's last label ignored. Padded: the second row ends in 5
    padding positions."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (ROWS, LENGTH), generator=generator)
    labels = torch.randint(0, vocab, (ROWS, LENGTH), generator=generator)
    labels[0, :3] = IGNORE_INDEX  # an unsupervised prompt
    if not packed:
        labels[1, -5:] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}
    labels[0, [9, 23]] = IGNORE_INDEX
    labels[1, [5, 23]] = IGNORE_INDEX
    cu_seqlens = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32)
    return {"input_ids": input_ids, "labels": labels, "cu_seqlens": cu_seqlens}


def full_logits_loss(model: QwenLM, batch) -> torch.Tensor:
    """The loss as computed before chunking: every logit, then cross-entropy summed."""
    logits = model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"))
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        batch["labels"].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def chunked_loss(model: QwenLM, batch):
    return model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"), labels=batch["labels"])


def gradients(model: QwenLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close_relative(
    expected: torch.Tensor, actual: torch.Tensor, tolerance: float, name, scale: float = 0.0
):
    """`actual` within `tolerance` of `expected`, relative to its norm or to `scale` if larger."""
    error = (actual - expected).norm() / expected.norm().clamp_min(max(scale, 1e-30))
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance}"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_chunked_loss_and_every_gradient_equal_the_full_logits_path(model_type, packed, tied):
    model = perturbed_model(tiny_config(model_type, tie_word_embeddings=tied))
    model.tie_weights()
    model.loss_chunk_size = CHUNK
    batch = packed_batch(model.config.vocab_size, packed)

    expected = full_logits_loss(model, batch)
    expected_gradients = gradients(model, expected)
    loss_sum, tokens, correct = chunked_loss(model, batch)
    actual_gradients = gradients(model, loss_sum)

    assert correct is None  # with gradients: the fused op, no predictions
    assert tokens == (batch["labels"] != IGNORE_INDEX).sum()
    assert loss_sum.dtype == torch.float32
    assert_close_relative(expected, loss_sum, 1e-5, "loss")
    assert expected_gradients.keys() == actual_gradients.keys()
    # A gradient thousands of times smaller than the largest (a DeltaNet's dt_bias) carries the
    # fp32 round-off of the larger ones through the recurrence: its error is measured against
    # 1e-3 of the largest gradient's norm at least. A wrong loss still errs by orders more.
    scale = 1e-3 * max(gradient.norm() for gradient in expected_gradients.values())
    for name, expected_gradient in expected_gradients.items():
        assert_close_relative(expected_gradient, actual_gradients[name], 1e-4, name, scale)


@pytest.mark.parametrize("chunk_size", [CHUNK, None], ids=["chunked", "all-at-once"])
def test_without_gradients_the_loss_also_counts_argmax_predictions(chunk_size):
    model = perturbed_model(tiny_config("qwen3_next"))
    model.loss_chunk_size = chunk_size
    batch = packed_batch(model.config.vocab_size, packed=True)
    with torch.no_grad():
        logits = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"])
    labels = batch["labels"]
    # A model that predicts some labels right, so that a wrong count shows.
    labels[0, 5:12] = logits[0, 5:12].argmax(-1)
    with torch.no_grad():
        loss_sum, tokens, correct = chunked_loss(model, batch)
        expected = full_logits_loss(model, batch)
    assert correct == (logits.argmax(-1) == labels).sum()
    assert correct >= 7
    assert tokens == (labels != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-6, atol=0)


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def test_under_bf16_autocast_the_chunked_loss_is_as_accurate_as_the_full_logits_path():
    """Both run the head on bf16 inputs. Against fp32 throughout, the chunked loss (per-token
    bf16 losses summed in fp32) stays within 1e-3, and no gradient is further from fp32 than
    the full-logits path's own."""
    model = perturbed_model(tiny_config("qwen3"))
    model.loss_chunk_size = CHUNK
    batch = packed_batch(model.config.vocab_size, packed=True)
    fp32 = full_logits_loss(model, batch)
    fp32_gradients = gradients(model, fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full_gradients = gradients(model, full_logits_loss(model, batch))
        loss_sum, _, _ = chunked_loss(model, batch)
        chunked_gradients = gradients(model, loss_sum)
    assert loss_sum.dtype == torch.float32
    assert_close_relative(fp32, loss_sum, 1e-3, "loss")
    for name, exact in fp32_gradients.items():
        full_error = relative_error(exact, full_gradients[name])
        chunked_error = relative_error(exact, chunked_gradients[name])
        assert full_error > 1e-4, f"{name}: the reference did not run in bf16"
        assert chunked_error < 1.5 * full_error, f"{name}: {chunked_error:.1e} vs {full_error:.1e}"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_activation_checkpointing_recomputes_each_layer_with_the_same_gradients(model_type):
    plain = perturbed_model(tiny_config(model_type))
    recomputed = QwenLM(plain.config, activation_checkpointing=True)
    recomputed.load_state_dict(plain.state_dict())
    batch = packed_batch(plain.config.vocab_size, packed=True)
    mlp_calls = []
    for layer in recomputed.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))

    expected = gradients(plain, chunked_loss(plain, batch).loss_sum)
    loss = chunked_loss(recomputed, batch).loss_sum
    assert len(mlp_calls) == plain.config.num_hidden_layers
    actual = gradients(recomputed, loss)

    assert len(mlp_calls) == 2 * plain.config.num_hidden_layers, "each layer ran again"
    for name, expected_gradient in expected.items():
        torch.testing.assert_close(actual[name], expected_gradient, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # evaluation and generation keep nothing to recompute
        chunked_loss(recomputed, batch)
    assert len(mlp_calls) == 3 * plain.config.num_hidden_layers


def test_the_language_model_takes_the_chunk_size_and_the_switch_from_its_config():
    config = tiny_config("qwen3").to_dict()
    module = LanguageModel(config, loss_chunk_size=64, activation_checkpointing=True)
    assert module.net.loss_chunk_size == 64
    assert all(layer.checkpointed for layer in module.net.model.layers)
    reference = LanguageModel(config, loss_chunk_size=None)
    reference.load_state_dict(module.state_dict())
    batch = packed_batch(config["vocab_size"], packed=True)
    torch.testing.assert_close(
        module.objective.sums(module.net, batch).loss,
        reference.objective.sums(reference.net, batch).loss,
        rtol=1e-6,
        atol=0,
    )
    with pytest.raises(ConfigError, match="loss_chunk_size=0"):
        LanguageModel(copy.deepcopy(config), loss_chunk_size=0)
