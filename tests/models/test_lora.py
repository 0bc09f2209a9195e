"""LoRA adapters (`adapter=lora`, src/models/language/lora/): only the adapters train,
checkpoints name their base instead of holding it, runs resume exactly, and the adapters export to
peft's format, which transformers' models load with the same logits."""

import json
from functools import partial

import peft
import pytest
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from scripts.generate import main as generate_main
from src.checkpoints.restore import restore
from src.data.corpus.tokenizers import ByteTokenizer
from src.models.language.adapters import NoAdapter
from src.models.language.language_model import LanguageModel
from src.models.language.lora.adapter import LoraAdapter, attach_lora
from src.models.language.lora.base import fingerprint
from src.models.language.lora.injection import adapter_state, is_adapter_key
from src.models.language.lora.spec import DEFAULT_TARGETS, AdapterSpec
from src.models.language.qwen import QwenConfig, QwenLM
from src.run.config.checks import check_config_types
from src.run.config.compose import ROOT
from src.run.language.hf_export import export_for_transformers, export_peft
from src.utils.contracts import Adapter
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from tests.helpers import (
    FAST,
    RESUMABLE_EVERY_STEP,
    TINY_LM,
    assert_resumes_exactly,
    assert_same_tensors,
    compose_config,
    run_script,
    run_train,
    shakespeare_excerpt,
    text_lm_overrides,
)
from tests.models.support import save_tiny_base
from train import train

# Both architectures at their tiniest: dense Qwen3, and Qwen3-Next with Gated DeltaNet layers.
CONFIGS = {
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
    },
}
# Adapted modules per layer: dense Qwen3's 4 attention + 3 MLP projections; Qwen3-Next's
# Gated DeltaNet layer has 3 (in_proj_qkvz, in_proj_ba, out_proj), its attention layer 4.
ADAPTED = {"qwen3": 2 * (4 + 3), "qwen3_next": (3 + 3) + (4 + 3)}
HF_CLASSES = {
    "qwen3": transformers.Qwen3ForCausalLM,
    "qwen3_next": transformers.Qwen3NextForCausalLM,
}
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0}


def write_base(folder, model_type, seed=0, dtype=torch.float32):
    """A random base model of `model_type` as a transformers folder."""
    torch.manual_seed(seed)
    QwenLM(QwenConfig.from_dict(CONFIGS[model_type])).to(dtype).save_pretrained(folder)
    return folder


