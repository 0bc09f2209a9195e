"""The two ways checkpoints store a mixture of experts, and QwenLM's stacked one.

Released Qwen MoE folders (and transformers' `save_pretrained`) keep one tensor per expert and
projection: `...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`. In memory transformers 5
stacks them as `experts.gate_up_proj` [E, 2 * I, hidden] (gate rows, then up rows) and
`experts.down_proj` [E, hidden, I], as QwenLM does; a folder in that layout loads unchanged.
"""

import re

import torch

from src.utils.errors import ConfigError

PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
    r"\.weight$"
)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def stack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """QwenLM's stacked expert weights for a checkpoint's per-expert tensors.

    Tensors in any other layout (stacked ones included) pass through unchanged. A layer whose
    experts are numbered with gaps, or miss one of the three projections, is refused.
    """
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, tensor in state_dict.items():
        match = PER_EXPERT.match(key)
        if match is None:
            out[key] = tensor
            continue
        projections = grouped.setdefault(match["experts"], {p: {} for p in PROJECTIONS})
        projections[match["projection"]][int(match["index"])] = tensor
    for experts, projections in grouped.items():
        count = 1 + max(max(by_index) for by_index in projections.values() if by_index)
        gate, up, down = (
            _in_order(experts, name, projections[name], count) for name in PROJECTIONS
        )
        out[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat(pair, dim=0) for pair in zip(gate, up, strict=True)]
        )
        out[f"{experts}.down_proj"] = torch.stack(down)
    return out


def unstack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released checkpoints' per-expert tensors for QwenLM's stacked expert weights."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            experts = key.removesuffix(".gate_up_proj")
            for index, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2, dim=0)
                out[f"{experts}.{index}.gate_proj.weight"] = gate.contiguous()
                out[f"{experts}.{index}.up_proj.weight"] = up.contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            experts = key.removesuffix(".down_proj")
            for index, down in enumerate(tensor):
                out[f"{experts}.{index}.down_proj.weight"] = down.contiguous()
        else:
            out[key] = tensor
    return out


def _in_order(
    experts: str, projection: str, by_index: dict[int, torch.Tensor], count: int
) -> list[torch.Tensor]:
    """The tensors of experts 0..count-1 in order, or a ConfigError naming the missing ones."""
    if missing := [i for i in range(count) if i not in by_index]:
        raise ConfigError(
            f"The checkpoint's {experts} lack {projection} for experts {missing}: a folder must "
            f"hold every expert of every layer"
        )
    return [by_index[i] for i in range(count)]
