"""Every option of every config group composes, type-checks and builds."""

import subprocess

import hydra
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

from src.run.config.checks import check_config_types
from src.run.config.instantiate import instantiate_group
from tests.helpers import FAST, ROOT, compose_config
from train import train

IMAGES_32 = [
    "data=imagefolder",
    "data.data_dir=/data/images",
    "data.num_classes=5",
    "data.input_shape=[3,32,32]",
]
REQUIRED = {  # options whose data has no embedded default
    "data=imagefolder": ["data.data_dir=/data/images", "data.num_classes=5"],
    # The backbones take RGB images (32x32 keeps them quick to build).
    "model=resnet18": IMAGES_32,
    "model=vit_b_16": IMAGES_32,
    "data=tensors": ["data.path=arrays.npz", "data.num_classes=3", "data.input_shape=[1,8,8]"],
    # A language model needs text data (and text data a language model).
    "model=qwen3_tiny": ["data=shakespeare_bytes"],
    "data=preferences": ["model=qwen3_tiny"],
    "data=prompts": ["model=qwen3_tiny"],
    "model=qwen3_next_tiny": ["data=shakespeare_bytes"],
    "model=qwen3_0_6b": ["data=shakespeare_bytes"],
    "model=qwen3_5_tiny": ["data=shakespeare_bytes"],
    "model=qwen3_5_0_8b": ["data=shakespeare_bytes"],
    "model=qwen3_moe_tiny": ["data=shakespeare_bytes"],
    "model=qwen3_5_moe_tiny": ["data=shakespeare_bytes"],
    "data=shakespeare_bytes": ["model=qwen3_tiny"],
    "data=text": ["model=qwen3_tiny"],
    "data=sft": ["model=qwen3_tiny"],
    # Adapters go on a language model.
    "adapter=lora": ["experiment=lm_text"],
    "adapter=qlora": ["experiment=lm_text"],
    "adapter=none": ["experiment=lm_text"],
    # The study's storage names hydra.sweep.dir, which only a launched sweep resolves.
    "hparams_search=optuna": ["hydra.sweeper.storage=sqlite:///optuna.db"],
}


CONF = ROOT / "conf"
NOT_WALKED = {  # groups of conf/ left out of the walk, and why
    "local": "optional, and this machine's own: every file in it but the tracked example is "
    "git-ignored, so walking it would test whatever a user keeps there; the local-settings "
    "tests below write their own file instead",
}


def chosen_groups(config_name: str) -> set[str]:
    """The groups whose option the entry config's defaults list chooses (`optional` or not)."""
    defaults = OmegaConf.load(CONF / f"{config_name}.yaml").defaults
    return {
        key.removeprefix("optional ")
        for entry in defaults
        if not isinstance(entry, str)
        for key in entry
    }


def group_options():
    """`group=option` for every YAML file of every folder under conf/, nested groups included.

    A group that train.yaml's defaults (or Hydra's own, for the groups under hydra/) choose from
    is overridden; any other, such as `compile` or `profile`, is added with `+`, as a user
    does.
    """
    overridden = chosen_groups("train")
    folders = sorted({path.parent for path in CONF.rglob("*.yaml")} - {CONF})
    for folder in folders:
        group = folder.relative_to(CONF).as_posix()
        if group in NOT_WALKED:
            continue
        prefix = "" if group in overridden or group.startswith("hydra/") else "+"
        for path in sorted(folder.glob("*.yaml")):
            yield f"{prefix}{group}={path.stem}"


@pytest.mark.parametrize("option", list(group_options()))
def test_every_group_option_composes_and_type_checks(tmp_path, option):
    cfg = compose_config(tmp_path, [option, *REQUIRED.get(option, [])])
    check_config_types(cfg)
    for group, base in (("callbacks", Callback), ("logger", Logger)):
        assert_builds_what_it_names(cfg.get(group), base)
    image_model = "input_shape" in cfg.data and "net" in cfg.model
    if option.split("=")[0] in ("model", "optimizer", "scheduler", "experiment") and image_model:
        model = hydra.utils.instantiate(cfg.model)
        assert model(torch.zeros(2, *cfg.data.input_shape)).shape == (2, cfg.data.num_classes)


