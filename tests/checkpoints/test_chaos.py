"""The chaos test: a run SIGKILLed at ten random moments and resumed each time ends exactly as
the uninterrupted run ends.

Each kill is a moment of `tests/checkpoints/chaos.py` (a training step, half-way through a
checkpoint write, during validation, at an epoch boundary, the first step after a resume, while
testing after the last training step) at a random step. Every launch is the same command a user
would type again, `python train.py ... ckpt_path=last` in the run's folder. At the end the
weights, the optimizer state, metrics.json and the names in checkpoints/ are those of the run
that was never interrupted, bitwise.
"""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra.utils import instantiate

from tests.checkpoints.chaos import MOMENTS
from tests.helpers import (
    FAST,
    TINY_LM,
    assert_same_tensors,
    compose_config,
    run_train,
    shakespeare_excerpt,
    trained_state,
)

KILLS = 10
# Checkpoints every 3 steps, which misses some epochs' last step, plus the best by val/loss.
EVERY_3_STEPS = [
    "trainer.deterministic=true",
    "callbacks.last_checkpoint.every_n_train_steps=3",
    "callbacks.last_checkpoint.every_n_epochs=null",
]


def chaos_plan(seed: int, last_step: int, moments: tuple[str, ...]) -> list[tuple[str, int]]:
    """Ten (moment, step) kills in the order a run meets them: every moment at least once, the
    rest drawn at random, at random steps before `last_step`; testing last, and never a resumed
    run's first step first (the first launch is not resumed)."""
    rng = random.Random(seed)
    during_fit = [moment for moment in moments if moment != "testing"]
    drawn = during_fit + rng.choices(during_fit, k=KILLS - 1 - len(during_fit))
    rng.shuffle(drawn)
    if drawn[0] == "first step":
        drawn.append(drawn.pop(0))
    steps = iter(sorted(rng.randrange(1, last_step) for _ in drawn))
    # The first step after a resume comes at whatever step the resume starts from.
    return [(moment, 0 if moment == "first step" else next(steps)) for moment in drawn] + [
        ("testing", last_step)
    ]


def chaotic_run(run: list[str], run_dir, plan, record) -> None:
    """`python train.py <run> ckpt_path=last` launched once per kill of `plan`, each SIGKILLed
    at its moment, then once more to the end (in this process)."""
    for moment, step in plan:
        chaos = [
            "+callbacks.chaos._target_=tests.checkpoints.chaos.Chaos",
            f"+callbacks.chaos.moment={moment}",
            f"+callbacks.chaos.step={step}",
            f"+callbacks.chaos.record={record}",
        ]
        killed = run_train([*run, *chaos, "ckpt_path=last"], run_dir, check=False)
        assert killed.returncode == -9, f"{moment} at step {step}: {killed.stderr[-2000:]}"
        if moment == "checkpoint write":  # its half-written file stays until the next save
            assert any(".tmp-" in name for name in checkpoint_names(run_dir)), "no save was cut"
    died = [line.split(" at step ") for line in record.read_text().splitlines()]
    assert [moment for moment, _ in died] == [moment for moment, _ in plan]
    assert all(int(at) >= step for (_, at), (_, step) in zip(died, plan, strict=True)), died


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The five runs the issue names, each tiny, with its last kill step and its moments."""
    folder = tmp_path_factory.mktemp("data")
    corpus = shakespeare_excerpt(folder, 4000)
    lm = [
        *TINY_LM,
        "data=text",
        "callbacks.model_checkpoint.monitor=val/loss",
        "callbacks.model_checkpoint.mode=min",
        "data.max_seq_len=64",
        "data.batch_size=4",
        f"data.cache_dir={folder / 'cache'}",
    ]
    packed_lm = [*lm, f"data.paths=[{corpus}]"]
    digits = ["trainer.max_epochs=3", "data.batch_size=128"]
    return {
        "simplenet": ([*digits, "model=simplenet"], MOMENTS),
        "cnn with dropout": (
            [
                *digits,
                "model=cnn",
                "data.train_transform={_target_: torchvision.transforms.v2.RandomAffine, "
                "degrees: 10}",
            ],
            MOMENTS,
        ),
        "packed lm": ([*packed_lm, "trainer.max_epochs=3"], MOMENTS),
        "lora": (
            [
                *packed_lm,
                "trainer.max_epochs=3",
                "adapter=lora",
                f"model.pretrained={tiny_base(folder)}",
            ],
            MOMENTS,
        ),
        "streaming lm": (
            [
                *lm,
                f"data.paths=[{shakespeare_shards(corpus, folder / 'shards')}]",
                f"data.val_paths=[{corpus}]",
                "data.streaming=true",
                "data.packing_buffer=2",
                "trainer.max_epochs=-1",
                "trainer.max_steps=24",
                "trainer.val_check_interval=5",
                "trainer.check_val_every_n_epoch=null",
            ],
            tuple(moment for moment in MOMENTS if moment != "epoch end"),  # it has no epochs
        ),
    }


def tiny_base(folder):
    """TINY_LM's network with random weights, as a transformers folder."""
    torch.manual_seed(0)
    cfg = compose_config(folder / "compose", [*FAST, *TINY_LM])
    instantiate(cfg.model).net.save_pretrained(folder / "base")
    return folder / "base"


def shakespeare_shards(corpus, folder):
    """The corpus's paragraphs as documents in three Parquet shards."""
    paragraphs = [p for p in corpus.read_text().split("\n\n") if p.strip()]
    folder.mkdir()
    for shard in range(3):
        pq.write_table(pa.table({"text": paragraphs[shard::3]}), folder / f"part-{shard}.parquet")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["simplenet", "cnn with dropout", "packed lm", "streaming lm", "lora"]
)
def test_a_run_killed_at_ten_random_moments_ends_as_the_uninterrupted_run(tmp_path, runs, kind):
    overrides, moments = runs[kind]
    run = [*FAST, *EVERY_3_STEPS, *overrides, "test=true"]
    expected, expected_metrics = trained_state(run, tmp_path / "whole")
    last_step = expected["global_step"]
    # The kills fall before the last epoch's (the last quarter's) start, so that each has a
    # moment of its kind still ahead of it; testing comes after the last step.
    plan = chaos_plan(seed=len(kind), last_step=last_step * 2 // 3, moments=moments)
    plan[-1] = ("testing", last_step)

    chaotic_run(run, tmp_path / "chaos", plan, tmp_path / "died.txt")
    checkpoint, metrics = trained_state(run, tmp_path / "chaos", "ckpt_path=last")

    assert checkpoint["global_step"] == last_step
    assert_same_tensors(expected["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(expected["optimizer_states"], checkpoint["optimizer_states"], "optimizer")
    assert metrics == expected_metrics
    assert checkpoint_names(tmp_path / "chaos") == checkpoint_names(tmp_path / "whole")


def checkpoint_names(run_dir) -> list[str]:
    """Every name in the run's checkpoints/ folder, hidden ones (temporary files) included."""
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())
