"""QLoRA (`adapter=qlora`, src/models/language/lora/qlora.py): LoRA adapters on a base whose
linear weights are 4-bit NF4. The weights are NF4 within its error of the originals and the rest
of the base is untouched; only the adapters train; the model's stored bytes are at most 0.35x a
LoRA fp32 run's and its loss after the same steps within 2% of it; checkpoints hold the adapters
only and resume exactly; the merged export is the dequantised, merged model, and the peft export
loads with peft."""

import json
from functools import partial

import peft
import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file

from src.checkpoints.restore import restore
from src.data.corpus.tokenizers import ByteTokenizer
from src.models.language.language_model import LanguageModel
from src.models.language.lora.base import fingerprint
from src.models.language.lora.injection import adapter_state, is_adapter_key
from src.models.language.lora.qlora import QLoraAdapter
from src.models.language.lora.quantization import Quantization, base_linears, import_torchao
from src.models.language.qwen import QwenConfig, QwenLM
from src.run.config.compose import ROOT
from src.run.language.hf_export import export_for_transformers, export_peft
from src.utils.errors import ConfigError
from src.utils.tensor_bytes import module_bytes, stored_bytes
from tests.helpers import (
    FAST,
    RESUMABLE_EVERY_STEP,
    assert_resumes_exactly,
    assert_same_tensors,
    compose_config,
    run_script,
    shakespeare_excerpt,
    text_lm_overrides,
)
from train import train

NF4 = import_torchao().NF4Tensor
# The smallest shapes whose projections torchao stores in 4 bits: a multiple of 64 x 256
# weights each. Their linear weights outweigh the embedding, as in the released models (the
# 0.6B: 440M of 596M parameters).
CONFIGS = {
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
    },
}
# The projections too small to store in 4 bits: Qwen3-Next's k_proj and v_proj (128 x 64 each)
# and in_proj_ba (128 x 8).
LEFT_DENSE = {"qwen3": set(), "qwen3_next": {"k_proj", "v_proj", "in_proj_ba"}}
QLORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "quantization": Quantization().to_dict()}
# The same network as a run: conf/model/qwen3_tiny.yaml at CONFIGS["qwen3"]'s size.
SHAPE = [
    "model=qwen3_tiny",
    "model.config.hidden_size=128",
    "model.config.intermediate_size=256",
    "model.config.num_hidden_layers=2",
]
NF4_HALF_GAP = 0.152  # the widest gap between NF4's 16 levels (-1 to -0.6962), halved


def write_base(folder, model_type="qwen3", seed=0):
    torch.manual_seed(seed)
    QwenLM(QwenConfig.from_dict(CONFIGS[model_type])).save_pretrained(folder)
    return folder


