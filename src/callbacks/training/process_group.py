"""Destroy the default process group before Python shuts down, whatever its backend."""

import atexit

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class DestroyProcessGroupAtExit(Callback):
    """Destroys the process group at exit whatever its backend: Lightning does so for NCCL only.

    A gloo group left to interpreter shutdown can abort a rank that finished cleanly (SIGABRT
    after "terminate called without an active exception"): its worker thread may still be freeing
    the last collective's tensors when Python stops handing out the GIL. Destroying the group from
    atexit, before shutdown starts, joins that thread first.

    `setup` runs in every rank once its process group exists, including the processes that
    `ddp_spawn` starts, which none of this program's module-level code reaches.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            atexit.unregister(destroy_process_group)  # once per process, however many stages
            atexit.register(destroy_process_group)
