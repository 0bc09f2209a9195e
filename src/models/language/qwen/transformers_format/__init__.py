"""transformers' checkpoint format for QwenLM: folders, per-model-type state-dict adapters, experts.

`folders` reads and writes config.json and (sharded) safetensors; `state_dict_adapter` maps each
model type's config and tensor names to QwenLM's; `expert_layout` converts a mixture of experts
between the released per-expert tensors and QwenLM's stacked ones.
"""
