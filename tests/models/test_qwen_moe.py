"""QwenLM's mixture-of-experts models against transformers': Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE.

The same weights give the same logits, auxiliary loss and gradients, loaded from either checkpoint
layout (per-expert tensors, as released, or transformers 5's stacked ones), and packing changes
nothing because every token is routed on its own.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from src.models.language.qwen import QwenLM
from src.models.language.qwen.moe import SparseMoeBlock
from tests.models.support import max_difference

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
LENGTH = 40
KINDS = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
COMMON = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
)  # fmt: skip
HYBRID = dict(
    partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=24,
)  # fmt: skip


def reference_model(kind: str):
    """A small random transformers MoE model; its 1-D weights moved off their initial values."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":  # one dense layer among sparse ones, top-k weights not normalised
        config = transformers.Qwen3MoeConfig(
            **COMMON, rope_theta=1e6, norm_topk_prob=False, mlp_only_layers=[1]
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **COMMON, **HYBRID, rope_theta=1e7, norm_topk_prob=True, mlp_only_layers=[0]
        )
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        config = transformers.Qwen3_5MoeTextConfig(**COMMON, **HYBRID)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                # Mild decays: the strong ones of the default init (A up to 16) leave the gates'
                # gradients good to only ~1e-2 in fp32 in either implementation (test_qwen3_5
                # holds those to fp64); here the experts are under test.
                parameter.copy_(torch.empty_like(parameter).uniform_(0.5, 2).log())
            elif parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(transformers' model, QwenLM loaded from the folder it saved, that folder)."""
    theirs = reference_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder)
    return theirs, QwenLM.from_pretrained(folder).eval(), folder


def token_ids(batch: int = 2, length: int = LENGTH, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_released_folder_loads_with_the_same_logits(pair):
    theirs, ours, folder = pair
    released = load_file(folder / "model.safetensors")
    assert any(key.endswith(".mlp.experts.0.gate_proj.weight") for key in released)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    expected = [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in theirs.model.layers
    ]
    assert sparse == expected
    assert any(sparse)
    ids = token_ids()
    with torch.no_grad():
        difference = max_difference(ours(ids), theirs(ids, use_cache=False).logits)
    assert difference < TOLERANCE, difference


def test_a_folder_in_the_stacked_layout_loads_the_same(pair, tmp_path):
    theirs, ours, folder = pair
    stacked = {k: t.contiguous() for k, t in theirs.state_dict().items() if k != "lm_head.weight"}
    stacked["lm_head.weight"] = theirs.lm_head.weight.detach().clone()
    save_file(stacked, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    again = QwenLM.from_pretrained(tmp_path)
    for key, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key


def test_save_pretrained_writes_the_released_layout_that_transformers_loads(pair, tmp_path):
    theirs, ours, folder = pair
    ours.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    released = load_file(folder / "model.safetensors")
    assert written.keys() == released.keys()
    for key, tensor in released.items():
        assert torch.equal(written[key], tensor), key
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == theirs.config.model_type
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = token_ids()
    with torch.no_grad():
        assert max_difference(again(ids).logits, theirs(ids).logits) == 0


def test_the_auxiliary_loss_and_one_steps_gradients_match(pair):
    theirs, ours, _ = pair
    ids = token_ids(seed=3)
    labels = token_ids(seed=4)
    theirs.zero_grad()
    out = theirs(ids, labels=labels, output_router_logits=True, use_cache=False)
    out.loss.backward()

    ours.zero_grad()
    # transformers shifts labels inside; QwenLM takes them shifted (labels[t] follows t).
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    token_loss = ours(ids, labels=shifted)
    aux = ours.router_aux_loss()
    assert abs(aux.item() - out.aux_loss.item()) < 1e-6
    loss = token_loss.loss_sum / token_loss.tokens + ours.config.router_aux_loss_coef * aux
    assert abs(loss.item() - out.loss.item()) < 1e-5
    loss.backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, parameter in ours.named_parameters():
        expected = theirs_grads[name].grad
        scale = expected.abs().max().clamp_min(1e-8)
        relative = max_difference(parameter.grad, expected) / scale
        assert relative < 1e-4, f"{name}: gradient differs by {relative:.2e} relative"


def test_packed_rows_equal_each_document_alone(pair):
    _, ours, _ = pair
    documents = [token_ids(1, n, seed=n)[0] for n in (13, 20, 7)]
    packed = torch.cat(documents)[None]
    cu_seqlens = torch.tensor([0, 13, 33, 40], dtype=torch.int32)
    with torch.no_grad():
        together = ours(packed, cu_seqlens=cu_seqlens)[0]
        alone = torch.cat([ours(document[None])[0] for document in documents])
    assert max_difference(together, alone) < TOLERANCE


def test_activation_checkpointing_keeps_the_gradients_of_the_auxiliary_loss(pair):
    _, ours, _ = pair
    recomputed = QwenLM(ours.config, activation_checkpointing=True)
    recomputed.load_state_dict(ours.state_dict())
    ids, labels = token_ids(seed=5), token_ids(seed=6)
    gradients = []
    for model in (ours, recomputed):
        model.zero_grad()
        token_loss = model(ids, labels=labels)
        (token_loss.loss_sum / token_loss.tokens + model.router_aux_loss()).backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, expected in gradients[0].items():
        assert torch.allclose(gradients[1][name], expected, atol=1e-6), name


def test_a_qwen3_5_moe_multimodal_folder_trains_its_language_model_and_keeps_the_rest(tmp_path):
    """Qwen3.5-MoE and Qwen3.6 ship as Qwen3_5MoeForConditionalGeneration folders."""
    torch.manual_seed(2)
    text = {**COMMON, **HYBRID, "vocab_size": 97}
    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0], "mrope_interleaved": True,
    }  # fmt: skip
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48,
        patch_size=2, temporal_patch_size=1, spatial_merge_size=1,
    )  # fmt: skip
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=95, video_token_id=96
    )
    theirs = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    theirs.save_pretrained(tmp_path / "released")
    ours = QwenLM.from_pretrained(tmp_path / "released")
    assert ours.config.model_type == "qwen3_5_moe"
    ids = token_ids() % 90  # text only: below the vision tokens
    with torch.no_grad():
        assert max_difference(ours(ids), theirs(input_ids=ids).logits) < TOLERANCE
        for parameter in ours.parameters():
            parameter.add_(0.01)  # as if trained
        tuned = ours(ids)
    ours.save_pretrained(tmp_path / "tuned")
    released = load_file(tmp_path / "released" / "model.safetensors")
    written = load_file(tmp_path / "tuned" / "model.safetensors")
    assert written.keys() == released.keys()
    for key in (k for k in released if k.startswith("model.visual.")):
        assert torch.equal(written[key], released[key]), key
    again = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "tuned").eval()
    assert type(again).__name__ == "Qwen3_5MoeForConditionalGeneration"
    with torch.no_grad():
        assert max_difference(again(input_ids=ids).logits, tuned) < TOLERANCE
