"""A/B: training on packed rows reaches the validation loss of training on padded samples.

Same documents, same epochs (so the same token budget), same seeds; the padded arm takes as
many documents per batch as a packed batch holds on average, so both take about the same
number of optimizer steps. "Within noise" is measured, not assumed: the gap between the arms
must stay below the spread that a change of seed alone causes.
"""

import pytest

from src.data.text.pretraining import TextDataModule
from tests.helpers import FAST, compose_config, shakespeare_excerpt, text_lm_overrides
from train import train

pytestmark = pytest.mark.slow

SEEDS = (42, 7)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return shakespeare_excerpt(tmp_path_factory.mktemp("corpus"), 60_000)


def validation_loss(run_dir, corpus, seed: int, packing: bool, batch_size: int) -> float:
    overrides = [
        *FAST,
        "model=qwen3_tiny",
        "model.config.hidden_size=64",
        "model.config.intermediate_size=128",
        "model.config.head_dim=16",
        "scheduler.scheduler.warmup_steps=5",
        *text_lm_overrides(corpus),
        "data.max_seq_len=128",
        f"data.cache_dir={run_dir.parent / 'cache'}",
        f"data.packing={packing}",
        f"data.batch_size={batch_size}",
        f"seed={seed}",
        "trainer.max_epochs=3",
        "test=false",
    ]
    return train(compose_config(run_dir, overrides))["metrics"]["val/loss"]


def test_packed_and_padded_training_reach_the_same_validation_loss(tmp_path, corpus):
    packed_module = TextDataModule(paths=[str(corpus)], max_seq_len=128)
    packed_module.setup()
    train_set = packed_module.datasets["train"]
    documents_per_row = len(train_set.samples) / len(train_set)
    losses = {
        (packing, seed): validation_loss(
            tmp_path / f"{packing}-{seed}",
            corpus,
            seed,
            packing,
            8 if packing else round(8 * documents_per_row),
        )
        for packing in (True, False)
        for seed in SEEDS
    }
    packed = [losses[True, seed] for seed in SEEDS]
    padded = [losses[False, seed] for seed in SEEDS]
    seed_spread = max(abs(packed[0] - packed[1]), abs(padded[0] - padded[1]))
    gap = abs(sum(packed) / 2 - sum(padded) / 2)
    assert gap < max(seed_spread, 0.02), f"packed {packed} vs padded {padded}"
