"""LoRA on mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE): by default on attention, Gated
DeltaNet and the shared expert, never the router; on the experts' stacked weights when asked
(`target_experts`). The adapters train, merge and export for peft, and FSDP2 shards the experts
like every other weight."""

import copy
import json
import os

import peft
import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from src.models.language.lora.adapter import LoraAdapter, attach_lora
from src.models.language.lora.injection import (
    adapter_state,
    is_adapter_key,
    merged_network,
    plain_key,
)
from src.models.language.lora.peft_folder import read_peft_folder
from src.models.language.lora.spec import AdapterSpec
from src.models.language.parallel import shard_decoder_layers
from src.models.language.qwen import QwenLM
from src.utils.errors import ConfigError
from tests.helpers import tiny_config
from tests.run.support import free_port

KINDS = ("qwen3_moe", "qwen3_5_moe_text")
HF_CLASSES = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
    "qwen3_next": transformers.Qwen3NextForCausalLM,
}
# Exported for peft: peft rewrites the MLP names of qwen3_moe and qwen3_next models into expert
# parameters, so these have a dense layer among the sparse ones, and Qwen3-Next a shared expert.
EXPORTED = {
    "qwen3_moe": {"mlp_only_layers": [1]},
    "qwen3_5_moe_text": {},
    "qwen3_next": {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "mlp_only_layers": [0],
    },
}  # fmt: skip
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0}
EXPERTS = {**LORA, "target_experts": True}
# What LoRA adapts by default: attention, Gated DeltaNet, the shared expert (Qwen3.5-MoE's).
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
DELTANET = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
SHARED_EXPERT = {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"}
DEFAULT_ADAPTED = {"qwen3_moe": ATTENTION, "qwen3_5_moe_text": ATTENTION | DELTANET | SHARED_EXPERT}
STEPS = 8


def tokens(batch=2, length=24, seed=3):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def lora_net(kind, values, seed=0, **model):
    torch.manual_seed(seed)
    net = QwenLM(tiny_config(kind), **model)
    attach_lora(net, values, pretrained=None)
    return net


def randomise_b(net, seed=1, std=0.1):
    """Non-zero B matrices (peft starts them at zero, a no-op update), as training gives."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def mean_loss(net, batch):
    out = net(batch, labels=batch)
    return out.loss_sum / out.tokens


def adapted_modules(net):
    """`self_attn.q_proj`, `mlp.shared_expert.gate_proj`, ... (layer prefix dropped)."""
    names = {name.split(".lora_")[0] for name, _ in net.named_parameters() if is_adapter_key(name)}
    return {name.split(".", 3)[-1] for name in names}


@pytest.fixture(scope="module", params=[(k, e) for k in KINDS for e in (False, True)], ids=str)
def trained(request):
    """A LoRA net trained for a few AdamW steps on one batch: (kind, experts, net, before, losses).

    `before` is the state dict before training; each step's gradients are checked to reach the
    adapters only.
    """
    kind, experts = request.param
    net = lora_net(kind, EXPERTS if experts else LORA)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    batch, losses = tokens(), []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(net, batch)
        loss.backward()
        with_grad = {n for n, p in net.named_parameters() if p.grad is not None}
        assert with_grad == {n for n, p in net.named_parameters() if p.requires_grad}
        assert all(is_adapter_key(name) for name in with_grad), sorted(with_grad)
        optimizer.step()
        losses.append(loss.item())
    return kind, experts, net, before, losses


def test_the_default_targets_are_attention_deltanet_and_the_shared_expert():
    for kind in KINDS:
        net = lora_net(kind, {})  # every default: conf/adapter/lora.yaml's targets
        assert adapted_modules(net) == {f"{p}.{n}" for p, n in prefixed(DEFAULT_ADAPTED[kind])}
        names = [name for name, _ in net.named_parameters()]
        assert not any(".mlp.gate." in n and is_adapter_key(n) for n in names)  # the router
        assert not any("shared_expert_gate" in n and is_adapter_key(n) for n in names)
        assert not any(".experts." in n and is_adapter_key(n) for n in names)
        assert not any(p.requires_grad for n, p in net.named_parameters() if not is_adapter_key(n))


def prefixed(modules):
    """(owner, name) of each adapted module: self_attn / linear_attn / mlp."""
    for name in modules:
        if name in ATTENTION:
            yield "self_attn", name
        elif name in DELTANET:
            yield "linear_attn", name
        else:
            yield "mlp", name


def test_lora_trains_and_leaves_the_router_and_experts_frozen(trained):
    _, _, net, before, losses = trained
    assert losses[-1] < losses[0] - 0.1, losses
    after = net.state_dict()
    frozen = [k for k in before if not is_adapter_key(k)]
    routers = [k for k in frozen if k.endswith(".mlp.gate.weight")]
    expert_weights = [k for k in frozen if ".experts." in k]
    assert len(routers) == 4
    assert len(expert_weights) == 8
    for key in frozen:  # the base, router and experts included, is bitwise unchanged
        assert torch.equal(after[key], before[key]), key
    for name, parameter in net.named_parameters():
        assert parameter.requires_grad == is_adapter_key(name), name


def test_expert_adapters_exist_only_when_asked_and_receive_gradients(trained):
    kind, experts, net, before, _ = trained
    expert_adapters = {k for k in before if is_adapter_key(k) and ".experts." in k}
    if not experts:
        assert not expert_adapters
        return
    # One LoRA per stacked weight and layer: down_proj's wrapper outermost, as on transformers'.
    assert len(expert_adapters) == 4 * 2 * 2
    config = tiny_config(kind)
    e, hidden, inner, r = config.num_experts, config.hidden_size, config.moe_intermediate_size, 4
    shapes = {
        "mlp.experts.base_layer.lora_A.default.weight": (r * e, hidden),  # gate_up_proj's
        "mlp.experts.base_layer.lora_B.default.weight": (2 * inner, r * e),
        "mlp.experts.lora_A.default.weight": (r * e, inner),  # down_proj's
        "mlp.experts.lora_B.default.weight": (hidden, r * e),
    }
    for key in expert_adapters:
        assert tuple(before[key].shape) == shapes[key.split(".", 3)[-1]], key
        # B started at zero; training moved it, so its gradients arrived.
        if "lora_B" in key:
            assert not torch.equal(net.state_dict()[key], before[key]), key
    # The base experts keep their names under the two wrappers.
    assert "model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj" in before
    net.zero_grad(set_to_none=True)
    mean_loss(net, tokens(seed=5)).backward()
    for name, parameter in net.named_parameters():
        if name in expert_adapters:
            assert parameter.grad is not None, name
            assert parameter.grad.abs().sum() > 0, name


def test_the_merged_model_gives_the_adapted_logits(trained):
    kind, experts, net, _, _ = trained
    for block in net.sparse_blocks():  # the last forward's router graph cannot be copied
        block.last_routing = None
    net = copy.deepcopy(net)
    randomise_b(net)  # larger updates than 8 steps give, so that a wrong merge cannot hide
    merged = merged_network(net)
    assert not any(is_adapter_key(k) or "base_layer" in k for k in merged.state_dict())
    plain = QwenLM(tiny_config(kind))
    assert merged.state_dict().keys() == plain.state_dict().keys()
    batch = tokens(seed=9)
    with torch.no_grad():
        ours, theirs = net.eval()(batch), merged.eval()(batch)
        unadapted = {k: v for k, v in net.state_dict().items() if not is_adapter_key(k)}
        plain.load_state_dict({plain_key(k): v for k, v in unadapted.items()})
        base = plain.eval()(batch)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (base - ours).abs().max() > 1e-2  # the adapters matter
    if experts:  # ... and the experts' are merged in: their weights moved
        for key, value in merged.state_dict().items():
            if ".experts." in key:
                wrapped = key.replace(".experts.", ".experts.base_layer.base_layer.")
                assert not torch.equal(value, unadapted[wrapped]), key


def test_plain_key_drops_nested_base_layers():
    assert plain_key("m.experts.base_layer.base_layer.down_proj") == "m.experts.down_proj"
    assert plain_key("m.q_proj.base_layer.weight") == "m.q_proj.weight"
    assert plain_key("m.q_proj.weight") == "m.q_proj.weight"


def test_targets_that_are_no_linear_layer_are_refused_naming_what_to_ask():
    with pytest.raises(ConfigError, match="router"):
        AdapterSpec.from_dict({"target_modules": ["q_proj", "gate"]})
    with pytest.raises(ConfigError, match="target_experts=true"):
        AdapterSpec.from_dict({"target_modules": ["gate_up_proj"]})
    with pytest.raises(ConfigError, match="true or false"):
        AdapterSpec.from_dict({"target_experts": "yes"})
    with pytest.raises(ConfigError, match="has none"):
        lora_net("qwen3", EXPERTS)
    # shared_expert_gate (nn.Linear(hidden, 1)) is adapted only when named.
    net = lora_net("qwen3_5_moe_text", {**LORA, "target_modules": ["shared_expert_gate"]})
    assert adapted_modules(net) == {"mlp.shared_expert_gate"}


# -- export for peft ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(EXPORTED))
def exported(request, tmp_path_factory):
    """(kind, LoraAdapter with experts targeted and non-zero B, base folder, peft folder)."""
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    QwenLM(tiny_config(kind, **EXPORTED[kind])).save_pretrained(folder / "base")
    net = QwenLM.from_pretrained(folder / "base")
    adapter = attach_lora(net, {**EXPERTS, "dropout": 0.05}, pretrained=str(folder / "base"))
    randomise_b(net)
    adapter.save_peft(folder / "adapter")
    return kind, adapter, folder / "base", folder / "adapter"


def test_peft_loads_the_expert_adapters_onto_transformers_with_the_same_logits(exported):
    kind, adapter, base, folder = exported
    config = json.loads((folder / "adapter_config.json").read_text())
    parameters = set(config["target_parameters"])
    assert {"experts.down_proj", "experts.gate_up_proj"} <= parameters
    mlp = {f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
    shared = {f"mlp.shared_expert.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
    # The MLP names that peft would rewrite are weights; Qwen3.5-MoE's stay module names.
    expected = {"qwen3_moe": mlp, "qwen3_next": mlp | shared, "qwen3_5_moe_text": set()}[kind]
    assert parameters - {"experts.down_proj", "experts.gate_up_proj"} == expected
    assert ("gate_proj" in config["target_modules"]) == (kind == "qwen3_5_moe_text")
    assert config["lora_dropout"] == 0.0  # peft takes no dropout on a parameter
    batch = tokens(seed=11)
    model = HF_CLASSES[kind].from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = adapter.net.eval()(batch)
        without = model(batch).logits
        theirs = peft.PeftModel.from_pretrained(model, folder).eval()(batch).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (without - ours).abs().max() > 1e-2


def test_the_exported_folder_loads_back_with_its_expert_adapters(exported):
    _, adapter, base, folder = exported
    read, _, trained_on = read_peft_folder(AdapterSpec(path=str(folder)), adapter.net)
    assert read.target_experts
    assert trained_on == adapter.base["fingerprint"]
    again = attach_lora(QwenLM.from_pretrained(base), {"path": str(folder)}, pretrained=str(base))
    assert isinstance(again, LoraAdapter)
    assert again.spec.target_experts
    expected = adapter_state(adapter.net)
    loaded = adapter_state(again.net)
    assert expected.keys() == loaded.keys()
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key


def test_one_expert_weight_alone_is_refused_on_reading(exported, tmp_path):
    _, adapter, _, folder = exported
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_parameters"] = ["experts.down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (folder / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ConfigError, match="both"):
        read_peft_folder(AdapterSpec(path=str(tmp_path)), adapter.net)


# -- FSDP2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    """A 1 x 1 (data x tensor parallel) CPU mesh over gloo, in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    finally:
        dist.destroy_process_group()


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("adapter", [None, EXPERTS], ids=["whole", "lora_experts"])
def test_fsdp2_shards_the_experts_and_gives_the_same_loss_and_gradients(mesh, kind, adapter):
    """Under activation checkpointing, each decoder layer an FSDP unit: experts, router and
    adapters are sharded DTensors like every weight, and loss and gradients are unchanged."""
    torch.manual_seed(0)
    reference = QwenLM(tiny_config(kind), activation_checkpointing=True)
    if adapter:
        attach_lora(reference, adapter, pretrained=None)
        randomise_b(reference)
    sharded = copy.deepcopy(reference)
    shard_decoder_layers(sharded, mesh)
    for name, parameter in sharded.named_parameters():
        assert isinstance(parameter, DTensor), name
        assert parameter.placements == (Shard(0),), name
    batch = tokens()
    losses, gradients = [], []
    for net in (reference, sharded):
        loss = mean_loss(net, batch)
        loss.backward()
        losses.append(loss.detach())
        gradients.append({n: full(p.grad) for n, p in net.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    assert gradients[0].keys() == gradients[1].keys()
    experts = [n for n in gradients[0] if ".experts." in n]
    assert experts  # the experts' weights (whole) or their adapters (LoRA) got gradients
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=0, atol=1e-5, msg=name)


def two_rank_worker(rank, port, kind, results_file):
    """One of two FSDP2 ranks: its half of the batch; rank 0 checks against one process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        reference = QwenLM(tiny_config(kind), activation_checkpointing=True)
        attach_lora(reference, EXPERTS, pretrained=None)
        randomise_b(reference)
        sharded = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        shard_decoder_layers(sharded, mesh)
        halves = tokens(batch=4).chunk(2)
        mean_loss(sharded, halves[rank]).backward()  # FSDP2 averages the ranks' gradients
        gradients = {n: full(p.grad) for n, p in sharded.named_parameters() if p.grad is not None}
        if rank == 0:
            (sum(mean_loss(reference, half) for half in halves) / 2).backward()
            differences = {
                name: (gradients[name] - parameter.grad).abs().max().item()
                for name, parameter in reference.named_parameters()
                if parameter.grad is not None
            }
            assert differences.keys() == gradients.keys()
            results_file.write_text(json.dumps(differences))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp2_processes_give_the_expert_adapters_the_gradients_of_one(tmp_path):
    results = tmp_path / "differences.json"
    torch.multiprocessing.start_processes(
        two_rank_worker, args=(free_port(), "qwen3_5_moe_text", results), nprocs=2,
        start_method="spawn",
    )  # fmt: skip
    differences = json.loads(results.read_text())
    assert any(".experts." in name for name in differences)
    assert max(differences.values()) < 1e-5, differences