def qlora_model(base, model_type="qwen3", **quantization):
    model = LanguageModel(
        CONFIGS[model_type],
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        pretrained=str(base),
        kernels="pytorch",
        adapter={**QLORA, "quantization": {**QLORA["quantization"], **quantization}},
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B away from zero, as training leaves it
        for name, parameter in model.net.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


def plain_name(name):
    return name.replace(".base_layer", "")


# -- the 4-bit base -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_linear_weights_are_nf4_within_its_error_and_the_rest_is_untouched(tmp_path, model_type):
    base = write_base(tmp_path, model_type)
    original = QwenLM.from_pretrained(base).state_dict()
    model = qlora_model(base, model_type)
    dense = set()
    for name, linear in base_linears(model.net):
        weight = linear.weight
        leaf = name.rsplit(".", 2)[-2]  # `...q_proj.base_layer`
        if leaf in LEFT_DENSE[model_type]:
            assert not isinstance(weight, NF4), f"{name} cannot be stored in 4 bits"
            dense.add(leaf)
            continue
        assert isinstance(weight, NF4), f"{name} is {type(weight).__name__}, not NF4"
        assert (weight.block_size, weight.scaler_block_size) == (64, 256)
        assert not weight.requires_grad
        # Each weight within half of NF4's widest step of its block's scale (plus bf16's and the
        # 8-bit scale's rounding) of the original.
        expected = original[plain_name(name) + ".weight"].flatten().view(-1, 64)
        error = (weight.get_original_weight().float().flatten().view(-1, 64) - expected).abs()
        bound = expected.abs().amax(dim=1, keepdim=True) * (NF4_HALF_GAP + 0.02)
        assert (error <= bound).all(), f"{name}: {(error / bound).max():.2f} x NF4's error"
        assert error.mean() < 0.1 * expected.abs().mean(), name
    assert dense == LEFT_DENSE[model_type]
    assert model.net.lm_head.weight.dtype == torch.bfloat16
    # Embeddings, norms, lm_head, gates: unquantised, the originals in the compute dtype.
    state = model.net.state_dict()
    for key, value in state.items():
        if is_adapter_key(key) or isinstance(value, NF4) or plain_name(key) not in original:
            continue
        assert torch.equal(value, original[plain_name(key)].to(torch.bfloat16)), key


def test_only_the_adapters_train_in_fp32_on_a_frozen_4_bit_base(tmp_path):
    model = qlora_model(write_base(tmp_path))
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(is_adapter_key(name) for name in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    optimizer = model.configure_optimizers()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in trainable.values()}
    tokens = torch.randint(0, 320, (2, 16))
    model.train()
    model.net(tokens, labels=tokens).loss_sum.backward()
    for name, parameter in model.named_parameters():
        assert (parameter.grad is not None) == is_adapter_key(name), name


def test_a_4_bit_model_stores_at_most_0_35_of_the_bytes_of_lora_in_fp32(tmp_path):
    base = write_base(tmp_path)
    lora = LanguageModel(CONFIGS["qwen3"], pretrained=str(base), adapter={"r": 4})
    qlora = qlora_model(base)
    ratio = module_bytes(qlora) / module_bytes(lora)
    assert ratio <= 0.35, f"QLoRA stores {ratio:.3f}x LoRA's bytes"
    # An NF4 weight at its packed size: 4 bits, an int8 scale per 64 and a few bytes per 16,384.
    weight = qlora.net.model.layers[0].mlp.up_proj.base_layer.weight
    per_weight = stored_bytes(weight) / weight.numel()
    assert 0.5 + 1 / 64 <= per_weight < 0.5 + 1 / 64 + 0.01, per_weight


# -- exports --------------------------------------------------------------------------------------


def test_the_merged_export_is_the_dequantised_merged_model_in_transformers(tmp_path):
    model = qlora_model(write_base(tmp_path / "base"))
    export_for_transformers(model, ByteTokenizer(), tmp_path / "merged")
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora" in key for key in weights)
    assert {value.dtype for value in weights.values()} == {torch.bfloat16}
    tokens = torch.randint(0, 320, (2, 16))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        merged = model.adapter.merged_network().float()(tokens)
        torch.testing.assert_close(theirs.eval()(tokens).logits, merged, rtol=1e-4, atol=1e-4)
        # ... which is the 4-bit model with its adapters, up to bf16's rounding.
        ours = model.net(tokens).float()
    assert (ours - merged).abs().max() < 0.05 * merged.abs().max()


def test_the_peft_export_holds_the_adapters_for_the_unquantised_base(tmp_path):
    base = write_base(tmp_path / "base")
    model = qlora_model(base)
    export_peft(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    hf = transformers.Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    theirs = {
        key.removeprefix("base_model.model.").replace(".default.", "."): value
        for key, value in loaded.state_dict().items()
        if "lora_" in key
    }
    ours = {key.replace(".default.", "."): value for key, value in adapter_state(model.net).items()}
    assert_same_tensors(ours, theirs, "adapters")


# -- config and bad input -------------------------------------------------------------------------


def test_the_qlora_config_is_lora_s_plus_the_quantization_the_code_defaults_to(tmp_path):
    config = compose_config(tmp_path, [*FAST, *SHAPE, "adapter=qlora"]).adapter
    values = OmegaConf.to_container(config)
    assert values.pop("quantization") == Quantization().to_dict()
    assert values == OmegaConf.to_container(OmegaConf.load(ROOT / "conf/adapter/lora.yaml").adapter)


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_type": "int4"}, r"quant_type='int4': choose one of nf4"),
        ({"compute_dtype": "half"}, r"compute_dtype='half': choose one of bfloat16, float16"),
        ({"backend": "bnb"}, r"backend='bnb': choose one of torchao, bitsandbytes"),
        ({"block_size": 63}, r"block_size=63: give an even number"),
        ({"double": True}, r"unknown keys \['double'\]"),
    ],
)
def test_bad_quantization_values_are_refused_naming_the_choices(quantization, message):
    with pytest.raises(ConfigError, match=message):
        Quantization.from_dict(quantization)


def test_bitsandbytes_asked_for_without_it_installed_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # not installed
    with pytest.raises(ConfigError, match=r"backend=bitsandbytes needs bitsandbytes.*pip install"):
        qlora_model(write_base(tmp_path), backend="bitsandbytes")


def test_qlora_without_a_pretrained_base_is_refused_as_lora_is():
    model = LanguageModel(CONFIGS["qwen3"], adapter=QLORA)
    assert isinstance(model.adapter, QLoraAdapter)
    with pytest.raises(ConfigError, match=r"^adapter=qlora trains adapters on a pretrained base"):
        model.setup("fit")


# -- runs -----------------------------------------------------------------------------------------


