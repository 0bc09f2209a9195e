"""Per-expert checkpoint tensors against QwenLM's stacked experts, transformers the judge."""

import pytest
import torch
from safetensors.torch import load_file

from src.models.language.qwen.transformers_format.expert_layout import (
    stack_experts,
    unstack_experts,
)
from src.utils.errors import ConfigError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    """A small Qwen3-MoE: the per-expert tensors save_pretrained writes, and its stacked ones."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors"), model.state_dict()


def test_per_expert_tensors_stack_as_transformers_holds_them(saved_moe):
    on_disk, in_memory = saved_moe
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk
    stacked = stack_experts(on_disk)
    assert set(stacked) == set(in_memory)
    for key, tensor in in_memory.items():
        assert torch.equal(stacked[key], tensor), key


def test_stacked_experts_unstack_to_the_released_layout_exactly(saved_moe):
    on_disk, in_memory = saved_moe
    unstacked = unstack_experts(dict(in_memory))
    experts = {key for key in on_disk if ".experts." in key}
    assert {key for key in unstacked if ".experts." in key} == experts
    for key in experts:
        assert torch.equal(unstacked[key], on_disk[key]), key


def test_stacked_tensors_pass_through(saved_moe):
    _, in_memory = saved_moe
    stacked = stack_experts(dict(in_memory))
    assert all(stacked[key] is tensor for key, tensor in in_memory.items())


def test_a_missing_expert_is_named(saved_moe):
    on_disk, _ = saved_moe
    broken = {
        k: t for k, t in on_disk.items() if k != "model.layers.1.mlp.experts.2.gate_proj.weight"
    }
    with pytest.raises(
        ConfigError, match=r"layers\.1\.mlp\.experts lack gate_proj for experts \[2\]"
    ):
        stack_experts(broken)
