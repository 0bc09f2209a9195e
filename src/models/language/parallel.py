"""FSDP2 sharding of a QwenLM, for Lightning's ModelParallelStrategy (`trainer=model_parallel`).

The strategy calls the LightningModule's `configure_model`, which calls `shard_decoder_layers`
with its device mesh. Under any other strategy the mesh is None and nothing changes.

The mesh is Lightning's ("data_parallel", "tensor_parallel"), or with expert parallelism
(src/run/model_parallel.py) ("expert_data_parallel", "expert_parallel", "tensor_parallel"),
whose first two dimensions together are the data-parallel ranks.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from src.models.language.expert_parallel import (
    EXPERT_MESH_DIMS,
    ExpertParallelExperts,
    data_parallel_mesh,
)
from src.models.language.qwen import QwenLM
from src.models.language.qwen.moe import Experts
from src.utils.errors import ConfigError


def shard_decoder_layers(net: QwenLM, device_mesh: DeviceMesh | None) -> None:
    """Shard each decoder layer, then the rest as the root, over the mesh's data-parallel ranks.

    The rest is the embedding, final norm and lm_head. A mixture of experts' router, stacked
    expert weights [E, out, in] and their LoRA adapters are sharded on dim 0 like every other
    parameter (FSDP2 pads when E does not divide by the mesh size); LoRA on the experts folds
    B @ A into the gathered weight inside the layer's forward, so it needs nothing more here.
    With an expert-parallel mesh the experts are split instead (`split_experts`), and FSDP
    leaves them alone. Idempotent: Lightning calls `configure_model` again for testing after
    fitting.
    """
    if device_mesh is None or isinstance(net, FSDPModule):
        return
    if device_mesh["tensor_parallel"].size() > 1:
        raise ConfigError(
            f"QwenLM has no tensor-parallel plan: set trainer.strategy.tensor_parallel_size=1 "
            f"and trainer.strategy.data_parallel_size to the number of processes "
            f"(got a {device_mesh.shape} mesh)."
        )
    split = set()
    if device_mesh.mesh_dim_names == EXPERT_MESH_DIMS:
        split = split_experts(net, device_mesh)
    mesh = data_parallel_mesh(device_mesh)
    layers = net.model.layers
    assert isinstance(layers, nn.ModuleList)  # QwenLM keeps its decoder layers in one
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=split)
    fully_shard(net, mesh=mesh, ignored_params=split)


def split_experts(net: QwenLM, device_mesh: DeviceMesh) -> set[nn.Parameter]:
    """Replace each sparse layer's experts by their expert-parallel version; their weights.

    The weights stay sharded as FSDP2 would shard them, whole experts on each data-parallel
    rank, so E must be a multiple of the data-parallel size (src/models/language/
    expert_parallel.py).
    """
    size = device_mesh["expert_parallel"].size()
    ranks = data_parallel_mesh(device_mesh).size()
    blocks = net.sparse_blocks()
    c = net.config
    if not blocks:
        raise ConfigError(
            f"trainer.strategy.expert_parallel_size={size} splits a mixture of experts' experts, "
            f"and this {c.model_type} model has none: set trainer.strategy.expert_parallel_size=1"
        )
    if c.num_experts % size or c.num_experts % ranks:
        raise ConfigError(
            f"trainer.strategy.expert_parallel_size={size} over {ranks} data-parallel processes "
            f"needs num_experts ({c.num_experts}) to be a multiple of both (each process "
            f"stores whole experts): choose sizes that divide {c.num_experts}"
        )
    split: set[nn.Parameter] = set()
    for block in blocks:
        if not isinstance(block.experts, Experts):
            raise ConfigError(
                "adapter.target_experts=true cannot run with expert parallelism: set "
                "trainer.strategy.expert_parallel_size=1 or adapter.target_experts=false"
            )
        experts = ExpertParallelExperts(block.experts, device_mesh)
        block.register_module("experts", experts)
        split.update(experts.parameters())
    return split
