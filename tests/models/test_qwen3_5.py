"""Qwen3.5 against transformers: text-only and multimodal folders load with the same logits and
gradients, interleaved multimodal RoPE is transformers' own, and saving keeps what QwenLM does not
train (the vision tower, the MTP layers) byte for byte."""

import copy
import json
import shutil

import peft
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from src.data.corpus.tokenizers import ByteTokenizer
from src.models.language.language_model import SOURCE_KEY, LanguageModel
from src.models.language.lora.injection import adapter_state
from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.layers import rotary_tables
from src.run.language.hf_export import export_for_transformers, export_peft
from src.utils.errors import ConfigError, DataError, MissingFileError
from tests.helpers import assert_same_tensors
from tests.models.support import max_difference

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
VOCAB, IMAGE, VIDEO = 97, 90, 91
# Text ids only: below the image and video tokens.
IDS = torch.randint(0, IMAGE, (2, 150), generator=torch.Generator().manual_seed(7))
# 8 rotated dimensions = 4 frequencies: [2, 1, 1] gives every stream at least one.
TEXT_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True,
    },
)  # fmt: skip
VISION_CONFIG = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48,
    patch_size=2, temporal_patch_size=1, spatial_merge_size=1,
)  # fmt: skip
# Multi-token-prediction tensors, which transformers does not build: added to the saved file, in
# bf16, to prove that they come back in their own dtype.
MTP = {"mtp.fc.weight": (48, 96), "mtp.norm.weight": (48,)}