def trained_adapters(net, seed=1):
    """Non-zero B matrices (peft starts them at zero, a no-op update), as training gives."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def lora_model(base, model_type, **adapter):
    model = LanguageModel(
        CONFIGS[model_type],
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        pretrained=str(base),
        kernels="pytorch",
        adapter={**LORA, **adapter},
    )
    trained_adapters(model.net)
    return model.eval()


@pytest.fixture(params=list(CONFIGS))
def model_type(request):
    return request.param


# -- what trains -----------------------------------------------------------------------------------


def test_only_the_adapters_require_grad_and_reach_the_optimizer(tmp_path, model_type):
    model = lora_model(write_base(tmp_path, model_type), model_type)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(is_adapter_key(name) for name in trainable)
    assert len(trainable) == 2 * ADAPTED[model_type]  # lora_A and lora_B of each module
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable}
    expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if model_type == "qwen3_next":
        expected |= {"in_proj_qkvz", "in_proj_ba", "out_proj"}
    assert adapted == expected
    assert adapted <= set(DEFAULT_TARGETS)

    optimizer = model.configure_optimizers()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}

    # A backward pass reaches the adapters only.
    batch = torch.randint(0, 64, (2, 12))
    model.train()
    model.net(batch).float().pow(2).mean().backward()
    for name, parameter in model.named_parameters():
        assert (parameter.grad is not None) == is_adapter_key(name), name


def test_the_lora_config_adapts_what_the_code_adapts_by_default():
    """conf/adapter/lora.yaml mirrors AdapterSpec's defaults, Qwen3.5's split projections too."""
    config = OmegaConf.load(ROOT / "conf" / "adapter" / "lora.yaml").adapter
    assert tuple(config.target_modules) == AdapterSpec().target_modules == DEFAULT_TARGETS
    assert config.target_experts is AdapterSpec().target_experts is False


def test_the_model_holds_lora_or_no_adapter_behind_one_contract(tmp_path):
    base = write_base(tmp_path, "qwen3")
    plain = LanguageModel(CONFIGS["qwen3"], pretrained=str(base), kernels="pytorch")
    assert isinstance(plain.adapter, NoAdapter), type(plain.adapter).__name__
    assert isinstance(plain.adapter, Adapter), "NoAdapter lacks members of the Adapter contract"
    assert "adapter" not in plain.hparams
    assert plain.strict_loading, "a whole-network checkpoint must load strictly"
    assert all(p.requires_grad for p in plain.parameters()), "without an adapter all trains"
    assert plain.adapter.merged_network() is plain.net

    lora = lora_model(base, "qwen3")
    assert isinstance(lora.adapter, LoraAdapter), type(lora.adapter).__name__
    assert isinstance(lora.adapter, Adapter), "LoraAdapter lacks members of the Adapter contract"
    assert lora.hparams["adapter"] == {**lora.adapter.spec.to_dict(), "r": 4, "alpha": 8.0}
    assert not lora.strict_loading, "a LoRA checkpoint leaves the base out"


def test_format_peft_of_a_model_without_adapters_names_the_other_formats(tmp_path):
    model = LanguageModel(CONFIGS["qwen3"], pretrained=str(write_base(tmp_path, "qwen3")))
    with pytest.raises(CheckpointError, match=r"without adapter=lora.*format=merged"):
        export_peft(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_the_base_stays_frozen_in_its_own_dtype():
    config = QwenConfig.from_dict(CONFIGS["qwen3_next"])
    net = QwenLM(config).to(torch.bfloat16)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    attach_lora(net, LORA, pretrained=None)
    after = net.state_dict()
    for key, value in before.items():
        adapted = key.replace(".weight", ".base_layer.weight")
        current = after[adapted] if adapted in after else after[key]
        assert current.dtype == torch.bfloat16, key
        assert torch.equal(current, value), key
    frozen = [p for n, p in net.named_parameters() if not is_adapter_key(n)]
    assert frozen
    assert not any(p.requires_grad for p in frozen)


def test_target_modules_that_name_nothing_are_refused_naming_the_projections():
    net = QwenLM(QwenConfig.from_dict(CONFIGS["qwen3"]))
    with pytest.raises(ConfigError, match=r"names no linear module.*q_proj"):
        attach_lora(net, {"target_modules": ["lm_head_typo"]}, pretrained=None)
    with pytest.raises(ConfigError, match="unknown keys"):
        attach_lora(net, {"rank": 8}, pretrained=None)


def test_gated_deltanet_adapters_take_effect_and_vanish_with_b_at_zero(tmp_path):
    """The layer calls in_proj_qkvz and in_proj_ba, adapted or not, and regroups their outputs
    (transformers' logits match in the peft export test below)."""
    base = write_base(tmp_path / "base", "qwen3_next")
    model = lora_model(base, "qwen3_next", target_modules=["in_proj_qkvz", "in_proj_ba"])
    plain = QwenLM.from_pretrained(base)
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(model.net(tokens), plain(tokens), atol=1e-3)
        for module in model.net.modules():  # B = 0: the adapted layer is the plain one again
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.zero_()
        torch.testing.assert_close(model.net(tokens), plain(tokens), rtol=1e-5, atol=1e-6)


def test_adapters_under_activation_checkpointing_get_the_same_gradients(tmp_path, model_type):
    base = write_base(tmp_path, model_type)
    tokens = torch.randint(0, 64, (2, 12))
    gradients = []
    for recompute in (False, True):
        torch.manual_seed(0)  # the same A matrices
        model = LanguageModel(
            CONFIGS[model_type],
            pretrained=str(base),
            kernels="pytorch",
            adapter=LORA,
            activation_checkpointing=recompute,
        )
        trained_adapters(model.net)
        model.train()
        model.net(tokens, labels=tokens).loss_sum.backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    assert gradients[0]
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=1e-6, atol=1e-7, msg=name)


# -- export: peft's folder and a merged transformers folder ----------------------------------------


