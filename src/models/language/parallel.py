"""FSDP2 sharding of a QwenLM, for Lightning's ModelParallelStrategy (`trainer=model_parallel`).

The strategy calls the LightningModule's `configure_model`, which calls `shard_decoder_layers`
with its device mesh. Under any other strategy the mesh is None and nothing changes.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from src.models.language.qwen import QwenLM
from src.utils.errors import ConfigError


def shard_decoder_layers(net: QwenLM, device_mesh: DeviceMesh | None) -> None:
    """Shard each decoder layer, then the rest as the root, over the mesh's data-parallel dimension.

    The rest is the embedding, final norm and lm_head. A mixture of experts' router, stacked
    expert weights [E, out, in] and their LoRA adapters are sharded on dim 0 like every other
    parameter (FSDP2 pads when E does not divide by the mesh size); LoRA on the experts folds
    B @ A into the gathered weight inside the layer's forward, so it needs nothing more here.
    Idempotent: Lightning calls `configure_model` again for testing after fitting.
    """
    if device_mesh is None or isinstance(net, FSDPModule):
        return
    if device_mesh["tensor_parallel"].size() > 1:
        raise ConfigError(
            f"QwenLM has no tensor-parallel plan: set trainer.strategy.tensor_parallel_size=1 "
            f"and trainer.strategy.data_parallel_size to the number of processes "
            f"(got a {device_mesh.shape} mesh)."
        )
    mesh = device_mesh["data_parallel"]
    layers = net.model.layers
    assert isinstance(layers, nn.ModuleList)  # QwenLM keeps its decoder layers in one
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