def assert_builds_what_it_names(group, base: type) -> None:
    """Each enabled entry of a callbacks or logger group builds one object of the class its
    `_target_` names, a Lightning `base` the Trainer accepts."""
    entries = {
        name: entry for name, entry in (group or {}).items() if entry and "_target_" in entry
    }
    built = instantiate_group(group)
    assert len(built) == len(entries), f"{len(built)} built from {list(entries)}"
    for (name, entry), instance in zip(entries.items(), built, strict=True):
        assert isinstance(instance, hydra.utils.get_class(entry._target_)), name
        assert isinstance(instance, base), (
            f"{name}: {type(instance).__name__} is not a {base.__name__}"
        )


@pytest.mark.parametrize(
    ("option", "scheduler_class"),
    [("cosine", "CosineAnnealingLR"), ("step", "StepLR"), ("plateau", "ReduceLROnPlateau")],
)
def test_scheduler_options_reach_lightning_as_an_lr_scheduler_dict(
    tmp_path, option, scheduler_class
):
    cfg = compose_config(tmp_path, [f"scheduler={option}", "optimizer=sgd"])
    configured = hydra.utils.instantiate(cfg.model).configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.SGD)
    assert type(configured["lr_scheduler"]["scheduler"]).__name__ == scheduler_class
    assert configured["lr_scheduler"]["interval"] == "epoch"


def test_the_optimizer_config_sets_the_learning_rate(tmp_path):
    cfg = compose_config(tmp_path, ["optimizer.lr=0.0123"])
    optimizer = hydra.utils.instantiate(cfg.model).configure_optimizers()
    assert optimizer.param_groups[0]["lr"] == 0.0123


@pytest.mark.parametrize("debug", ["fdr", "limit"])
def test_debug_configs_run_end_to_end(tmp_path, debug):
    record = train(compose_config(tmp_path, [f"debug={debug}"]))
    assert "test/acc" in record["metrics"]


def test_debug_overfit_drives_training_accuracy_up_on_a_few_batches(tmp_path):
    record = train(compose_config(tmp_path, ["debug=overfit", "test=false"]))
    assert record["metrics"]["train/acc"] > 0.95


def test_example_experiment_trains(tmp_path):
    record = train(compose_config(tmp_path, ["experiment=example", *FAST, "trainer.max_epochs=2"]))
    assert record["metrics"]["test/acc"] > 0.5


def write_local_settings(folder, text: str) -> str:
    """A config folder holding local/default.yaml, as the override that adds it to the search
    path: the same file a user keeps in conf/local/, without writing into the tree."""
    (folder / "local").mkdir(parents=True)
    (folder / "local" / "default.yaml").write_text("# @package _global_\n" + text)
    return f"hydra.searchpath=[file://{folder}]"


@pytest.mark.parametrize("config_name", sorted(path.stem for path in CONF.glob("*.yaml")))
def test_local_settings_are_loaded_when_present_and_the_command_line_still_wins(
    tmp_path, config_name
):
    searchpath = write_local_settings(tmp_path / "extra", "paths:\n  data_dir: /mnt/corpora\n")
    required = [] if config_name == "train" else ["ckpt_path=x.ckpt"]
    required += ["input=x.png"] if config_name == "predict" else []
    required += ["tasks=[sft_choice]"] if config_name == "evaluate_lm" else []
    without = compose_config(tmp_path / "a", required, config_name)
    local = compose_config(tmp_path / "b", [*required, searchpath], config_name)
    winner = compose_config(
        tmp_path / "c", [*required, searchpath, "paths.data_dir=/d"], config_name
    )

    assert without.paths.data_dir.endswith("/data")
    assert local.paths.data_dir == "/mnt/corpora"
    assert winner.paths.data_dir == "/d"


def test_local_settings_override_the_experiment(tmp_path):
    searchpath = write_local_settings(tmp_path / "extra", "data:\n  num_workers: 3\n")
    cfg = compose_config(tmp_path / "run", ["experiment=lm_text", searchpath])
    assert cfg.data.num_workers == 3


def test_only_the_example_of_conf_local_is_tracked():
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "conf/local/default.yaml"], cwd=ROOT, check=False
    )
    example = subprocess.run(
        ["git", "check-ignore", "-q", "conf/local/example.yaml"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, "conf/local/default.yaml must be git-ignored"
    assert example.returncode == 1, "conf/local/example.yaml must stay tracked"