def perturbed(model):
    """Norms, gates and decay rates away from their initial values, so that no mix-up hides."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """A random transformers Qwen3_5ForCausalLM and the folder it saved."""
    torch.manual_seed(0)
    theirs = perturbed(
        transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT_CONFIG))
    )
    folder = tmp_path_factory.mktemp("qwen3_5_text")
    theirs.save_pretrained(folder)
    return folder, theirs


@pytest.fixture(scope="module")
def multimodal_folder(tmp_path_factory):
    """A random Qwen3_5ForConditionalGeneration's folder, with MTP tensors added to its file."""
    torch.manual_seed(1)
    config = transformers.Qwen3_5Config(
        text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, image_token_id=IMAGE,
        video_token_id=VIDEO,
    )  # fmt: skip
    theirs = perturbed(transformers.Qwen3_5ForConditionalGeneration(config))
    folder = tmp_path_factory.mktemp("qwen3_5")
    theirs.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.update({key: torch.randn(shape).to(torch.bfloat16) for key, shape in MTP.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, theirs


def untrained_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as handle:
        names = [k for k in handle.keys() if k.startswith(("model.visual.", "mtp."))]  # noqa: SIM118
        return {k: handle.get_tensor(k) for k in names}


def fine_tuned(ours: QwenLM) -> QwenLM:
    """As if trained: every weight moved, so that a save that wrote the source's would show."""
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.add_(0.01)
    return ours


# -- loading: logits, gradients, packed rows ---------------------------------------------------


def test_a_text_folder_loads_with_transformers_logits(text_folder):
    folder, theirs = text_folder
    ours = QwenLM.from_pretrained(folder)
    assert ours.config.model_type == "qwen3_5_text"
    assert ours.config.mrope_section == [2, 1, 1]
    assert hasattr(ours.model["layers"][0].linear_attn, "in_proj_qkv")
    with torch.no_grad():
        difference = max_difference(ours(IDS), theirs(IDS, use_cache=False).logits)
    assert difference < TOLERANCE, f"logits differ by {difference}"


def test_a_multimodal_folder_loads_its_language_model_with_transformers_logits(multimodal_folder):
    folder, theirs = multimodal_folder
    ours = QwenLM.from_pretrained(folder)
    assert ours.config.model_type == "qwen3_5"
    assert (ours.config.image_token_id, ours.config.video_token_id) == (IMAGE, VIDEO)
    assert not any(k.startswith(("model.visual", "mtp")) for k in ours.state_dict())
    with torch.no_grad():
        difference = max_difference(ours(IDS), theirs(input_ids=IDS, use_cache=False).logits)
    assert difference < TOLERANCE, f"logits differ by {difference}"


def test_one_training_step_has_transformers_gradients(text_folder):
    """Within 1e-4 of the largest entry of each gradient, or as close to transformers in fp64 as
    transformers' fp32 is: a Gated DeltaNet gate with a strong decay (A up to e^16) has
    gradients that fp32 gives only to about 1e-3 in either implementation."""
    folder, theirs = text_folder
    ours = QwenLM.from_pretrained(folder)
    ids = IDS[:, :80]

    def gradients(model) -> dict[str, torch.Tensor]:
        model.zero_grad()
        logits = model(ids) if isinstance(model, QwenLM) else model(ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        found = {name: p.grad.double() for name, p in model.named_parameters()}
        model.zero_grad()
        return found

    mine, fp32, fp64 = gradients(ours), gradients(theirs), gradients(copy.deepcopy(theirs).double())
    assert mine.keys() == fp32.keys()
    for name, exact in fp64.items():
        scale = exact.abs().max().item()
        error = max_difference(mine[name], fp32[name]) / scale
        theirs_error = max_difference(fp32[name], exact) / scale
        our_error = max_difference(mine[name], exact) / scale
        assert error < 1e-4 or our_error <= 2 * theirs_error, (
            f"{name}: gradient differs from transformers' by {error:.2e} of its largest entry "
            f"({our_error:.2e} from fp64, where transformers' fp32 is {theirs_error:.2e} off)"
        )


def test_packed_rows_give_each_document_its_own_logits(text_folder):
    ours = QwenLM.from_pretrained(text_folder[0])
    lengths = (70, 50, 30)
    row = IDS[0, : sum(lengths)][None]
    cu_seqlens = torch.tensor([0, 70, 120, 150], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(row, cu_seqlens=cu_seqlens)[0]
        alone = [ours(doc[None])[0] for doc in row[0].split(lengths)]
    difference = max_difference(packed, torch.cat(alone))
    assert difference < TOLERANCE, f"packed documents differ from alone by {difference}"


# -- interleaved multimodal RoPE ----------------------------------------------------------------


def test_rope_tables_equal_transformers_on_text_and_three_streams(text_folder):
    config = text_folder[1].config
    reference = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    ours = QwenLM.from_pretrained(text_folder[0]).config
    x = torch.zeros(1, dtype=torch.float32)
    text = torch.arange(300)[None].expand(2, -1)
    streams = torch.randint(0, 5000, (3, 2, 300), generator=torch.Generator().manual_seed(3))
    for positions in (text, streams):
        cos, sin = rotary_tables(
            positions, ours.rotary_dim, ours.rope_theta, torch.float32, ours.mrope_section
        )
        their_cos, their_sin = reference(x, positions)
        # transformers repeats the frequencies for the two halves of the rotated dimensions.
        assert torch.equal(torch.cat((cos, cos), -1), their_cos), f"cos of {positions.shape}"
        assert torch.equal(torch.cat((sin, sin), -1), their_sin), f"sin of {positions.shape}"


def test_three_position_streams_give_transformers_logits(text_folder):
    folder, theirs = text_folder
    ours = QwenLM.from_pretrained(folder)
    positions = torch.randint(0, 200, (3, 2, 150), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours_logits = ours(IDS, position_ids=positions)
        theirs_logits = theirs(IDS, position_ids=positions, use_cache=False).logits
        assert max_difference(ours_logits, theirs_logits) < TOLERANCE
        # Equal streams are plain RoPE: [B, T] positions, and none.
        plain = torch.arange(150)[None].expand(2, -1)
        assert torch.equal(ours(IDS, position_ids=plain[None].expand(3, -1, -1)), ours(IDS))
        assert torch.equal(ours(IDS, position_ids=plain), ours(IDS))


def test_three_position_streams_are_refused_without_multimodal_rope():
    config = QwenConfig(
        model_type="qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        partial_rotary_factor=0.5,
    )  # fmt: skip
    ours = QwenLM(config)
    with pytest.raises(ValueError, match=r"\[3, B, T\]"):
        ours(IDS[:, :8] % 64, position_ids=torch.zeros(3, 2, 8, dtype=torch.long))


# -- saving: what we do not train we keep ----------------------------------------------------------


def test_a_text_folder_round_trips_as_qwen3_5_for_causal_lm(text_folder, tmp_path):
    ours = fine_tuned(QwenLM.from_pretrained(text_folder[0]))
    ours.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        difference = max_difference(ours(IDS), again(IDS, use_cache=False).logits)
    assert difference < TOLERANCE, f"logits differ by {difference} after the round trip"


def test_a_multimodal_folder_saves_its_vision_tower_and_mtp_byte_for_byte(
    multimodal_folder, tmp_path
):
    source, _ = multimodal_folder
    ours = fine_tuned(QwenLM.from_pretrained(source))
    ours.save_pretrained(tmp_path)
    kept, written = untrained_tensors(source), untrained_tensors(tmp_path)
    assert kept.keys() == written.keys()
    assert set(MTP) <= kept.keys()
    for key, tensor in kept.items():
        assert written[key].dtype == tensor.dtype, key
        assert torch.equal(written[key].view(torch.uint8), tensor.view(torch.uint8)), key
    written_config, source_config = (
        json.loads((f / "config.json").read_text()) for f in (tmp_path, source)
    )
    assert written_config["vision_config"] == source_config["vision_config"]
    again = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert type(transformers.AutoModelForImageTextToText.from_pretrained(tmp_path)) is type(again)
    with torch.no_grad():  # the fine-tuned text weights, not the source's
        difference = max_difference(ours(IDS), again(input_ids=IDS, use_cache=False).logits)
    assert difference < TOLERANCE, f"logits differ by {difference} after the round trip"


def test_saving_says_so_when_the_source_folder_is_gone(multimodal_folder, tmp_path):
    shutil.copytree(multimodal_folder[0], tmp_path / "copy")
    ours = QwenLM.from_pretrained(tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy")
    with pytest.raises(MissingFileError, match="written back from there"):
        ours.save_pretrained(tmp_path / "out")


def test_a_multimodal_model_without_a_source_folder_is_refused_on_saving(
    multimodal_folder, tmp_path
):
    ours = QwenLM(QwenLM.from_pretrained(multimodal_folder[0]).config)
    with pytest.raises(ConfigError, match="qwen3_5_text"):
        ours.save_pretrained(tmp_path)


def test_a_checkpoint_names_the_source_so_that_an_export_of_the_restored_run_keeps_it(
    multimodal_folder, tmp_path
):
    source = multimodal_folder[0]
    trained = lora_run(source)
    checkpoint = {"hyper_parameters": dict(trained.hparams)}
    trained.on_save_checkpoint(checkpoint)
    assert checkpoint[SOURCE_KEY] == str(source)
    # Restoring rebuilds from the run's stored config, without `pretrained`, in text layout.
    text_layout = {**trained.net.config.to_dict(), "model_type": "qwen3_5_text"}
    restored = LanguageModel(text_layout, kernels="pytorch")
    restored.on_load_checkpoint(checkpoint)
    assert restored.net.source == source
    assert restored.net.config.model_type == "qwen3_5"
    export_for_transformers(trained, ByteTokenizer(), tmp_path / "merged")  # LoRA merged in
    written = untrained_tensors(tmp_path / "merged")
    assert written.keys() == untrained_tensors(source).keys()


# -- LoRA and peft -------------------------------------------------------------------------------


def lora_run(folder) -> LanguageModel:
    config = QwenLM.from_pretrained(folder).config.to_dict()
    model = LanguageModel(
        config, pretrained=str(folder), kernels="pytorch", adapter={"r": 4, "alpha": 8.0}
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B matrices, as training gives
        for name, parameter in model.net.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["text", "multimodal"])
def test_peft_loads_the_exported_adapters_onto_transformers_model(
    kind, text_folder, multimodal_folder, tmp_path
):
    folder = text_folder[0] if kind == "text" else multimodal_folder[0]
    model = lora_run(folder)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in model.net.named_parameters()}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"} <= adapted
    export_peft(model, tmp_path / "adapter")
    hf_class = (
        transformers.Qwen3_5ForCausalLM
        if kind == "text"
        else transformers.Qwen3_5ForConditionalGeneration
    )
    theirs = peft.PeftModel.from_pretrained(hf_class.from_pretrained(folder), tmp_path / "adapter")
    with torch.no_grad():
        ours = model.net(IDS)
        difference = max_difference(ours, theirs.eval()(input_ids=IDS, use_cache=False).logits)
    assert difference < 1e-4, f"{kind}: logits with the adapters differ by {difference}"

    # The folder loads back to train on (adapter.path), with the same adapters.
    config = model.net.config.to_dict()
    again = LanguageModel(
        config,
        pretrained=str(folder),
        kernels="pytorch",
        adapter={"path": str(tmp_path / "adapter")},
    )
    assert_same_tensors(adapter_state(model.net), adapter_state(again.net), "adapters")


# -- inputs the text model cannot read -------------------------------------------------------------


def test_image_and_video_tokens_are_refused_on_the_host(multimodal_folder):
    ours = QwenLM.from_pretrained(multimodal_folder[0])
    ids = IDS[:, :10].clone()
    ids[1, 3] = VIDEO
    with pytest.raises(DataError, match=f"image/video token {VIDEO}: QwenLM trains the text"):
        ours(ids)
    model = LanguageModel(ours.config.to_dict(), kernels="pytorch")
    with pytest.raises(DataError, match="image/video token"):
        model.on_before_batch_transfer({"input_ids": ids, "labels": ids}, 0)
    assert model.on_before_batch_transfer({"input_ids": IDS}, 0)["input_ids"] is IDS


# -- a folder is enough ----------------------------------------------------------------------------


def test_a_folder_gives_the_architecture_and_explicit_contradictions_are_refused(text_folder):
    folder = text_folder[0]
    folder_config = QwenLM.from_pretrained(folder).config
    other = {**folder_config.to_dict(), "hidden_size": 64, "num_hidden_layers": 2,
             "layer_types": None, "linear_chunk_size": 16}  # fmt: skip
    model = LanguageModel(other, pretrained=str(folder), kernels="pytorch", explicit_config=[])
    assert model.net.config == QwenConfig(**{**folder_config.to_dict(), "linear_chunk_size": 16})
    assert model.hparams["config"]["hidden_size"] == folder_config.hidden_size
    with pytest.raises(
        ConfigError, match=r"hidden_size \(64 here, 48 there\).*off the command line"
    ):
        LanguageModel(other, pretrained=str(folder), explicit_config=["hidden_size"])
    with pytest.raises(ConfigError, match="Make the model config match the checkpoint"):
        LanguageModel(other, pretrained=str(folder))  # nothing said explicit: all of it is