def transformers_logits(folder, model_type, tokens, adapters=None):
    model = HF_CLASSES[model_type].from_pretrained(folder, dtype=torch.float32)
    if adapters is not None:
        model = peft.PeftModel.from_pretrained(model, adapters)
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_peft_loads_the_exported_adapters_onto_transformers_with_the_same_logits(
    tmp_path, model_type
):
    base = write_base(tmp_path / "base", model_type)
    model = lora_model(base, model_type, dropout=0.1)
    export_peft(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert config["r"] == 4
    assert config["lora_alpha"] == 8
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ours = model.net(tokens)
    theirs = transformers_logits(base, model_type, tokens, tmp_path / "adapter")
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # ... and the adapters matter: without them the logits differ.
    assert not torch.allclose(transformers_logits(base, model_type, tokens), ours, atol=1e-3)


def test_the_merged_export_is_a_plain_transformers_model_with_the_same_logits(tmp_path, model_type):
    base = write_base(tmp_path / "base", model_type)
    model = lora_model(base, model_type)
    export_for_transformers(model, ByteTokenizer(), tmp_path / "merged")
    assert not any("lora" in key for key in load_file(tmp_path / "merged" / "model.safetensors"))
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ours = model.net(tokens)
    merged = transformers_logits(tmp_path / "merged", model_type, tokens)
    torch.testing.assert_close(merged, ours, rtol=1e-4, atol=1e-4)


def test_a_peft_folder_loads_back_to_train_on(tmp_path, model_type):
    base = write_base(tmp_path / "base", model_type)
    model = lora_model(base, model_type)
    export_peft(model, tmp_path / "adapter")
    again = LanguageModel(
        CONFIGS[model_type],
        pretrained=str(base),
        adapter={"r": 2, "path": str(tmp_path / "adapter")},  # the folder's r wins
    )
    assert again.adapter.spec.r == 4
    assert_same_tensors(adapter_state(model.net), adapter_state(again.net), "adapters")
    # On another base, the fingerprint in the folder refuses it.
    other = write_base(tmp_path / "other", model_type, seed=5)
    with pytest.raises(CheckpointError, match="fingerprint"):
        LanguageModel(
            CONFIGS[model_type], pretrained=str(other), adapter={"path": str(tmp_path / "adapter")}
        )


def test_the_fingerprint_tells_bases_of_one_architecture_apart(tmp_path):
    first = fingerprint(write_base(tmp_path / "a", "qwen3"))
    assert fingerprint(write_base(tmp_path / "b", "qwen3")) == first  # same weights
    assert fingerprint(write_base(tmp_path / "c", "qwen3", seed=1)) != first
    # One changed value in one tensor is enough.
    state = load_file(tmp_path / "a" / "model.safetensors")
    state["model.norm.weight"][0] += 1
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file(state, tmp_path / "d" / "model.safetensors")
    assert fingerprint(tmp_path / "d") != first


# -- training runs ---------------------------------------------------------------------------------


def lm_run(tmp_path, *extra):
    return [
        *FAST,
        *TINY_LM,
        *text_lm_overrides(shakespeare_excerpt(tmp_path, 4000)),
        "data.max_seq_len=64",
        "data.batch_size=4",
        f"data.cache_dir={tmp_path / 'cache'}",
        "scheduler.scheduler.warmup_steps=2",
        "trainer.num_sanity_val_steps=0",
        "logger=csv",
        *extra,
    ]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """TINY_LM's network with random weights, as a transformers folder."""
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_base):
    run_dir = tmp_path_factory.mktemp("lora_run")
    run = lm_run(
        run_dir,
        "adapter=lora",
        f"model.pretrained={tiny_base}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",  # a best checkpoint, tested after fitting
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
    )
    record = train(compose_config(run_dir, run))
    return run_dir, record


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(lora_run, tiny_base):
    run_dir, record = lora_run
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    network = [key for key in checkpoint["state_dict"] if key.startswith("net.")]
    assert network
    assert all(is_adapter_key(key) for key in network)
    assert checkpoint["adapter_base"]["path"] == str(tiny_base.resolve())
    assert checkpoint["adapter_base"]["fingerprint"] == fingerprint(tiny_base)
    assert checkpoint["hyper_parameters"]["adapter"]["r"] == 16
    # Trained: the B matrices left zero; the optimizer holds the adapters' states only.
    assert any(checkpoint["state_dict"][k].abs().sum() > 0 for k in network if "lora_B" in k)
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(network)
    assert "test/loss" in record["metrics"]  # the best checkpoint, tested after fitting

    restored = restore(run_dir / "checkpoints" / "last.ckpt")
    plain = QwenLM.from_pretrained(tiny_base).state_dict()
    weights = restored.model.net.state_dict()
    for key, value in plain.items():  # the base as it was
        current = weights.get(key.replace(".weight", ".base_layer.weight"), weights.get(key))
        assert torch.equal(current, value), key


