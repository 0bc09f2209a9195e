"""`trainer.precision: auto`: the precision each kind of device computes natively (with the
device's capabilities mocked), an explicit precision winning, the one log line, and the LM
experiments leaving the choice to the Trainer built from them."""

import logging

import pytest
import torch

from src.run.trainer import AutoPrecisionTrainer, build_trainer, plain_config, resolved_precision
from src.utils import hardware
from src.utils.hardware import machine_precision, read_cpu_flags
from tests.helpers import compose_config

AMX = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16", "avx512_bf16"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
NO_BF16 = frozenset({"avx2", "avx512f", "fma"})
LOGGER = "src.run.trainer"
LM_EXPERIMENTS = ("lm_text", "lm_shakespeare", "lm_sft")


@pytest.fixture
def machine(monkeypatch):
    """Set what this machine has: CUDA GPUs (their compute capabilities), MPS, ROCm and the
    CPU's flags. By default: no GPU, and a CPU without bf16 units."""

    def set_machine(gpus=(), mps=False, hip=None, cpu_flags=NO_BF16):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index])
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(hardware, "read_cpu_flags", lambda: cpu_flags)

    set_machine()
    return set_machine


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda"])
def test_cuda_gpus_with_bf16_units_train_in_bf16_mixed(machine, accelerator):
    machine(gpus=[(8, 0), (9, 0)])  # Ampere, Hopper
    choice = machine_precision(accelerator)
    assert (choice.precision, choice.reason) == ("bf16-mixed", "the GPU has bf16 units")


def test_a_gpu_before_ampere_trains_in_16_mixed_even_beside_newer_ones(machine):
    machine(gpus=[(8, 6), (7, 0)])  # an RTX 3090 and a V100
    choice = machine_precision("gpu")
    assert choice.precision == "16-mixed", choice
    assert "no bf16 units" in choice.reason


def test_rocm_gpus_count_as_bf16_whatever_their_capability(machine):
    machine(gpus=[(7, 0)], hip="6.2")
    assert machine_precision("auto").precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("flags", "precision", "units"),
    [(AMX, "bf16-mixed", "AMX"), (AVX512_BF16, "bf16-mixed", "AVX-512 BF16")],
)
def test_a_cpu_with_bf16_units_trains_in_bf16_mixed(machine, flags, precision, units):
    machine(cpu_flags=flags)
    choice = machine_precision("cpu")
    assert (choice.precision, choice.reason) == (precision, f"the CPU has {units} bf16 units")


@pytest.mark.parametrize("flags", [NO_BF16, None], ids=["no-bf16-flags", "flags-unknown"])
def test_a_cpu_without_bf16_units_trains_in_fp32(machine, flags):
    machine(cpu_flags=flags)
    assert machine_precision("auto").precision == "32-true"


def test_accelerator_cpu_decides_by_the_cpu_on_a_machine_with_gpus(machine):
    machine(gpus=[(9, 0)], cpu_flags=NO_BF16)
    assert machine_precision("cpu").precision == "32-true"
    assert machine_precision("auto").precision == "bf16-mixed"


def test_apple_gpus_train_in_fp32_unless_told_otherwise(machine):
    machine(mps=True, cpu_flags=AMX)  # auto and gpu pick MPS before anything else, as Lightning
    assert machine_precision("auto").precision == "32-true"
    assert machine_precision("mps").precision == "32-true"


def test_the_cpu_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    monkeypatch.setattr(hardware.platform, "system", lambda: "Linux")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "amx_bf16"}  # the first CPU's
    assert read_cpu_flags(tmp_path / "missing") is None


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", 64, None])
def test_an_explicit_precision_wins_and_logs_nothing(machine, caplog, precision):
    machine(cpu_flags=AMX)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert resolved_precision(precision, "cpu") == precision
    assert not caplog.records


def test_the_auto_choice_is_logged_once_with_its_reason_and_the_override(machine, caplog):
    machine(cpu_flags=AMX)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = AutoPrecisionTrainer(precision="auto", accelerator="cpu", logger=False)
    assert trainer.precision == "bf16-mixed"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Precision")]
    assert lines == [
        "Precision: bf16-mixed (the CPU has AMX bf16 units); set trainer.precision=32-true "
        "to override"
    ]


@pytest.mark.parametrize("experiment", LM_EXPERIMENTS)
@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu", "ddp", "fsdp", "model_parallel"])
def test_the_lm_experiments_leave_the_precision_to_auto_on_every_trainer(
    tmp_path, experiment, trainer
):
    cfg = compose_config(tmp_path, [f"experiment={experiment}", f"trainer={trainer}"])
    assert cfg.trainer.precision == "auto"


@pytest.mark.parametrize(
    ("trainer", "precision"),
    [
        ("gpu", "auto"),
        ("ddp", "auto"),
        ("fsdp", "auto"),
        ("model_parallel", "auto"),
        ("default", "32-true"),
        ("cpu", "32-true"),
        ("ddp_cpu", "32-true"),
    ],
)
def test_the_gpu_trainers_default_to_auto_and_the_cpu_ones_to_fp32(tmp_path, trainer, precision):
    assert compose_config(tmp_path, [f"trainer={trainer}"]).trainer.precision == precision


@pytest.mark.parametrize(("flags", "expected"), [(AMX, "bf16-mixed"), (NO_BF16, "32-true")])
def test_the_trainer_of_an_lm_experiment_runs_and_records_the_resolved_precision(
    tmp_path, machine, caplog, flags, expected
):
    machine(cpu_flags=flags)
    cfg = compose_config(tmp_path, ["experiment=lm_text", "trainer=cpu", "logger=csv"])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = build_trainer(cfg, run_config=(plain_config(cfg), []))
    assert trainer.precision == expected
    assert len([m for m in caplog.messages if m.startswith("Precision:")]) == 1
    (recorded,) = [c.run_config["config"] for c in trainer.callbacks if hasattr(c, "run_config")]
    assert recorded["trainer"]["precision"] == expected  # what checkpoints record
    assert trainer.logger.experiment.hparams["trainer"]["precision"] == expected
    assert cfg.trainer.precision == "auto"  # the composed config still says what was asked
