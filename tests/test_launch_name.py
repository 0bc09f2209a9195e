"""All ranks of a torchrun or srun launch name the run directory alike, and only rank 0 writes
Hydra's files; a single process names it by the time, as before."""

import socket
import threading
from datetime import datetime

import pytest
from omegaconf import OmegaConf
from torch.distributed import TCPStore

from src.utils import launch_name as launch
from src.utils.errors import LaunchError
from src.utils.hydra_callbacks import RankZeroRunFiles

TIME_FORMAT = "%Y-%m-%d_%H-%M-%S_%f"
LAUNCH_VARIABLES = [
    "TORCHELASTIC_RUN_ID",
    *["SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_JOB_NAME"],
]


@pytest.fixture(autouse=True)
def outside_any_launcher(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    launch.torchrun_launch_name.cache_clear()
    yield
    launch.torchrun_launch_name.cache_clear()


def test_one_process_names_its_run_by_the_time():
    before = datetime.now()
    name = launch.launch_name(TIME_FORMAT)
    assert before <= datetime.strptime(name, TIME_FORMAT) <= datetime.now()
    assert launch.launch_name(TIME_FORMAT) != name  # two runs, two folders


@pytest.mark.parametrize(("step", "expected"), [("0", "slurm-4242"), ("3", "slurm-4242.3")])
def test_every_task_of_an_srun_step_names_the_run_by_the_job(monkeypatch, step, expected):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_ID", step)
    assert launch.launch_name(TIME_FORMAT) == expected


@pytest.mark.parametrize(
    ("tasks", "step", "job_name"),
    [("1", "0", "train"), ("8", "4294967294", "train"), ("8", "0", "interactive")],
    ids=["one task", "batch script", "interactive shell"],
)
def test_runs_under_one_job_but_not_one_srun_step_are_named_by_the_time(
    monkeypatch, tasks, step, job_name
):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", tasks)
    monkeypatch.setenv("SLURM_STEP_ID", step)
    monkeypatch.setenv("SLURM_JOB_NAME", job_name)
    datetime.strptime(launch.launch_name(TIME_FORMAT), TIME_FORMAT)


@pytest.fixture
def agent_store(monkeypatch):
    """A TCP store as torchrun's elastic agent hosts one, and the variables it gives workers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(name, value)
    return store


def name_as_rank(monkeypatch, rank):
    """What a fresh process with this rank resolves."""
    monkeypatch.setenv("RANK", str(rank))
    launch.torchrun_launch_name.cache_clear()
    return launch.launch_name(TIME_FORMAT)


def test_torchrun_ranks_take_rank_zeros_time_and_a_restart_keeps_it(monkeypatch, agent_store):
    names = {}
    # Rank 1 starts first and waits for rank 0's name.
    monkeypatch.setenv("RANK", "1")
    waiting = threading.Thread(target=lambda: names.update(one=launch.launch_name(TIME_FORMAT)))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive()
    monkeypatch.setenv("RANK", "0")
    launch.torchrun_launch_name.cache_clear()
    names["zero"] = launch.launch_name(TIME_FORMAT)
    waiting.join(timeout=30)
    assert names["one"] == names["zero"]
    datetime.strptime(names["zero"], TIME_FORMAT)
    assert name_as_rank(monkeypatch, 0) == names["zero"]  # the restarted worker group


def test_torchrun_without_the_agent_store_uses_the_rendezvous_id(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert launch.launch_name(TIME_FORMAT) == "torchrun-job-7"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    launch.torchrun_launch_name.cache_clear()
    with pytest.raises(LaunchError, match="hydra.run.dir=.*--rdzv-id"):
        launch.launch_name(TIME_FORMAT)


def hydra_config():
    return OmegaConf.create({"hydra": {"job": {"name": "train"}, "output_subdir": ".hydra"}})


TORCHRUN_RANK = {
    "TORCHELASTIC_RUN_ID": "none",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "1",
}


def test_a_torchrun_rank_other_than_zero_logs_apart_and_saves_no_config(monkeypatch):
    config = hydra_config()
    RankZeroRunFiles().on_run_start(config)
    assert config.hydra == hydra_config().hydra  # not launched by torchrun: unchanged
    for name, value in TORCHRUN_RANK.items():
        monkeypatch.setenv(name, value)
    RankZeroRunFiles().on_run_start(config)
    assert config.hydra.job.name == "train_rank1" and config.hydra.output_subdir is None
    monkeypatch.setenv("RANK", "0")
    config = hydra_config()
    RankZeroRunFiles().on_run_start(config)
    assert config.hydra == hydra_config().hydra
