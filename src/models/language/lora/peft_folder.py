"""peft's adapter folder: `adapter_config.json` + `adapter_model.safetensors`.

`peft.PeftModel.from_pretrained` loads it onto transformers' Qwen3ForCausalLM /
Qwen3NextForCausalLM / Qwen3MoeForCausalLM / Qwen3_5MoeForCausalLM built from the same base
folder (the experts' adapters included: they are the same ParamWrapper on the same stacked
weights there), and a run reads it back to go on training (`adapter.path`).
"""

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from src.models.language.lora.injection import (
    ADAPTER_NAME,
    adapter_state,
    is_parameter_lora,
    lora_modules,
)
from src.models.language.lora.spec import (
    EXPERT_PARAMETERS,
    MLP_TARGETS,
    AdapterSpec,
    import_peft,
)
from src.models.language.qwen import QwenLM
from src.models.language.qwen.transformers_format.state_dict_adapter import adapter_for
from src.utils.errors import ConfigError, MissingFileError

log = logging.getLogger(__name__)

# The model types whose MLP names peft rewrites into expert parameters (see peft_config_dict).
PEFT_REWRITES_MLP = ("qwen3_moe", "qwen3_next")
LAYER_PREFIX = re.compile(r"^(.*\.)?layers\.\d+\.")  # `model.layers.3.` before `mlp.gate_proj`
EXPERT_WEIGHTS = tuple(name.rsplit(".", 1)[-1] for name in EXPERT_PARAMETERS)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the transformers model's names


def to_peft_key(key: str) -> str:
    """The name that peft's files give an adapter weight of the network.

    `model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    """
    return PEFT_PREFIX + key.replace(f".{ADAPTER_NAME}.", ".")


def from_peft_key(key: str) -> str:
    key = key.removeprefix(PEFT_PREFIX)
    for matrix in ("lora_A", "lora_B"):
        key = key.replace(f".{matrix}.weight", f".{matrix}.{ADAPTER_NAME}.weight")
    return key


def is_mlp(module_name: str) -> bool:
    """Whether an adapted module is a dense MLP's or a shared expert's projection."""
    return module_name.rsplit(".", 1)[-1] in MLP_TARGETS and ".mlp." in module_name


def peft_config_dict(spec: AdapterSpec, net: QwenLM, base: dict[str, str] | None) -> dict:
    """adapter_config.json for transformers' model of `net`'s architecture.

    peft (0.17 to at least 0.21), under transformers 5, takes every "qwen3_moe" and "qwen3_next"
    model for a mixture of experts and turns the MLP names `gate_proj`/`up_proj`/`down_proj` of
    target_modules into the routed experts' parameters, dropping the adapters of a dense MLP
    (Qwen3-Next's, or a dense layer's among sparse ones) and of a shared expert. Those models'
    adapters therefore name their MLP weights in `target_parameters` (`mlp.gate_proj.weight`,
    `mlp.shared_expert.gate_proj.weight`), which peft adapts with the same B @ A update. The
    experts' own adapters are `target_parameters` too (`experts.gate_up_proj`,
    `experts.down_proj`). That form takes no dropout, a training-only setting, so it is written
    as 0 there.
    """
    modules = {name for name, module in lora_modules(net).items() if not is_parameter_lora(module)}
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    parameters: list[str] = []
    if net.config.model_type in PEFT_REWRITES_MLP:
        parameters = sorted(
            {f"{LAYER_PREFIX.sub('', name)}.weight" for name in modules if is_mlp(name)}
        )
        targets = [name for name in targets if name not in MLP_TARGETS]
    if spec.target_experts:
        parameters += list(EXPERT_PARAMETERS)
    dropout = 0.0 if parameters else float(spec.dropout)
    config = import_peft().LoraConfig(
        task_type="CAUSAL_LM",
        base_model_name_or_path=base["path"] if base else None,
        r=int(spec.r),
        lora_alpha=float(spec.alpha),
        lora_dropout=dropout,
        target_modules=targets,
        target_parameters=parameters or None,
    )
    values = config.to_dict()
    for key, value in values.items():  # sets are not JSON
        if isinstance(value, set):
            values[key] = sorted(value)
    return values


