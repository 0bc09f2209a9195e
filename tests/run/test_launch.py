"""All ranks of a torchrun or srun launch name the run directory alike, and only rank 0 writes
Hydra's files; a single process names it by the time, as before."""

import threading
from datetime import datetime

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch.distributed import TCPStore

from src.run import launch
from src.run.config.compose import CONF_DIR
from src.utils.errors import LaunchError
from tests.run.support import free_port

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
    port = free_port()
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
    with pytest.raises(LaunchError, match=r"hydra\.run\.dir=.*--rdzv-id"):
        launch.launch_name(TIME_FORMAT)


TORCHRUN_RANK_1 = {
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "1",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


def hydra_files(config_name):
    """(job name, which names the log file; where .hydra/ goes) for this process."""
    launch.register_launch_resolvers()
    GlobalHydra.instance().clear()
    initialize_config_dir(config_dir=CONF_DIR, version_base="1.3")
    hydra = compose(config_name, return_hydra_config=True).hydra
    return hydra.job.name, hydra.output_subdir


@pytest.mark.parametrize("config_name", ["train", "eval"])
def test_only_rank_zero_saves_hydras_files_and_other_ranks_log_apart(monkeypatch, config_name):
    assert hydra_files(config_name) == (config_name, ".hydra")
    for name, value in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(name, value)
    assert hydra_files(config_name) == (f"{config_name}_rank1", None)
    monkeypatch.setenv("RANK", "0")
    assert hydra_files(config_name) == (config_name, ".hydra")
