"""LoRA adapters on a QwenLM (`adapter=lora`), built with peft's injection API.

`attach_lora` freezes the whole network, in its own dtype, and injects peft's LoRA layers
(`peft.inject_adapter_in_model`) into the projections that `AdapterSpec.target_modules`
names, by the checkpoints' own module names (`q_proj`, `in_proj_qkvz`, `gate_proj`, ...): only
the adapters then require gradients, so only they reach the optimizer.

An adapter run starts from a base, a transformers folder (`model.pretrained`), and names it in
its checkpoints by path and `fingerprint` instead of storing a second copy of its weights
(`strip_base` / `complete_state_dict`, called from the LightningModule's checkpoint hooks).
`save_peft_folder` writes `adapter_config.json` + `adapter_model.safetensors`, the folder that
`peft.PeftModel.from_pretrained` loads onto transformers' Qwen3ForCausalLM /
Qwen3NextForCausalLM built from the same base folder; `read_peft_folder` reads one back to go
on training (`adapter.path`); `merged_network` folds the adapters into a plain QwenLM.

Peft is given `net.model` (the embedding, layers and norm), never the QwenLM itself: peft reads
`.config.model_type` and, for "qwen3_next", rewrites MLP targets for a mixture-of-experts model
that this dense-MLP Qwen3-Next is not. For the same reason an exported Qwen3-Next adapter names
its MLP projections as `target_parameters` (see `peft_config_dict`).
"""

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from src.models.language.qwen import QwenLM
from src.models.language.qwen.hf_io import _weight_files, check_same_architecture, read_hf_weights
from src.utils.errors import CheckpointError, ConfigError, MissingFileError
from src.utils.weights import describe_mismatch

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # peft's name for the one adapter of a model
# Every projection of Qwen3 / Qwen3-Next layers, by the checkpoints' names: full attention,
# Gated DeltaNet, MLP. Names a model lacks (in_proj_* in a dense Qwen3) match nothing.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkvz",
    "in_proj_ba",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the transformers model's names
NETWORK_PREFIX = "net."  # the LanguageModel attribute holding the QwenLM
# The state dicts of a Lightning checkpoint: the weights, and the raw ones that the EMA
# callback moves aside when it stores the averaged weights as `state_dict`.
STATE_KEYS = ("state_dict", "current_model_state")
# How much of each tensor the fingerprint reads: its first, middle and last bytes.
SAMPLE_BYTES = 4096
FINGERPRINT_SCHEME = "sha256 of safetensors headers and 3 x 4 KiB of every tensor"


def _peft():
    """peft, imported when first used: it loads much of transformers (about 1 s), which runs
    without adapters never need."""
    import peft

    return peft


@dataclass(frozen=True)
class AdapterSpec:
    """The `adapter` config group's values: LoRA rank `r`, scale `alpha / r`, dropout on the
    adapters' input, the module names to adapt, and optionally `path`, a peft adapter folder to
    start from (which then sets r, alpha and target_modules)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    path: str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "AdapterSpec":
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ConfigError(f"adapter: unknown keys {unknown}; it takes {sorted(known)}")
        values = dict(values)
        if "target_modules" in values:
            targets = values["target_modules"]
            values["target_modules"] = (targets,) if isinstance(targets, str) else tuple(targets)
        spec = cls(**values)
        if int(spec.r) < 1 or not spec.target_modules or not 0 <= float(spec.dropout) < 1:
            raise ConfigError(
                f"adapter: r must be at least 1 (got {spec.r}), dropout in [0, 1) (got "
                f"{spec.dropout}) and target_modules non-empty (got {list(spec.target_modules)})"
            )
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's hyperparameters)."""
        values = asdict(self)
        values["target_modules"] = list(self.target_modules)
        return values

    def lora_config(self):
        return _peft().LoraConfig(
            r=int(self.r),
            lora_alpha=float(self.alpha),
            lora_dropout=float(self.dropout),
            target_modules=list(self.target_modules),
        )