def save_peft_folder(
    net: QwenLM, spec: AdapterSpec, base: dict[str, str] | None, folder: str | Path
) -> None:
    """Write adapter_config.json + adapter_model.safetensors as `PeftModel.save_pretrained` does.

    The base's fingerprint rides in the safetensors metadata.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = peft_config_dict(spec, net, base)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = adapter_for(net.config)  # a multimodal folder keeps the decoder elsewhere
    tensors = {
        to_peft_key(names.hf_key(key)): value.detach().contiguous().clone()
        for key, value in adapter_state(net).items()
    }
    metadata = {"format": "pt"}
    if base:
        metadata["base_fingerprint"] = base["fingerprint"]
    save_file(tensors, folder / WEIGHTS_FILE, metadata=metadata)


def read_peft_folder(
    spec: AdapterSpec, net: QwenLM
) -> tuple[AdapterSpec, dict[str, torch.Tensor], str | None]:
    """The spec that a peft LoRA folder describes, its weights and the base fingerprint it records.

    The spec takes the folder's r, alpha and targets and this run's dropout; the weights are by
    `net`'s names (a multimodal folder's adapters sit under its language model's prefix).
    """
    assert spec.path is not None, "read_peft_folder reads the folder that spec.path names"
    folder = Path(spec.path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not (config_file.is_file() and weights_file.is_file()):
        raise MissingFileError(
            f"adapter.path={spec.path!r} holds no {CONFIG_FILE} and {WEIGHTS_FILE}: pass a "
            f"folder written by scripts/export.py format=peft or PeftModel.save_pretrained."
        )
    values = json.loads(config_file.read_text())
    unsupported = {
        "peft_type": values.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(values.get("use_dora")),
        "use_rslora": bool(values.get("use_rslora")),
        "bias": values.get("bias", "none") != "none",
        "modules_to_save": bool(values.get("modules_to_save")),
        "rank_pattern / alpha_pattern": bool(values.get("rank_pattern"))
        or bool(values.get("alpha_pattern")),
    }
    if problems := [name for name, bad in unsupported.items() if bad]:
        raise ConfigError(f"{config_file}: plain LoRA only; this folder sets {problems}")
    targets = values.get("target_modules") or []
    if isinstance(targets, str):  # a regex, or peft's "all-linear"
        raise ConfigError(
            f"{config_file}: target_modules={targets!r} is a pattern; LoRA here names its "
            f'modules, so list them there (e.g. ["q_proj", "v_proj"]).'
        )
    # Qwen3-MoE and Qwen3-Next exports name their MLP weights as parameters
    # (`mlp.gate_proj.weight`), and any export its experts' (`experts.gate_up_proj`).
    parameters = values.get("target_parameters") or []
    experts = {p.rsplit(".", 1)[-1] for p in parameters if p.rsplit(".", 1)[-1] in EXPERT_WEIGHTS}
    if experts and experts != set(EXPERT_WEIGHTS):
        raise ConfigError(
            f"{config_file}: target_parameters={parameters} adapts the experts' "
            f"{sorted(experts)} alone; LoRA here adapts both {list(EXPERT_PARAMETERS)} or neither"
        )
    others = [p for p in parameters if p.rsplit(".", 1)[-1] not in EXPERT_WEIGHTS]
    if strange := [p for p in others if not p.endswith(".weight")]:
        raise ConfigError(
            f"{config_file}: target_parameters {strange} name no projection's weight nor the "
            f"experts' {list(EXPERT_PARAMETERS)}"
        )
    targets = [*targets, *(p.rsplit(".", 2)[-2] for p in others)]
    read = AdapterSpec(
        r=int(values["r"]),
        alpha=float(values["lora_alpha"]),
        dropout=spec.dropout,
        target_modules=tuple(dict.fromkeys(targets)),
        target_experts=bool(experts),
        path=spec.path,
    )
    given = {k: getattr(spec, k) for k in ("r", "alpha", "target_modules", "target_experts")}
    differing = [
        k for k, v in given.items() if v != getattr(read, k) and v != AdapterSpec.default(k)
    ]
    if differing:
        log.warning(
            "adapter.path=%s sets %s from its %s; this run's values are ignored",
            spec.path,
            ", ".join(differing),
            CONFIG_FILE,
        )
    names = adapter_for(net.config)
    state = {
        names.key_from_hf(from_peft_key(key)): value
        for key, value in load_file(weights_file).items()
    }
    with safe_open(weights_file, "pt") as handle:
        trained_on = (handle.metadata() or {}).get("base_fingerprint")
    return read, state, trained_on