def test_load_from_checkpoint_rebuilds_the_adapters_on_the_recorded_base(lora_run):
    run_dir, _ = lora_run
    last = run_dir / "checkpoints" / "last.ckpt"
    loaded = LanguageModel.load_from_checkpoint(last, weights_only=True)  # no pretrained given
    restored = restore(last)
    assert loaded.adapter.spec == restored.model.adapter.spec
    assert_same_tensors(restored.model.state_dict(), loaded.state_dict(), "weights")


def moved_base_checkpoint(lora_run, tmp_path):
    """The LoRA run's last checkpoint as it reads after its base folder moved away."""
    run_dir, _ = lora_run
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    gone = str(tmp_path / "moved_away")
    checkpoint["adapter_base"]["path"] = gone
    checkpoint["qwen_source_folder"] = gone
    checkpoint["run_config"]["config"]["model"]["pretrained"] = gone
    torch.save(checkpoint, tmp_path / "moved.ckpt")
    return tmp_path / "moved.ckpt", gone


def test_a_moved_base_is_named_with_the_key_that_points_to_it(lora_run, tmp_path):
    moved, gone = moved_base_checkpoint(lora_run, tmp_path)
    with pytest.raises(MissingFileError) as error:
        restore(moved)
    message = str(error.value)
    assert f"LoRA adapters on the base {gone} (the checkpoint's adapter_base.path" in message
    assert "model.pretrained=<folder> (eval.py, scripts/export.py)" in message, message
    assert "--base <folder> (scripts/generate.py)" in message, message
    with pytest.raises(SystemExit, match="which is no longer there"):
        generate_main(["--ckpt", str(moved), "--max-new-tokens", "1"])


def test_a_moved_base_given_anew_restores_exports_and_generates(lora_run, tiny_base, tmp_path):
    moved, _ = moved_base_checkpoint(lora_run, tmp_path)
    expected = restore(lora_run[0] / "checkpoints" / "last.ckpt").model.state_dict()
    given = restore(moved, [f"model.pretrained='{tiny_base}'"])
    assert_same_tensors(expected, given.model.state_dict(), "weights")
    assert given.model.net.source == tiny_base  # what the merged export writes back from

    folder = tmp_path / "export"
    arguments = [f"ckpt_path={moved}", "format=merged", f"model.pretrained={tiny_base}"]
    run_script("scripts/export.py", [*arguments, f"hydra.run.dir={folder}"])
    exported = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(exported, expected["net.model.embed_tokens.weight"])
    arguments = ["--ckpt", str(moved), "--base", str(tiny_base), "--max-new-tokens", "2"]
    assert len(generate_main([*arguments, "--temperature", "0"])) == 1


def test_ema_and_lora_keep_the_base_out_of_both_state_dicts(tmp_path, tiny_base):
    run = lm_run(
        tmp_path, "adapter=lora", f"model.pretrained={tiny_base}", "callbacks=[default,ema]"
    )
    train(compose_config(tmp_path, [*run, "trainer.max_steps=3", "test=false"]))
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    for name in ("state_dict", "current_model_state"):
        network = [key for key in checkpoint[name] if key.startswith("net.")]
        assert network, name
        assert all(is_adapter_key(key) for key in network), name
    restore(tmp_path / "checkpoints" / "last.ckpt")  # loads whole