def lm_run(folder, base, *extra):
    return [
        *FAST,
        *SHAPE,
        *text_lm_overrides(shakespeare_excerpt(folder, 4000)),
        f"model.pretrained={base}",
        "data.max_seq_len=64",
        "data.batch_size=4",
        f"data.cache_dir={folder / 'cache'}",
        "scheduler.scheduler.warmup_steps=2",
        "trainer.num_sanity_val_steps=0",
        "trainer.precision=32-true",
        "logger=csv",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """LoRA (fp32) and QLoRA runs of 8 steps on one base, validated at the end."""
    base = write_base(tmp_path_factory.mktemp("base"))
    records = {}
    for adapter in ("lora", "qlora"):
        folder = tmp_path_factory.mktemp(adapter)
        run = lm_run(
            folder,
            base,
            f"adapter={adapter}",
            "trainer.max_steps=8",
            "trainer.val_check_interval=8",
            "trainer.limit_val_batches=2",
            "test=false",
        )
        records[adapter] = (folder, train(compose_config(folder, run)))
    return base, records


def test_qlora_stores_at_most_0_35_of_lora_and_reaches_its_loss_within_2_percent(runs):
    _, records = runs
    lora, qlora = (records[name][1]["metrics"] for name in ("lora", "qlora"))
    ratio = qlora["model/parameter_bytes"] / lora["model/parameter_bytes"]
    assert ratio <= 0.35, f"QLoRA's parameter bytes are {ratio:.3f}x LoRA's"
    for key in ("train/loss", "val/loss"):
        assert abs(qlora[key] / lora[key] - 1) <= 0.02, f"{key}: {qlora[key]} vs {lora[key]}"


def test_a_qlora_checkpoint_holds_the_adapters_and_restores_the_4_bit_base(runs):
    base, records = runs
    folder = records["qlora"][0]
    last = folder / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    network = [key for key in checkpoint["state_dict"] if key.startswith("net.")]
    assert network
    assert all(is_adapter_key(key) for key in network)
    assert checkpoint["adapter_base"]["fingerprint"] == fingerprint(base)  # the unquantised base
    assert checkpoint["hyper_parameters"]["adapter"]["quantization"]["quant_type"] == "nf4"

    restored = restore(last).model.eval()
    assert isinstance(restored.adapter, QLoraAdapter)
    loaded = LanguageModel.load_from_checkpoint(last, weights_only=True).eval()  # recorded base
    assert isinstance(loaded.net.model.layers[0].mlp.up_proj.base_layer.weight, NF4)
    tokens = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert torch.equal(restored.net(tokens), loaded.net(tokens))
    assert_same_tensors(adapter_state(restored.net), adapter_state(loaded.net), "adapters")


@pytest.mark.slow
def test_a_qlora_run_killed_mid_training_resumes_exactly(tmp_path):
    base = write_base(tmp_path / "base")
    run = lm_run(
        tmp_path,
        base,
        "adapter=qlora",
        "adapter.dropout=0.1",
        "trainer.max_steps=8",
        *RESUMABLE_EVERY_STEP,
    )
    checkpoint = assert_resumes_exactly(run, tmp_path, kill_step=5)
    assert checkpoint["global_step"] == 8
    assert all(is_adapter_key(key) for key in checkpoint["state_dict"] if key.startswith("net."))


@pytest.mark.slow
def test_the_export_script_writes_a_qlora_run_merged_and_for_peft(runs, tmp_path):
    base, records = runs
    last = records["qlora"][0] / "checkpoints" / "last.ckpt"
    for fmt in ("merged", "peft"):
        arguments = [f"ckpt_path={last}", f"format={fmt}", f"hydra.run.dir={tmp_path / fmt}"]
        run_script("scripts/export.py", arguments)
    restored = restore(last).model.eval()
    tokens = torch.randint(0, 320, (2, 24))
    merged = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        ours = restored.adapter.merged_network().float()(tokens)
        torch.testing.assert_close(merged.eval()(tokens).logits, ours, rtol=1e-4, atol=1e-4)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "peft")
    trained = [v for k, v in peft_model.state_dict().items() if "lora_B" in k]
    assert trained
    assert any(b.abs().max() > 0 for b in trained)


def test_the_bitsandbytes_backend_stores_4_bit_weights_and_exports_as_torchao_s(tmp_path):
    """Where bitsandbytes is installed (its CPU path here; CUDA on a GPU)."""
    bnb = pytest.importorskip("bitsandbytes")
    model = qlora_model(write_base(tmp_path / "base"), backend="bitsandbytes")
    linears = [m for m in model.net.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7
    lora = LanguageModel(CONFIGS["qwen3"], pretrained=str(tmp_path / "base"), adapter={"r": 4})
    assert module_bytes(model) / module_bytes(lora) <= 0.35
    export_for_transformers(model, ByteTokenizer(), tmp_path / "merged")
    tokens = torch.randint(0, 320, (2, 16))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        merged = model.adapter.merged_network().float()(tokens)
        torch.testing.assert_close(theirs.eval()(tokens).logits, merged, rtol=1e-4, atol=1e-4)
