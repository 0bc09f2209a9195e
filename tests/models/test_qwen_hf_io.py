"""Loading transformers-format folders: clear errors for anything that does not fit."""

import json
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from src.models.language.language_model import LanguageModel
from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.transformers_format.folders import (
    check_same_architecture,
    config_from_hf,
)
from src.models.language.qwen.transformers_format.state_dict_adapter import ADAPTERS
from src.utils.errors import CheckpointError, ConfigError
from tests.helpers import ROOT, perturbed_model, tiny_config


@pytest.fixture
def saved(tmp_path):
    """A hybrid model and the folder it saved itself to."""
    model = perturbed_model(tiny_config("qwen3_next"))
    model.save_pretrained(tmp_path)
    return model, tmp_path


def rewrite_weights(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_saved_model_loads_back_identically(saved):
    model, folder = saved
    loaded = QwenLM.from_pretrained(folder)
    # The Gated DeltaNet block length is this implementation's own, not in config.json.
    assert loaded.config == replace(model.config, linear_chunk_size=64)
    saved_weights, loaded_weights = model.state_dict(), loaded.state_dict()
    assert saved_weights.keys() == loaded_weights.keys()
    assert all(torch.equal(saved_weights[key], loaded_weights[key]) for key in saved_weights)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight  # untied stays untied


@pytest.mark.parametrize("tied", [True, False])
# A multimodal folder's model saves with that folder: tests/models/test_qwen3_5.py.
@pytest.mark.parametrize("model_type", sorted(t for t, a in ADAPTERS.items() if a.saves_alone))
def test_every_model_type_loads_back_what_it_saved(tmp_path, model_type, tied):
    model = perturbed_model(tiny_config(model_type, tie_word_embeddings=tied))
    model.save_pretrained(tmp_path / "saved")
    loaded = QwenLM.from_pretrained(tmp_path / "saved")
    loaded.save_pretrained(tmp_path / "again")
    written, rewritten = (
        json.loads((tmp_path / d / "config.json").read_text()) for d in ("saved", "again")
    )
    assert written == rewritten, f"{model_type}: config.json changed on the way back"
    saved_weights, loaded_weights = model.state_dict(), loaded.state_dict()
    differing = [k for k in saved_weights if not torch.equal(saved_weights[k], loaded_weights[k])]
    assert not differing, f"{model_type}: {differing} changed on the way back"
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_a_tied_lm_head_is_left_out_of_the_file_and_ignored_when_a_file_repeats_it(tmp_path):
    model = perturbed_model(tiny_config("qwen3", tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    rewrite_weights(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(97, 48)}))
    loaded = QwenLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_a_missing_tied_embedding_is_named_alone(tmp_path):
    QwenLM(tiny_config("qwen3", tie_word_embeddings=True)).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing in the file \(1\): model\.embed_tokens\.weight \[97, 48\]\.",
    ):
        QwenLM.from_pretrained(tmp_path)


def test_missing_keys_are_named(saved):
    _, folder = saved
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(
        CheckpointError, match=r"missing in the file \(1\): model.layers.1.linear_attn.A_log"
    ):
        QwenLM.from_pretrained(folder)


def test_unexpected_and_misshapen_keys_are_named(saved):
    _, folder = saved

    def change(tensors):
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
        tensors["model.layers.3.self_attn.o_proj.weight"] = torch.zeros(48, 32)

    rewrite_weights(folder, change)
    with pytest.raises(CheckpointError) as error:
        QwenLM.from_pretrained(folder)
    message = str(error.value)
    assert "not in the model (1): model.layers.9.mlp.up_proj.weight" in message
    assert "model.layers.3.self_attn.o_proj.weight: file [48, 32], model [48, 64]" in message


def test_a_config_that_disagrees_with_the_weights_names_every_misfit(saved):
    _, folder = saved
    rewrite_config(folder, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"shape mismatch .*model\.layers\.0\.mlp\.down_proj"):
        QwenLM.from_pretrained(folder)


def test_multi_token_prediction_weights_of_released_checkpoints_are_skipped(saved):
    _model, folder = saved
    rewrite_weights(folder, lambda t: t.update({"mtp.fc.weight": torch.zeros(4, 4)}))
    QwenLM.from_pretrained(folder)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, r"model_type='llama'; QwenLM loads \['qwen3', .*'qwen3_next'\]"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_of_unsupported_models_are_refused(saved, changes, message):
    _, folder = saved
    rewrite_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        QwenLM.from_pretrained(folder)


def test_pickled_weights_are_never_loaded(tmp_path):
    tiny = QwenLM(tiny_config("qwen3"))
    tiny.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle files are never loaded"):
        QwenLM.from_pretrained(tmp_path)


def test_missing_config_keys_take_transformers_defaults():
    config = config_from_hf({"model_type": "qwen3_next", "num_experts": 0})
    assert (config.hidden_size, config.head_dim, config.partial_rotary_factor) == (2048, 256, 0.25)
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


def test_the_lm_module_starts_from_a_transformers_folder(saved):
    model, folder = saved
    module = LanguageModel(model.config.to_dict(), pretrained=str(folder))
    loaded = module.net.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in model.state_dict().items())
    assert "pretrained" not in module.hparams  # checkpoints rebuild without the folder


def test_a_model_config_that_differs_from_the_checkpoint_is_refused_with_the_fields(saved):
    model, folder = saved
    config = {**model.config.to_dict(), "rope_theta": 1.0}
    with pytest.raises(ConfigError, match=r"rope_theta \(1\.0 here, 1000000\.0 there\)"):
        LanguageModel(config, pretrained=str(folder))


# Qwen/Qwen3-0.6B's config.json as released (transformers 4.51 layout).
RELEASED_QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip


def test_the_qwen3_0_6b_model_config_fits_the_released_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_QWEN3_0_6B))
    node = OmegaConf.load(ROOT / "conf" / "model" / "qwen3_0_6b.yaml").config
    check_same_architecture(QwenConfig.from_dict(OmegaConf.to_container(node)), tmp_path)
