"""Distributed training on CPU (2 processes over gloo): DDP and FSDP2 give the same result as
one process, DDP resumes exactly, launches that would break are refused; FSDP is checked as
config (Lightning runs it on GPUs only)."""

import json
import os
import random
import signal
import subprocess
import sys
from types import SimpleNamespace

import hydra
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import ShardingStrategy

from src.callbacks.training.process_group import DestroyProcessGroupAtExit
from src.models.language.parallel import shard_decoder_layers
from src.run.config.checks import check_config_types
from src.run.trainer import build_trainer, check_launch
from src.utils.errors import ConfigError
from tests.helpers import (
    FAST,
    ROOT,
    assert_same_tensors,
    compose_config,
    run_train,
)
from tests.run.support import free_port
from train import train

# SimpleNet has no dropout, so one process and two see the same computation.
COMMON = [*FAST, "model=simplenet", "trainer.max_epochs=2", "test=false"]
# The packed-text LM shrunk to seconds. Packed rows all have max_seq_len slots, but each rank's
# share of supervised tokens differs (padding at row ends): the step's token mean spans ranks.
LM_MODEL = [
    "experiment=lm_text",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.head_dim=16",
]
LM_RUN = [
    *FAST,
    *LM_MODEL,
    "data.max_seq_len=64",
    "scheduler.scheduler.warmup_steps=2",
    "trainer.max_steps=8",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
    "test=false",
]


def run_ddp(run_dir, *overrides, check=True):
    return run_train(
        [*COMMON, "trainer=ddp_cpu", "data.batch_size=32", *overrides], run_dir, check=check
    )


def final_weights(run_dir):
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("net.")}


def one_and_two_processes(tmp_path, overrides, one, two):
    """Final weights of train.py run in this process with `one` added to `overrides`, and in
    two processes with `two` added."""
    train(compose_config(tmp_path / "one", [*overrides, *one]))
    run_train([*overrides, *two, "trainer.devices=2"], tmp_path / "two")
    return final_weights(tmp_path / "one"), final_weights(tmp_path / "two")


def assert_same_weights(one, two, rtol, atol):
    assert two.keys() == one.keys()
    for key, expected in one.items():
        torch.testing.assert_close(two[key], expected, rtol=rtol, atol=atol, msg=key)


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    one, two = one_and_two_processes(
        tmp_path, COMMON, ["data.batch_size=64"], ["trainer=ddp_cpu", "data.batch_size=32"]
    )
    assert_same_weights(one, two, rtol=1e-5, atol=1e-6)
    assert len(list((tmp_path / "two").glob("metrics.json"))) == 1


@pytest.mark.slow
def test_a_multirun_with_ddp_is_refused_with_the_way_out(tmp_path):
    result = run_train(
        ["-m", "trainer=ddp_cpu", "seed=1,2", f"hydra.sweep.dir={tmp_path}"], check=False
    )
    assert result.returncode != 0
    assert "cannot use trainer.strategy=ddp" in result.stderr
    assert "Traceback" not in result.stderr
    assert "trainer.strategy=ddp_spawn" in result.stderr  # the way out


class KillGroupAtStep(Callback):
    """SIGKILLs every process of the DDP run (its process group) at the end of `step`."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.killpg(os.getpgid(0), signal.SIGKILL)


@pytest.mark.slow
def test_ddp_killed_mid_epoch_resumes_exactly(tmp_path):
    every_step = [
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "callbacks.last_checkpoint.every_n_epochs=null",
        "trainer.deterministic=true",
    ]
    run_ddp(tmp_path / "uninterrupted", *every_step)
    kill_step = random.Random(3).randrange(3, 38)
    killer = [
        "+callbacks.killer._target_=tests.run.test_distributed.KillGroupAtStep",
        f"+callbacks.killer.step={kill_step}",
    ]
    killed = run_ddp(tmp_path / "resumed", *every_step, *killer, check=False)
    assert killed.returncode == -9
    last = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    run_ddp(tmp_path / "resumed", *every_step, f"ckpt_path={last}")
    assert_same_tensors(
        final_weights(tmp_path / "uninterrupted"), final_weights(tmp_path / "resumed"), "weights"
    )


class CountCollectives(Callback):
    """Counts the collectives each rank calls during training steps, into `<path>.<rank>.json`.
    (DDP's gradient all-reduce runs in its C++ reducer and is not counted: it is the strategy.)"""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce")

    def __init__(self, path):
        self.path, self.counts, self.steps, self.in_step = path, {}, 0, False
        for name in self.NAMES:
            setattr(torch.distributed, name, self._counted(name, getattr(torch.distributed, name)))

    def _counted(self, name, collective):
        def counted(*args, **kwargs):
            if self.in_step:
                self.counts[name] = self.counts.get(name, 0) + 1
            return collective(*args, **kwargs)

        return counted

    def on_train_batch_start(self, *args):
        self.in_step = True

    def on_train_batch_end(self, *args):
        self.in_step = False
        self.steps += 1

    def on_train_end(self, trainer, *args):
        record = {"steps": self.steps, "counts": self.counts}
        with open(f"{self.path}.{trainer.global_rank}.json", "w") as file:
            json.dump(record, file)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "steps", "per_step"),
    [
        ([*COMMON, "+trainer.limit_train_batches=6"], 2 * 6, {}),  # two epochs of 6 batches
        # The step's token mean needs the token and loss sums of every rank: one all-reduce.
        ([*LM_RUN, "trainer.precision=32-true"], 8, {"all_reduce": 1}),  # trainer.max_steps
    ],
    ids=["classifier", "lm"],
)
def test_training_steps_call_no_collective_beyond_what_the_loss_needs(
    tmp_path, run, steps, per_step
):
    counter = [
        "+callbacks.count._target_=tests.run.test_distributed.CountCollectives",
        f"+callbacks.count.path={tmp_path / 'collectives'}",
    ]
    run_train([*run, "trainer=ddp_cpu", *counter], tmp_path / "run")
    # The rank Lightning starts itself logs where the README says, in the pinned directory too.
    logs = {path.name for path in (tmp_path / "run").glob("*.log")}
    assert logs == {"train.log", "train_rank1.log"}, logs
    for rank in (0, 1):
        record = json.loads((tmp_path / f"collectives.{rank}.json").read_text())
        assert record["steps"] == steps, f"rank {rank} counted {record['steps']} steps"
        assert record["counts"] == {name: n * steps for name, n in per_step.items()}


