"""GRPO's rollouts (src/models/language/grpo/rollouts.py) and the nucleus sampling they use:
completions decoded in batches of equal-length prompts are each what the prompt alone decodes,
end at the end-of-turn token, and come back as a token batch whose labels are the completions."""

import pytest
import torch

from src.models.language.grpo.rollouts import sample
from src.models.language.qwen import QwenLM
from src.models.language.qwen.generation import _next_token, generate
from src.utils.contracts import IGNORE_INDEX
from tests.helpers import tiny_config

PAD = 0


def test_top_p_samples_only_from_the_smallest_set_of_likeliest_tokens_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    generator = torch.Generator().manual_seed(0)
    tokens = _next_token(logits, 1.0, None, 0.7, generator)
    counts = torch.bincount(tokens, minlength=4) / len(tokens)
    assert counts[2:].sum() == 0, "0.5 + 0.3 reach 0.7: the other tokens are outside"
    assert counts[0].item() == pytest.approx(0.5 / 0.8, abs=0.03)
    everything = _next_token(logits, 1.0, None, 1.0, generator)
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_a_top_p_outside_0_to_1_is_refused():
    model = QwenLM(tiny_config("qwen3"))
    with pytest.raises(ValueError, match=r"0 < top_p <= 1.*top_p=0"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 1, top_p=0.0)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_batched_rollouts_are_each_prompts_own_decoding_with_its_completion_as_labels(model_type):
    torch.manual_seed(0)
    model = QwenLM(tiny_config(model_type)).eval()
    lengths = [5, 7, 5]
    prompts = [torch.randint(1, 97, (n,)) for n in lengths]
    alone = [generate(model, p[None], 6)[0, len(p) :].tolist() for p in prompts]
    eos = alone[0][2]  # prompt 0's third token ends it; the others may run to the limit
    input_ids = torch.full((3, 7), PAD)
    for row, p in enumerate(prompts):
        input_ids[row, : len(p)] = p
    batch = {"input_ids": input_ids, "prompt_lengths": torch.tensor(lengths)}
    rollout = sample(model, batch, 2, 6, eos, PAD, batch_rows=3, temperature=0.0)
    assert rollout.rows.tolist() == [0, 0, 1, 1, 2, 2]
    for row, prompt in enumerate(rollout.rows.tolist()):
        expected = alone[prompt]
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert rollout.completion_ids[row] == expected
        assert rollout.finished[row] == (expected[-1] == eos)
        start = lengths[prompt]
        sequence = rollout.input_ids[row, : start + len(expected)].tolist()
        assert sequence == prompts[prompt].tolist() + expected
        labelled = rollout.labels[row] != IGNORE_INDEX
        assert labelled.nonzero().flatten().tolist() == list(
            range(start - 1, start - 1 + len(expected))
        )
        assert rollout.labels[row, labelled].tolist() == expected
    assert rollout.finished[:2].all()
    assert rollout.lengths[0] == alone[0].index(eos) + 1
    logps = model(rollout.input_ids, labels=rollout.labels, per_label=True)
    full = model(rollout.input_ids).log_softmax(-1)
    safe = rollout.labels.clamp_min(0)
    expected_logps = full.gather(-1, safe[..., None])[..., 0].masked_fill(
        rollout.labels == IGNORE_INDEX, 0
    )
    torch.testing.assert_close(logps, expected_logps, atol=1e-5, rtol=1e-5)


def test_sampled_rollouts_repeat_with_the_generators_state():
    torch.manual_seed(0)
    model = QwenLM(tiny_config("qwen3")).eval()
    batch = {"input_ids": torch.randint(1, 97, (2, 4)), "prompt_lengths": torch.tensor([4, 4])}
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    first = sample(model, batch, 4, 5, 96, PAD, generator=generator, temperature=1.0, top_p=0.9)
    generator.set_state(state)
    again = sample(model, batch, 4, 5, 96, PAD, generator=generator, temperature=1.0, top_p=0.9)
    assert first.completion_ids == again.completion_ids
    assert len({tuple(ids) for ids in first.completion_ids}) > 1, "sampling drew one completion"