@dataclass
class LoraAdapters:
    """What a LanguageModel knows of its adapters: their spec (as built, after reading
    `path`), and the identity of the base they sit on (None until a base is loaded)."""

    spec: AdapterSpec
    base: dict[str, str] | None


def attach_lora(net: QwenLM, adapter: Mapping[str, Any], pretrained: str | None) -> LoraAdapters:
    """Freeze `net` and inject LoRA adapters (loaded from `adapter["path"]` when given).

    `pretrained` is the base folder `net` was just loaded from; None when the base is to come
    from a checkpoint (restoring a run: `complete_state_dict` loads it then).
    """
    spec = AdapterSpec.from_dict(adapter)
    base = base_identity(pretrained) if pretrained else None
    state = None
    if spec.path:
        spec, state, trained_on = read_peft_folder(spec)
        if base and trained_on and trained_on != base["fingerprint"]:
            raise CheckpointError(
                f"adapter.path={spec.path}: these adapters were trained on a base with "
                f"fingerprint {trained_on}, but model.pretrained={pretrained} has "
                f"{base['fingerprint']}. Start from the base they were trained on."
            )
    net.requires_grad_(False)
    try:
        _peft().inject_adapter_in_model(spec.lora_config(), net.model, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft's "Target modules ... not found in the base model"
        raise ConfigError(
            f"adapter.target_modules={list(spec.target_modules)} names no linear module of "
            f"this model (its projections: {', '.join(DEFAULT_TARGETS)}): {error}"
        ) from None
    if state is not None:
        load_adapter_state(net, state, spec.path)
    return LoraAdapters(spec=AdapterSpec(**{**asdict(spec), "path": None}), base=base)


# -- keys ---------------------------------------------------------------------------------------


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_state(net: QwenLM) -> dict[str, torch.Tensor]:
    """The adapters' weights, by the network's own names."""
    return {key: value for key, value in net.state_dict().items() if is_adapter_key(key)}


def to_peft_key(key: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft's file names)."""
    return PEFT_PREFIX + key.replace(f".{ADAPTER_NAME}.", ".")


def from_peft_key(key: str) -> str:
    key = key.removeprefix(PEFT_PREFIX)
    for matrix in ("lora_A", "lora_B"):
        key = key.replace(f".{matrix}.weight", f".{matrix}.{ADAPTER_NAME}.weight")
    return key


# -- the base's identity ------------------------------------------------------------------------


def fingerprint(folder: str | Path) -> str:
    """A cheap identity of a transformers folder's weights, for multi-GB checkpoints too: a
    sha256 of every safetensors header (names, dtypes, shapes, offsets) and of the first, middle
    and last 4 KiB of every tensor, so that another checkpoint of the same architecture
    (fine-tuned, merged, re-initialised) differs. Not a full hash: it reads a few MB."""
    digest = hashlib.sha256()
    for file in _weight_files(Path(folder)):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = handle.read(size)
            digest.update(file.name.encode() + header)
            tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
            for name in sorted(tensors):
                start, end = tensors[name]["data_offsets"]
                middle = (start + end) // 2
                for offset in sorted({start, max(start, middle - SAMPLE_BYTES // 2)}):
                    handle.seek(8 + size + offset)
                    digest.update(handle.read(min(SAMPLE_BYTES, end - offset)))
                handle.seek(8 + size + max(start, end - SAMPLE_BYTES))
                digest.update(handle.read(min(SAMPLE_BYTES, end - start)))
    return digest.hexdigest()


def base_identity(folder: str | Path) -> dict[str, str]:
    return {
        "path": str(Path(folder).resolve()),
        "fingerprint": fingerprint(folder),
        "scheme": FINGERPRINT_SCHEME,
    }


# -- checkpoints --------------------------------------------------------------------------------


def is_base_key(key: str) -> bool:
    """A LanguageModel state-dict key of the frozen base (`net.`, not an adapter)."""
    return key.startswith(NETWORK_PREFIX) and not is_adapter_key(key)


def strip_base(checkpoint: dict[str, Any], adapters: LoraAdapters) -> None:
    """Drop the frozen base's weights from a Lightning checkpoint, in place, and record which
    base it was: `checkpoint["adapter_base"]`."""
    if adapters.base is None:
        raise ConfigError(
            "adapter=lora trains adapters on a pretrained base, and this model has none: set "
            "model.pretrained=<transformers folder> (to fine-tune a randomly initialised model, "
            "train it whole, without an adapter)."
        )
    for name in STATE_KEYS:
        if isinstance(state := checkpoint.get(name), dict):
            for key in [k for k in state if is_base_key(k)]:
                del state[key]
    checkpoint["adapter_base"] = dict(adapters.base)


def complete_state_dict(
    checkpoint: dict[str, Any], module: torch.nn.Module, adapters: LoraAdapters, net: QwenLM
) -> None:
    """Put the base's weights back into an adapter checkpoint's state dicts (in place), after
    checking that the base is the one it was trained on; load that base into `net` first when
    it has none yet (a model rebuilt without `model.pretrained`)."""
    recorded = checkpoint.get("adapter_base")
    if recorded is None:
        return  # a whole-model checkpoint: nothing was left out
    if adapters.base is None:
        folder = Path(recorded["path"])
        if not (folder / "config.json").is_file():
            raise MissingFileError(
                f"This checkpoint holds LoRA adapters on the base {folder}, which is gone: put "
                f"the base back there, or pass its new place as model.pretrained=<folder>."
            )
        load_base(net, folder)
        adapters.base = base_identity(folder)
    if adapters.base["fingerprint"] != recorded["fingerprint"]:
        raise CheckpointError(
            f"This checkpoint holds LoRA adapters trained on the base {recorded['path']} "
            f"(fingerprint {recorded['fingerprint'][:16]}...), but the model's base "
            f"{adapters.base['path']} has fingerprint {adapters.base['fingerprint'][:16]}...: "
            f"adapters only fit the weights they were trained on. Set model.pretrained to "
            f"that base."
        )
    own = module.state_dict()
    for name in STATE_KEYS:
        if not isinstance(state := checkpoint.get(name), dict):
            continue
        if absent := [k for k in own if k not in state and not is_base_key(k)]:
            raise CheckpointError(
                f"The adapter checkpoint's {name} lacks weights that it should hold: "
                f"{absent[:8]}{' ...' if len(absent) > 8 else ''}."
            )
        state.update({k: v for k, v in own.items() if is_base_key(k) and k not in state})


def load_base(net: QwenLM, folder: str | Path) -> None:
    """Load a transformers folder's weights under `net`'s adapters (peft renames an adapted
    `x.weight` to `x.base_layer.weight`)."""
    check_same_architecture(net.config, folder)
    names = {
        key.replace(".base_layer.", "."): key for key in net.state_dict() if not is_adapter_key(key)
    }
    own = net.state_dict()
    expected = {plain: own[key] for plain, key in names.items()}
    state = read_hf_weights(folder, expected, net.config.tie_word_embeddings)
    net.load_state_dict({names[plain]: value for plain, value in state.items()}, strict=False)


# -- peft folders -------------------------------------------------------------------------------


def peft_config_dict(spec: AdapterSpec, net: QwenLM, base: dict[str, str] | None) -> dict:
    """adapter_config.json for transformers' model of `net`'s architecture.

    peft (0.17 to at least 0.21) treats every "qwen3_next" model as a mixture of experts and,
    under transformers 5, turns the MLP names `gate_proj`/`up_proj`/`down_proj` of
    target_modules into expert parameters that a dense Qwen3-Next lacks, dropping those
    adapters. A Qwen3-Next adapter therefore names its MLP weights in `target_parameters`
    (`mlp.gate_proj.weight`), which peft adapts with the same B @ A update; that form takes no
    dropout, a training-only setting, so it is written as 0 there.
    """
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora_module_names(net)})
    parameters: list[str] = []
    dropout = float(spec.dropout)
    if net.config.is_next:
        parameters = [f"mlp.{name}.weight" for name in targets if name in MLP_TARGETS]
        targets = [name for name in targets if name not in MLP_TARGETS]
        dropout = 0.0 if parameters else dropout
    config = _peft().LoraConfig(
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


def lora_modules(net: QwenLM) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers in `net`, by name."""
    layer = _peft().tuners.lora.LoraLayer
    return {name: module for name, module in net.named_modules() if isinstance(module, layer)}


def lora_module_names(net: QwenLM) -> list[str]:
    return list(lora_modules(net))


def save_peft_folder(net: QwenLM, adapters: LoraAdapters, folder: str | Path) -> None:
    """adapter_config.json + adapter_model.safetensors, as `PeftModel.save_pretrained` writes
    them; the base's fingerprint rides in the safetensors metadata."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = peft_config_dict(adapters.spec, net, adapters.base)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {
        to_peft_key(key): value.detach().contiguous().clone()
        for key, value in adapter_state(net).items()
    }
    metadata = {"format": "pt"}
    if adapters.base:
        metadata["base_fingerprint"] = adapters.base["fingerprint"]
    save_file(tensors, folder / WEIGHTS_FILE, metadata=metadata)


def read_peft_folder(spec: AdapterSpec) -> tuple[AdapterSpec, dict[str, torch.Tensor], str | None]:
    """The spec that a peft LoRA folder describes (its r, alpha and targets; this run's
    dropout), its weights by the network's names, and the base fingerprint it records."""
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
    # A Qwen3-Next export names its MLP weights as parameters: `mlp.gate_proj.weight`.
    targets = [*targets, *(p.rsplit(".", 2)[-2] for p in values.get("target_parameters") or [])]
    read = AdapterSpec(
        r=int(values["r"]),
        alpha=float(values["lora_alpha"]),
        dropout=spec.dropout,
        target_modules=tuple(dict.fromkeys(targets)),
        path=spec.path,
    )
    given = {k: getattr(spec, k) for k in ("r", "alpha", "target_modules")}
    if differing := [k for k, v in given.items() if v != getattr(read, k) and v != _default(k)]:
        log.warning(
            "adapter.path=%s sets %s from its %s; this run's values are ignored",
            spec.path,
            ", ".join(differing),
            CONFIG_FILE,
        )
    state = {from_peft_key(key): value for key, value in load_file(weights_file).items()}
    with safe_open(weights_file, "pt") as handle:
        trained_on = (handle.metadata() or {}).get("base_fingerprint")
    return read, state, trained_on


def _default(name: str) -> Any:
    return AdapterSpec.__dataclass_fields__[name].default


def load_adapter_state(net: QwenLM, state: dict[str, torch.Tensor], where: str) -> None:
    expected = adapter_state(net)
    if problems := describe_mismatch(expected, state):
        raise CheckpointError(f"The adapters in {where} do not fit this model: {problems}.")
    net.load_state_dict(state, strict=False)


# -- merging ------------------------------------------------------------------------------------


@torch.no_grad()
def merged_network(net: QwenLM) -> QwenLM:
    """A plain QwenLM whose adapted weights are W + (alpha / r) B @ A; `net` is unchanged and
    the unadapted tensors are shared with it, not copied."""
    deltas = {
        name: module.get_delta_weight(ADAPTER_NAME) for name, module in lora_modules(net).items()
    }
    state = {}
    for key, value in net.state_dict().items():
        if is_adapter_key(key):
            continue
        key = key.replace(".base_layer.", ".")
        owner, _, leaf = key.rpartition(".")
        if owner in deltas and leaf == "weight":
            value = value + deltas[owner].to(value.dtype)
        state[key] = value
    with torch.device("meta"):
        merged = QwenLM(net.config)
    merged.load_state_dict(state, strict=True, assign=True)
    merged.tie_weights()
    return merged


def lora_parameter_count(net: QwenLM) -> int:
    return sum(p.numel() for name, p in net.named_parameters() if is_adapter_key(name))