UNPINNED_DDP = [*COMMON, "trainer=ddp_cpu", "data.batch_size=32"]


def the_one_run_directory(log_dir):
    """The only run directory under `log_dir`, after checking that rank 0 wrote the run's
    files there and each rank its own log."""
    (run_dir,) = (log_dir / "train" / "runs").iterdir()
    for written in ["metrics.json", "checkpoints/last.ckpt", ".hydra/config.yaml"]:
        assert (run_dir / written).exists(), written
    assert {path.name for path in run_dir.glob("*.log")} == {"train.log", "train_rank1.log"}
    return run_dir


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_directory_that_nobody_pinned(tmp_path):
    torchrun = ROOT / ".venv" / "bin" / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not found in .venv")
    launcher = (str(torchrun), "--nproc_per_node=2")
    run_train([*UNPINNED_DDP, f"paths.log_dir={tmp_path}"], launcher=launcher)
    the_one_run_directory(tmp_path)


@pytest.mark.slow
def test_srun_tasks_share_one_run_directory_named_after_the_job(tmp_path):
    """Two processes with the environment srun gives the two tasks of job 4242 on one node."""
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train"}
    slurm |= {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    slurm |= {"SLURM_NODELIST": "localhost", "MASTER_PORT": str(port)}
    command = [sys.executable, str(ROOT / "train.py"), *UNPINNED_DDP, f"paths.log_dir={tmp_path}"]
    tasks = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env=os.environ | slurm | {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    for task in tasks:
        _, stderr = task.communicate(timeout=300)
        assert task.returncode == 0, stderr[-3000:]
    assert the_one_run_directory(tmp_path).name == "slurm-4242"


# -- launches that a multirun refuses, and those it allows ------------------------------------


@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp", "model_parallel"])
def test_a_multirun_refuses_strategies_that_would_re_run_it(tmp_path, trainer):
    cfg = compose_config(
        tmp_path, [f"trainer={trainer}", "trainer.devices=2", "hydra.mode=MULTIRUN"]
    )
    with pytest.raises(ConfigError, match="A multirun"):
        check_launch(cfg)


@pytest.mark.parametrize(
    "environment",
    [{"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"}, {"TORCHELASTIC_RUN_ID": "job-1"}],
    ids=["srun", "torchrun"],
)
def test_a_multirun_whose_ranks_an_external_launcher_starts_may_use_ddp(
    tmp_path, monkeypatch, environment
):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    check_launch(compose_config(tmp_path, ["trainer=ddp_cpu", "hydra.mode=MULTIRUN"]))


# -- Exit: a finished rank must not abort while Python shuts down ------------------------------

# atexit runs its handlers last-in first-out: the probe runs after any the callback registers.
EXIT_PROBE = """
import atexit, sys
import torch
import torch.distributed as dist
from src.callbacks.training.process_group import DestroyProcessGroupAtExit

atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
if sys.argv[2] == "callback":
    for stage in ("fit", "test"):
        DestroyProcessGroupAtExit().setup(None, None, stage)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("with_callback", "alive_at_exit"), [("callback", False), ("none", True)])
def test_a_rank_destroys_its_gloo_group_before_python_shuts_down(with_callback, alive_at_exit):
    """Left to interpreter shutdown, a gloo group's worker thread can still be freeing the last
    collective when Python stops handing out the GIL, and the rank aborts (SIGABRT)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE, init_method, with_callback],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"group alive at exit: {alive_at_exit}" in result.stdout


def test_every_trainer_destroys_its_process_group_at_exit_even_with_callbacks_off(tmp_path):
    trainer = build_trainer(compose_config(tmp_path, ["callbacks=none"]))
    assert any(isinstance(callback, DestroyProcessGroupAtExit) for callback in trainer.callbacks)


# -- FSDP (GPUs only in Lightning 2.6) and FSDP2 (ModelParallelStrategy, also on CPU) ----------


def test_lightning_runs_fsdp_on_gpus_only(tmp_path):
    cfg = compose_config(tmp_path, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"])
    with pytest.raises(Exception, match="requires a GPU accelerator"):
        hydra.utils.instantiate(cfg.trainer)


def test_the_fsdp_config_shards_each_decoder_layer_and_recomputes_through_the_model_switch(
    tmp_path,
):
    cfg = compose_config(
        tmp_path, [*LM_MODEL, "trainer=fsdp", "model.activation_checkpointing=true"]
    )
    check_config_types(cfg)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert cfg.trainer.precision == "auto"
    assert strategy.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert strategy._state_dict_type == "full"  # one weights-only loadable file
    assert strategy._activation_checkpointing_kwargs == {}  # one switch: the model's
    net = hydra.utils.instantiate(cfg.model).net
    units = strategy.kwargs["auto_wrap_policy"]._run_policy(net, set(), {})
    assert set(units) == set(net.model.layers)
    assert all(layer.checkpointed for layer in net.model.layers)


def test_the_model_parallel_config_is_fsdp2_over_every_device(tmp_path):
    cfg = compose_config(tmp_path, ["trainer=model_parallel", "trainer.devices=4"])
    check_config_types(cfg)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    assert not strategy._save_distributed_checkpoint  # one weights-only loadable file


class TensorParallelMesh:
    """What shard_decoder_layers reads of a 1 x 2 (data x tensor parallel) device mesh."""

    shape = (1, 2)

    def __getitem__(self, name):
        return SimpleNamespace(size=lambda: 2 if name == "tensor_parallel" else 1)


def test_sharding_refuses_a_tensor_parallel_mesh():
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        shard_decoder_layers(None, TensorParallelMesh())


@pytest.mark.slow
def test_two_ddp_processes_train_the_lm_like_one_with_the_same_global_batch(tmp_path):
    """16 rows per step either way: 16 at once, or 4 per micro-batch x 2 accumulated x 2 ranks.
    In float64 the two agree to rounding (about 1e-13); in fp32 they differ by up to 1e-5 after
    8 AdamW steps (summation order, amplified where gradients nearly cancel), a margin that
    would hide a wrong weighting of the ranks' tokens."""
    one, two = one_and_two_processes(
        tmp_path,
        [*LM_RUN, "trainer.precision=64-true"],
        ["data.batch_size=16"],
        ["trainer=ddp_cpu", "data.batch_size=4", "trainer.accumulate_grad_batches=2"],
    )
    assert_same_weights(one, two, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_two_ddp_processes_train_the_lm_like_one_on_padded_batches(tmp_path):
    """Padded rows differ in length between ranks: the step's token mean must not depend on
    it (each rank normalises by its rows, the same everywhere, before the token rescale)."""
    one, two = one_and_two_processes(
        tmp_path,
        [*LM_RUN, "trainer.precision=64-true", "data.packing=false", "data.max_seq_len=256"],
        ["data.batch_size=8"],
        ["trainer=ddp_cpu", "data.batch_size=4"],
    )
    assert_same_weights(one, two, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_two_fsdp2_processes_train_the_lm_like_one_with_the_same_global_batch(tmp_path):
    """trainer=model_parallel on CPU: FSDP2 over gloo, fp32 (the strategy has no float64), with
    a single checkpoint file gathered on rank 0, and each decoder layer recomputed in backward
    inside its FSDP unit."""
    one, two = one_and_two_processes(
        tmp_path,
        [*LM_RUN, "trainer.precision=32-true"],
        ["data.batch_size=16"],
        [
            "trainer=model_parallel",
            "trainer.accelerator=cpu",
            "data.batch_size=8",
            "model.activation_checkpointing=true",
        ],
    )
    assert_same_weights(one, two, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_a_multirun_with_ddp_spawn_runs_every_job_and_summarises_the_sweep(tmp_path):
    """The combination that works locally: ddp_spawn starts its ranks with multiprocessing
    inside each job instead of re-running the command line."""
    multirun = ["-m", "trainer=ddp_cpu", "trainer.strategy=ddp_spawn", "seed=1,2", *FAST]
    run_train([*multirun, f"hydra.sweep.dir={tmp_path}"], timeout=600)
    for job in ("0", "1"):
        assert "test/acc" in json.loads((tmp_path / job / "metrics.json").read_text())["metrics"]
    assert (tmp_path / "summary.md").read_text().count("| ok |") == 2
