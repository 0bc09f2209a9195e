"""Preference tuning on the model side (`model.objective=dpo`): each response's log-probability
from one forward, the same whether its pair is packed into a row or padded; the LoRA reference
is the base with the adapters off; the frozen copy stays as it was built; reference-free losses
hold no reference; and next-token models are left as they were."""

import pytest
import torch

from src.data.packing.packing import Sample
from src.data.text.preference.rows import PairSample, collate_pairs
from src.models.language.language_model import LanguageModel
from src.models.language.lora.adapter import attach_lora
from src.models.language.lora.injection import lora_modules
from src.models.language.preference.reference import AdaptersDisabled, FrozenCopy
from src.models.language.preference.sequences import response_logps
from src.models.language.qwen import QwenLM
from src.utils.errors import ConfigError
from tests.helpers import perturbed_model, tiny_config

# (prompt, chosen, rejected) lengths in tokens: pairs of unequal responses, one sharing a row.
SHAPES = [(5, 3, 6), (9, 4, 2), (3, 7, 7)]


def pair(generator: torch.Generator, vocab: int, prompt: int, chosen: int, rejected: int):
    context = torch.randint(vocab, (prompt,), generator=generator)

    def sequence(response: int) -> Sample:
        tokens = torch.cat((context, torch.randint(vocab, (response,), generator=generator)))
        return Sample(tokens, torch.arange(len(tokens)) >= prompt)

    return PairSample(sequence(chosen), sequence(rejected))


def pairs(vocab: int) -> list[PairSample]:
    generator = torch.Generator().manual_seed(0)
    return [pair(generator, vocab, *shape) for shape in SHAPES]


def alone(net: QwenLM, sample: Sample) -> torch.Tensor:
    """The sample's response log-probability, from its own logits: the definition."""
    logps = net(sample.tokens[None]).double().log_softmax(-1)[0, :-1]
    chosen = logps.gather(1, sample.tokens[1:, None])[:, 0]
    return chosen[sample.targets[1:]].sum()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_packed_pairs_give_the_log_probabilities_of_padded_pairs_and_of_each_alone(model_type):
    config = tiny_config(model_type)
    net = perturbed_model(config).eval()
    items = pairs(config.vocab_size)
    packed = collate_pairs([items[:2], items[2:]], pad_id=0, row_length=48)
    padded = collate_pairs([[p] for p in items], pad_id=0, row_length=None, pad_to_multiple_of=8)
    assert packed["input_ids"].shape == (2, 48)
    assert padded["input_ids"].shape == (6, 16)
    with torch.no_grad():
        (packed_logps, packed_counts), (padded_logps, padded_counts) = (
            response_logps(net, packed),
            response_logps(net, padded),
        )
        expected = torch.tensor([[alone(net, p.chosen), alone(net, p.rejected)] for p in items])
    for name, logps in (("packed", packed_logps), ("padded", padded_logps)):
        actual = torch.stack(logps, 1).double()
        assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5), (
            f"{name}: {actual} != {expected}"
        )
    responses = torch.tensor([[c, r] for _, c, r in SHAPES])
    assert torch.equal(torch.stack(packed_counts, 1), responses)
    assert torch.equal(torch.stack(padded_counts, 1), responses)


def test_the_lora_reference_is_the_base_with_its_adapters_switched_off_for_that_forward():
    config = tiny_config("qwen3")
    base = perturbed_model(config)
    net = perturbed_model(config)  # the same weights: same seed
    attach_lora(net, {"r": 4, "alpha": 8}, pretrained=None)
    for name, parameter in net.named_parameters():
        if "lora_B" in name:  # trained adapters, which change what the network computes
            torch.nn.init.normal_(parameter, std=0.5)
    batch = collate_pairs([pairs(config.vocab_size)], pad_id=0, row_length=64)
    with torch.no_grad():
        base_logps = response_logps(base, batch)[0]
        adapted = response_logps(net, batch)[0]
    reference = AdaptersDisabled().logps(net, batch)
    torch.testing.assert_close(reference.chosen, base_logps.chosen, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(adapted.chosen, base_logps.chosen), "the adapters changed nothing"
    trainable = [p for n, p in net.named_parameters() if "lora_" in n]
    assert trainable
    assert all(p.requires_grad for p in trainable), "adapters left frozen"
    assert not any(layer.disable_adapters for layer in lora_modules(net).values())
    with torch.no_grad():
        torch.testing.assert_close(response_logps(net, batch)[0].chosen, adapted.chosen)


def dpo_model(**preference) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(tiny_config("qwen3").to_dict(), objective="dpo", preference=preference)


def test_the_frozen_copy_keeps_the_starting_weights_in_eval_mode_and_out_of_the_optimizer():
    model = dpo_model(loss_type="sigmoid", beta=0.1)
    reference = model.objective.reference
    assert isinstance(reference, FrozenCopy)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained
    assert all(n.startswith("net.") for n in trained), "the reference would train"
    model.train()
    assert not reference.training
    assert not reference.net.training
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = collate_pairs([pairs(model.vocab_size)], pad_id=0, row_length=64)
    model.objective.sums(model.net, batch).loss.backward()
    optimizer.step()
    for (name, start), now in zip(
        reference.net.state_dict().items(), model.net.state_dict().values(), strict=True
    ):
        if name.endswith("weight") and start.ndim == 2:
            assert not torch.equal(start, now), f"{name} did not train"
    assert all(
        k.startswith("objective.reference.net.") for k in model.state_dict() if "objective" in k
    )


def test_at_the_start_the_policy_is_its_reference_and_the_dpo_loss_is_log_2():
    model = dpo_model(loss_type="sigmoid", beta=0.1)
    batch = collate_pairs([pairs(model.vocab_size)], pad_id=0, row_length=64)
    loss, units, metrics = model.objective.sums(model.net, batch)
    assert int(units) == len(SHAPES)
    torch.testing.assert_close(loss / units, torch.log(torch.tensor(2.0)), rtol=1e-5, atol=1e-5)
    assert float(metrics["rewards/margins"]) == pytest.approx(0, abs=1e-5)
    assert float(metrics["rewards/accuracies"]) == 0, "a tie is no win"


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_hold_no_reference(loss_type):
    model = dpo_model(loss_type=loss_type)
    assert model.objective.reference is None
    assert not [k for k in model.state_dict() if k.startswith("objective.")]
    assert model.hparams["preference"] == {"loss_type": loss_type}  # rebuilt from checkpoints


def test_a_next_token_model_keeps_its_state_dict_hyperparameters_and_metrics():
    model = LanguageModel(tiny_config("qwen3").to_dict())
    assert all(k.startswith("net.") or k.startswith("val_acc_best.") for k in model.state_dict())
    assert "objective" not in model.hparams
    assert "preference" not in model.hparams
    assert {"train/loss", "val/loss", "val/ppl", "val/acc", "val/acc_best"} <= model.metric_keys()
    assert not any("rewards" in key for key in model.metric_keys())
    assert "val/rewards/accuracies" in dpo_model().metric_keys()


def test_an_unknown_objective_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"model\.objective='ppo': choose next_token"):
        LanguageModel(tiny_config("qwen3").to_dict(), objective="ppo")