def test_a_lora_checkpoint_refuses_another_base(lora_run, tmp_path):
    run_dir, _ = lora_run
    cfg = compose_config(tmp_path / "compose", [*FAST, *TINY_LM])
    torch.manual_seed(7)
    instantiate(cfg.model).net.save_pretrained(tmp_path / "other")
    with pytest.raises(CheckpointError, match="adapters only fit the weights they were trained"):
        restore(run_dir / "checkpoints" / "last.ckpt", [f"model.pretrained={tmp_path / 'other'}"])


@pytest.mark.slow
def test_the_scripts_export_a_lora_run_for_peft_and_merged(lora_run, tiny_base, tmp_path):
    run_dir, _ = lora_run
    last = run_dir / "checkpoints" / "last.ckpt"
    for fmt in ("peft", "merged"):
        export_run = [f"ckpt_path={last}", f"format={fmt}", f"hydra.run.dir={tmp_path / fmt}"]
        run_script("scripts/export.py", export_run)
    written = {p.name for p in (tmp_path / "peft").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.yaml"} <= written
    assert not any(name.startswith("model") for name in written), "no copy of the base"
    restored = restore(last)
    tokens = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        ours = restored.model.net(tokens)
    peft_logits = transformers_logits(tiny_base, "qwen3", tokens, tmp_path / "peft")
    torch.testing.assert_close(peft_logits, ours, rtol=1e-4, atol=1e-4)
    merged_logits = transformers_logits(tmp_path / "merged", "qwen3", tokens)
    torch.testing.assert_close(merged_logits, ours, rtol=1e-4, atol=1e-4)

    # Training goes on from the peft folder: it starts from its adapters.
    cont = tmp_path / "continue"
    cont.mkdir()
    train(
        compose_config(
            cont,
            lm_run(
                cont,
                "adapter=lora",
                f"model.pretrained={tiny_base}",
                f"adapter.path={tmp_path / 'peft'}",
                "adapter.r=8",  # the folder's r (16) wins
                "optimizer.lr=0.0",  # a step that leaves the adapters where they start
                "trainer.max_steps=1",
                "test=false",
            ),
        )
    )
    checkpoint = torch.load(cont / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["adapter"]["r"] == 16
    start = restored.model.state_dict()
    adapters = {k: v for k, v in checkpoint["state_dict"].items() if is_adapter_key(k)}
    assert adapters
    assert all(torch.equal(value, start[key]) for key, value in adapters.items())


def test_lora_without_a_pretrained_base_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.pretrained"):
        train(compose_config(tmp_path, lm_run(tmp_path, "adapter=lora", "trainer.max_steps=1")))


def test_lora_on_a_model_without_adapters_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match="ImageClassifier, which takes none"):
        check_config_types(compose_config(tmp_path, [*FAST, "model=cnn", "adapter=lora"]))


def test_freezing_and_lora_do_not_combine(tmp_path, tiny_base):
    run = lm_run(tmp_path, "adapter=lora", f"model.pretrained={tiny_base}", "callbacks=freeze")
    with pytest.raises(ConfigError, match="do not combine"):
        train(compose_config(tmp_path, [*run, "trainer.max_steps=1"]))


@pytest.mark.slow
def test_a_lora_run_killed_mid_training_resumes_exactly(tmp_path, tiny_base):
    """As tests/checkpoints/test_resume.py, with adapters (and their dropout) on a frozen base."""
    run = lm_run(
        tmp_path,
        "adapter=lora",
        f"model.pretrained={tiny_base}",
        "adapter.dropout=0.1",
        "trainer.max_steps=8",
        *RESUMABLE_EVERY_STEP,
    )
    checkpoint = assert_resumes_exactly(run, tmp_path, kill_step=5)
    assert checkpoint["global_step"] == 8
    assert "adapter_base" in checkpoint


# -- several processes -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [["trainer=ddp_cpu"], ["trainer=model_parallel", "trainer.accelerator=cpu"]],
    ids=["ddp", "fsdp2"],
)
def test_two_processes_train_the_adapters_like_one(tmp_path, tiny_base, trainer):
    """16 rows per step either way, fp32: DDP and FSDP2 (gloo) over 2 processes."""
    run = lm_run(
        tmp_path,
        "adapter=lora",
        f"model.pretrained={tiny_base}",
        "adapter.dropout=0.0",
        "trainer.max_steps=4",
        "trainer.precision=32-true",
        "test=false",
    )
    train(compose_config(tmp_path / "one", [*run, "data.batch_size=16"]))
    run_train([*run, *trainer, "data.batch_size=8", "trainer.devices=2"], tmp_path / "two")
    one, two = (
        torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=True)
        for d in ("one", "two")
    )
    network = {k for k in two["state_dict"] if k.startswith("net.")}
    assert network
    assert all(is_adapter_key(k) for k in network)
    assert two["adapter_base"] == one["adapter_base"]
    for key in network:
        torch.testing.assert_close(
            two["state_dict"][key], one["state_dict"][key], rtol=0, atol=2e-5, msg=key
        )


