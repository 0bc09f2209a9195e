"""QwenLM against transformers' Qwen3 / Qwen3-Next: the same weights give the same logits,
loaded in either direction. transformers is the reference implementation, used in tests only."""

import pytest
import torch

from src.models.language.qwen import QwenLM
from src.models.language.qwen.transformers_format.state_dict_adapter import ADAPTERS
from tests.helpers import perturbed_model, tiny_config
from tests.models.support import max_difference

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
# Longer than one Gated DeltaNet block (64) and not a multiple of it.
LENGTH = 150


def hf_model(kind: str):
    """A transformers model with a small random config, its 1-D weights (norms, A_log, dt_bias)
    moved away from their initial values."""
    common = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    if kind == "dense":
        config = transformers.Qwen3Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "dense_with_biases":
        config = transformers.Qwen3Config(**common, rope_theta=1e4, attention_bias=True)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3NextConfig(
            **common, rope_theta=1e7, partial_rotary_factor=0.25, num_experts=0,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4,
        )  # fmt: skip
        model = transformers.Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def logits_of_both(ours: QwenLM, theirs) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return ours(ids), theirs(ids, use_cache=False).logits


@pytest.mark.parametrize("kind", ["dense", "dense_with_biases", "hybrid"])
def test_a_transformers_folder_loads_with_the_same_logits(tmp_path, kind):
    theirs = hf_model(kind)
    theirs.save_pretrained(tmp_path)
    ours = QwenLM.from_pretrained(tmp_path)
    assert ours.config.model_type == theirs.config.model_type
    difference = max_difference(*logits_of_both(ours, theirs))
    assert difference < TOLERANCE, f"{kind}: logits differ by {difference}"


# Every registered model type, so that a new adapter is held to transformers from the start.
# A multimodal folder's model saves with that folder: tests/models/test_qwen3_5.py.
@pytest.mark.parametrize("model_type", sorted(t for t, a in ADAPTERS.items() if a.saves_alone))
def test_save_pretrained_loads_in_transformers_with_the_same_logits(tmp_path, model_type):
    ours = perturbed_model(tiny_config(model_type, linear_chunk_size=64)).eval()
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected_class = {
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
        "qwen3_5_text": "Qwen3_5ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    }
    assert type(theirs).__name__ == expected_class[model_type]
    difference = max_difference(*logits_of_both(ours, theirs))
    assert difference < TOLERANCE, f"{model_type}: logits differ by {difference}"


def test_sharded_folders_load_both_ways(tmp_path):
    theirs = hf_model("hybrid")
    theirs.save_pretrained(tmp_path / "theirs", max_shard_size="40KB")
    assert (tmp_path / "theirs" / "model.safetensors.index.json").is_file()
    ours = QwenLM.from_pretrained(tmp_path / "theirs")
    assert max_difference(*logits_of_both(ours, theirs)) < TOLERANCE

    ours.save_pretrained(tmp_path / "ours", max_shard_bytes=40_000)
    assert len(list((tmp_path / "ours").glob("model-*-of-*.safetensors"))) > 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max_difference(*logits_of_both(ours, reloaded)) < TOLERANCE
