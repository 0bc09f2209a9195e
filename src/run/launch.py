"""Give the ranks of one distributed launch one run directory, where only rank 0 writes Hydra's.

Hydra names a run directory after the time the process composes its config. Under torchrun or
srun every rank composes its own, milliseconds apart, and would write into a folder of its own.
Lightning fixes the directory only for the ranks it starts itself (`python train.py
trainer=ddp`), and Hydra knows nothing of ranks, so conf/hydra/default.yaml uses these
resolvers:

`${launch_name:<strftime format>}` names the launch once for all ranks:
- torchrun: rank 0's time, handed to the other ranks through the elastic agent's store (the
  TCP store every worker reaches at MASTER_ADDR:MASTER_PORT). A restarted worker group reads
  the same name, so `ckpt_path=last` finds its checkpoints again.
- srun with several tasks: `slurm-<job id>` (`slurm-<job id>.<step>` after a job's first
  step), which every task knows without talking; a requeued job keeps its id. A batch script
  or an interactive shell that runs one job after another keeps names by the time.
- one process: the time now, as Hydra's `${now:...}`.

`${rank_zero_only:<value>}` is the value on rank 0 and null on the others (`.hydra/` is saved
once); `${rank_suffix:}` is `_rank<N>` on ranks other than 0, also those Lightning starts
itself: each rank logs to its own `<task>_rank<N>.log`.

`hydra.run.dir=...` on the command line replaces the name.
"""

import os
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import OmegaConf

from src.utils.errors import LaunchError

STORE_KEY_PREFIX = "launch_name/"
# The other ranks wait this long for rank 0 to publish the name (they start together).
STORE_TIMEOUT = timedelta(minutes=5)
# Slurm numbers a batch script's, an interactive shell's and the external step from here on.
FIRST_SPECIAL_SLURM_STEP = 0xFFFFFFF0


def launch_name(time_format: str) -> str:
    """The name all ranks of this launch agree on (see the module docstring)."""
    if TorchElasticEnvironment.detect():
        return torchrun_launch_name(time_format)
    if in_multi_task_srun_step():
        return slurm_launch_name()
    return datetime.now().strftime(time_format)


def in_multi_task_srun_step() -> bool:
    """Tell whether srun started this process as one of several tasks.

    A batch script itself (or an interactive shell) is not: one run follows another there, under
    the same job and step.
    """
    step = os.environ.get("SLURM_STEP_ID", "")
    return (
        SLURMEnvironment.detect()
        and int(os.environ.get("SLURM_NTASKS", "1")) > 1
        and step.isdigit()
        and int(step) < FIRST_SPECIAL_SLURM_STEP
    )


def slurm_launch_name() -> str:
    step = os.environ["SLURM_STEP_ID"]
    suffix = "" if step == "0" else f".{step}"
    return f"slurm-{os.environ['SLURM_JOB_ID']}{suffix}"


@cache
def torchrun_launch_name(time_format: str) -> str:
    """Name a torchrun launch by rank 0's time, agreed through the elastic agent's store.

    Without that store (disabled with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), the rendezvous id
    names it when it names the job.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if run_id == "none":
            raise LaunchError(
                "Under torchrun without the elastic agent's store the ranks cannot agree on a "
                "run directory. Pin it (hydra.run.dir=logs/train/runs/<name>) or give the job "
                "a name (torchrun --rdzv-id=<name>)."
            )
        return f"torchrun-{run_id}"
    from torch.distributed import TCPStore  # torch loads slowly: only torchrun runs need it

    store = TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=STORE_TIMEOUT,
    )
    key = STORE_KEY_PREFIX + time_format
    if launch_rank() == 0:
        # Only sets it when no earlier attempt of this launch did: restarts keep the name.
        return store.compare_set(key, "", datetime.now().strftime(time_format)).decode()
    return store.get(key).decode()


def external_launcher() -> type[TorchElasticEnvironment | SLURMEnvironment] | None:
    """Return Lightning's environment class for torchrun or srun if one started this process.

    Its ranks exist already then. None otherwise.
    """
    for environment in (TorchElasticEnvironment, SLURMEnvironment):
        if environment.detect():
            return environment
    return None


def launch_rank() -> int:
    """This process's global rank when torchrun or srun started it, else 0."""
    launcher = external_launcher()
    return 0 if launcher is None else launcher().global_rank()


def rank_zero_only(value: Any) -> Any:
    return value if launch_rank() == 0 else None


def process_rank() -> int:
    """Return this process's rank: torchrun's or srun's, else Lightning's LOCAL_RANK.

    Lightning sets LOCAL_RANK in the processes it starts for `trainer=ddp` on one node, which
    compose their own config.
    """
    if external_launcher() is not None:
        return launch_rank()
    return int(os.environ.get("LOCAL_RANK", 0))


def rank_suffix() -> str:
    rank = process_rank()
    return f"_rank{rank}" if rank else ""


def image_classes(data_dir: str) -> int:
    """Count data=imagefolder's class folders, its `num_classes`, when the config is read."""
    # Imported here: the data layer loads torchvision, which a launcher process never needs.
    from src.data.image.imagefolder import image_classes as count_classes

    return count_classes(data_dir)


def register_launch_resolvers() -> None:
    """Make the resolvers above usable in configs."""
    resolvers: dict[str, tuple[Callable[..., Any], bool]] = {
        # Cached per config like `${now:...}`: a run's directory keeps its name however often
        # it is read.
        "launch_name": (launch_name, True),
        "rank_zero_only": (rank_zero_only, False),
        "rank_suffix": (rank_suffix, False),
        "image_classes": (image_classes, False),
    }
    for name, (resolver, use_cache) in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=use_cache)