@pytest.mark.slow
def test_an_fsdp2_lora_run_killed_mid_training_resumes_exactly(tmp_path, tiny_base):
    """Under FSDP2 the strategy loads the checkpoint's state before the module's hook: the base
    left out of it must still come back, and the adapters resume exactly."""
    run = lm_run(
        tmp_path,
        "adapter=lora",
        f"model.pretrained={tiny_base}",
        "trainer=model_parallel",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "trainer.devices=2",
        "trainer.max_steps=6",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "callbacks.last_checkpoint.every_n_epochs=null",
        "test=false",
    )
    run_train(run, tmp_path / "whole")
    killer = [
        "+callbacks.killer._target_=tests.run.test_distributed.KillGroupAtStep",
        "+callbacks.killer.step=4",
    ]
    killed = run_train([*run, *killer], tmp_path / "killed", check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    run_train([*run, f"ckpt_path={last}"], tmp_path / "killed")
    expected, checkpoint = (
        torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=True)
        for d in ("whole", "killed")
    )
    assert checkpoint["global_step"] == expected["global_step"] == 6
    assert_same_tensors(expected["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(expected["optimizer_states"], checkpoint["optimizer_states"], "optimizer")


# -- the real size: Qwen3-0.6B's architecture on this CPU ------------------------------------------


@pytest.mark.slow
def test_qwen3_0_6b_with_lora_trains_two_steps_and_exports_for_peft_on_a_cpu(tmp_path):
    """The released architecture (596M parameters, vocabulary 151,936), random weights, bf16 on
    disk as released; no download. Two LoRA steps at 1 x 32 tokens, then the peft export
    gives transformers' Qwen3ForCausalLM the template's logits."""
    cfg = compose_config(tmp_path / "compose", ["model=qwen3_0_6b"])
    config = QwenConfig.from_dict(OmegaConf.to_container(cfg.model.config))
    torch.manual_seed(0)
    QwenLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [
        *text_lm_overrides(shakespeare_excerpt(tmp_path, 20_000)),
        "model=qwen3_0_6b",
        f"model.pretrained={tmp_path / 'base'}",
        "adapter=lora",
        "data.max_seq_len=32",
        "data.batch_size=1",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer=cpu",
        "trainer.max_steps=2",
        "scheduler=none",
        "optimizer.lr=1e-2",  # adapters that move away from their no-op start in two steps
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "logger=csv",
        "callbacks.model_checkpoint=null",
    ]
    train(compose_config(run_dir, overrides))
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == 2
    # 10M adapter weights and their AdamW states (120 MB), no copy of the 1.2 GB base.
    base_bytes = sum(f.stat().st_size for f in (tmp_path / "base").glob("*.safetensors"))
    assert last.stat().st_size < base_bytes / 5
    b_matrices = [v for k, v in checkpoint["state_dict"].items() if "lora_B" in k]
    assert len(b_matrices) == 28 * 7
    assert max(b.abs().max() for b in b_matrices) > 1e-3
    # One restore for the export and the logits: the peft folder `scripts/export.py
    # format=peft` writes, by the function it calls (test_the_scripts_export_a_lora_run_for_peft_
    # and_merged runs the script itself).
    restored = restore(last)
    export_peft(restored.model, tmp_path / "peft")
    tokens = torch.randint(0, config.vocab_size, (1, 32))
    with torch.no_grad():
        ours = restored.model.net.float()(tokens)
    theirs = transformers_logits(tmp_path / "base", "qwen3", tokens, tmp_path / "peft")
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
