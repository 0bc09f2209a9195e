"""QwenLM's own guarantees: exact chunking, document starts in the recurrence, caches, counts,
errors. That packed documents are kept apart is proved in tests/data/test_packing_equivalence.py."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from src.models.language.qwen.generation import Cache
from tests.helpers import ROOT, perturbed_model, tiny_config
from tests.models.support import max_difference

TOLERANCE = 1e-5


def random_delta_rule_inputs(batch=2, length=75, key_heads=2, heads=4, key_dim=8, value_dim=6):
    """Gated delta rule inputs with each key head serving two value heads."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = F.normalize(randn(batch, length, key_heads, key_dim), dim=-1) * key_dim**-0.5
    k = F.normalize(randn(batch, length, key_heads, key_dim), dim=-1)
    v = randn(batch, length, heads, value_dim)
    g = -torch.rand(batch, length, heads, generator=generator) * 2
    beta = torch.rand(batch, length, heads, generator=generator)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 100])
@pytest.mark.parametrize("with_documents", [False, True])
def test_chunked_delta_rule_equals_the_step_by_step_recurrence(chunk_size, with_documents):
    q, k, v, g, beta = random_delta_rule_inputs()
    initial = torch.randn(2, 4, 8, 6)
    starts = None
    if with_documents:  # document starts inside blocks, on a block's first token, back to back
        starts = torch.zeros(2, 75, dtype=torch.bool)
        starts[0, [0, 5, 6, 16, 40]] = True
        starts[1, [0, 31, 32, 74]] = True
    expected, expected_state = recurrent_gated_delta_rule(q, k, v, g, beta, starts, initial)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, starts, initial, chunk_size)
    assert max_difference(out, expected) < TOLERANCE, "outputs differ"
    assert max_difference(state, expected_state) < TOLERANCE, "final states differ"


def test_a_document_start_resets_the_recurrent_state():
    q, k, v, g, beta = random_delta_rule_inputs(batch=1, length=30)
    starts = torch.zeros(1, 30, dtype=torch.bool)
    starts[0, 12] = True
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts, chunk_size=8)
    alone, _ = chunk_gated_delta_rule(*(t[:, 12:] for t in (q, k, v, g, beta)), chunk_size=8)
    assert max_difference(packed[:, 12:], alone) < TOLERANCE


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_decoding_with_a_cache_matches_full_recomputation(model_type):
    model = perturbed_model(tiny_config(model_type))
    ids = torch.randint(0, 97, (2, 45), generator=torch.Generator().manual_seed(3))
    cache = Cache(model.config)
    with torch.no_grad():
        full = model(ids)
        pieces = [model(ids[:, :20], cache=cache)]  # prefill
        pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(20, 30)]  # one by one
        pieces.append(model(ids[:, 30:], cache=cache))  # several tokens after a cached prefix
    assert max_difference(torch.cat(pieces, dim=1), full) < TOLERANCE
    assert cache.length == 45


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_next"])
def test_greedy_generation_picks_the_argmax_of_a_full_forward(model_type):
    model = perturbed_model(tiny_config(model_type))
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    output = model.generate(prompt, max_new_tokens=12)
    assert output.shape == (2, 19)
    assert torch.equal(output[:, :7], prompt)
    with torch.no_grad():
        recomputed = model(output[:, :-1]).argmax(-1)[:, 6:]
    assert torch.equal(recomputed, output[:, 7:])


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = perturbed_model(tiny_config("qwen3_next"))
    prompt = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(5))

    def sample(seed, **kwargs):
        generator = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 10, temperature=1.0, generator=generator, **kwargs)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))
    assert torch.equal(sample(0, top_k=1), model.generate(prompt, 10))


def test_generation_stops_once_every_row_has_ended():
    model = perturbed_model(tiny_config("qwen3"))
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    first = model.generate(prompt, 1)[0, -1].item()
    output = model.generate(prompt, 20, eos_token_id=first)
    assert output.shape == (1, 6)


def test_the_qwen3_0_6b_config_has_the_released_parameter_count():
    node = OmegaConf.load(ROOT / "conf" / "model" / "qwen3_0_6b.yaml").config
    with torch.device("meta"):  # shapes only
        model = QwenLM(QwenConfig.from_dict(OmegaConf.to_container(node)))
    assert model.num_parameters() == 596_049_920
    assert model.num_parameters(exclude_embeddings=True) == 440_467_456


def test_flops_per_token_is_six_per_weight_plus_sequence_mixing():
    model = QwenLM(tiny_config("qwen3"))
    weights = model.num_parameters(exclude_embeddings=True) + 97 * 48
    assert model.flops_per_token(1, training=False) > 2 * weights
    assert model.flops_per_token(256) == 3 * model.flops_per_token(256, training=False)
    assert model.flops_per_token(512) > model.flops_per_token(256)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([0, 10, 30], "from 0 to B\\*T = 40"),
        ([0, 10, 20, 20, 40], "strictly increasing"),
        ([0, 10, 25, 40], "every row start"),
        ([[0, 20, 40]], "1-D integer tensor"),
    ],
)
def test_cu_seqlens_that_do_not_cover_the_batch_are_refused(cu_seqlens, message):
    model = QwenLM(tiny_config("qwen3"))
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(2, 20, dtype=torch.long), cu_seqlens=torch.tensor(cu_seqlens))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"layer_types": ["linear_attention"] * 4}, "need model_type='qwen3_next'"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"partial_rotary_factor": 0.1}, "even number of rotated dimensions"),
    ],
)
def test_invalid_configs_say_what_is_wrong(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{"model_type": "qwen3", **overrides})


def test_unknown_config_fields_are_named():
    with pytest.raises(ValueError, match="hidden_sise"):
        QwenConfig.from_dict({"hidden_sise": 64})
