"""`trainer=model_parallel`: Lightning's ModelParallelStrategy plus an expert-parallel dimension."""

from typing import Any

from lightning.pytorch import strategies
from torch.distributed.device_mesh import init_device_mesh

from src.models.language.expert_parallel import EXPERT_MESH_DIMS, data_parallel_mesh
from src.utils.errors import ConfigError


class ModelParallelStrategy(strategies.ModelParallelStrategy):
    """FSDP2 (and tensor parallelism) as Lightning's, plus `expert_parallel_size` N.

    With N > 1 the device mesh is ("expert_data_parallel", "expert_parallel", "tensor_parallel")
    of sizes (data_parallel_size / N, N, tensor_parallel_size): each group of N consecutive
    data-parallel ranks splits a mixture of experts' experts between them, and every rank still
    reads its own share of the batch. The model shards itself over it in `configure_model`
    (src/models/language/parallel.py). N = 1 is Lightning's strategy unchanged.
    """

    def __init__(self, *args: Any, expert_parallel_size: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expert_parallel_size = expert_parallel_size
        if expert_parallel_size < 1:
            raise ConfigError(
                f"trainer.strategy.expert_parallel_size={expert_parallel_size}: give the number "
                f"of ranks that split the experts, 1 for none"
            )
        if isinstance(self._data_parallel_size, int):  # else "auto", known once launched
            self._check_divides(self._data_parallel_size)

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.expert_parallel_size == 1:
            return
        assert isinstance(self._data_parallel_size, int)  # Lightning resolved "auto"
        assert isinstance(self._tensor_parallel_size, int)
        self._check_divides(self._data_parallel_size)
        shape = (
            self._data_parallel_size // self.expert_parallel_size,
            self.expert_parallel_size,
            self._tensor_parallel_size,
        )
        self._device_mesh = init_device_mesh(
            self.root_device.type, shape, mesh_dim_names=EXPERT_MESH_DIMS
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every data-parallel rank reads its own share, those that split the experts included."""
        mesh = data_parallel_mesh(self.device_mesh)
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    def _check_divides(self, data_parallel_size: int) -> None:
        if data_parallel_size % self.expert_parallel_size:
            raise ConfigError(
                f"trainer.strategy.expert_parallel_size={self.expert_parallel_size} must divide "
                f"the {data_parallel_size} data-parallel processes (data_parallel_size, the "
                f"world size over tensor_parallel_size): choose a divisor of {data_parallel_size}"
            )
