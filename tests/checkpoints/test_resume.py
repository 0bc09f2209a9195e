"""A run killed at any step and resumed ends exactly where the uninterrupted run ends."""

import itertools
import os
import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.sampler import ResumableDistributedSampler, resumable_loader, resumable_sampler
from tests.helpers import (
    FAST,
    RESUMABLE_EVERY_STEP,
    TINY_LM,
    assert_same_tensors,
    compose_config,
    final_state,
    killed_run,
    run_train,
    shakespeare_excerpt,
    text_lm_overrides,
    trained_state,
)
from train import train

# Two epochs of 20 steps, a checkpoint after every step, bitwise-deterministic kernels, and
# randomness everywhere it can hide: shuffling, dropout (CNN) and per-sample augmentation.
# The default checkpoints (last.ckpt at the end of every epoch) of the same run.
DEFAULT_CHECKPOINTS = [
    *FAST,
    "model=cnn",
    "trainer.max_epochs=2",
    "trainer.deterministic=true",
    "data.train_transform={_target_: torchvision.transforms.v2.RandomAffine, degrees: 10}",
]
RUN = [
    *DEFAULT_CHECKPOINTS,
    "callbacks.last_checkpoint.every_n_train_steps=1",
    "callbacks.last_checkpoint.every_n_epochs=null",
]
EVERY_5_STEPS = [
    *DEFAULT_CHECKPOINTS,
    "callbacks.last_checkpoint.every_n_train_steps=5",
    "callbacks.last_checkpoint.every_n_epochs=null",
]
STEPS_PER_EPOCH = 20
STEPS = 2 * STEPS_PER_EPOCH


def signalled_run(run: list[str], run_dir, step: int, name: str):
    """`train(<run>)` in this process, sent signal `name` at the end of step `step`; the
    checkpoint it saved."""
    signaller = [
        "+callbacks.signaller._target_=tests.helpers.SignalAtStep",
        f"+callbacks.signaller.step={step}",
        f"+callbacks.signaller.name={name}",
    ]
    record = train(compose_config(run_dir, [*run, *signaller, "test=false"]))
    assert record["preempted"] is True, f"{name} did not stop the run"
    return run_dir / "checkpoints" / "last.ckpt"


def assert_resumes_exactly(run: list[str], run_dir, last, expected):
    """`train(<run> ckpt_path=<last>)` ends in the `expected` final state of the uninterrupted
    run: its weights, optimizer state and metrics."""
    expected_checkpoint, expected_metrics = expected
    checkpoint, metrics = trained_state(run, run_dir, f"ckpt_path={last}")
    assert checkpoint["global_step"] == expected_checkpoint["global_step"]
    assert_same_training_state(expected_checkpoint, checkpoint)
    assert metrics == expected_metrics


def assert_same_training_state(expected_checkpoint, checkpoint):
    assert_same_tensors(expected_checkpoint["state_dict"], checkpoint["state_dict"], "weights")
    assert_same_tensors(
        expected_checkpoint["optimizer_states"], checkpoint["optimizer_states"], "optimizer"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of `train(<run>)` uninterrupted, for each run asked for (once each: the
    checkpoint callbacks decide which metric states the last checkpoint holds)."""
    finished = {}

    def final(run: list[str]):
        if tuple(run) not in finished:
            finished[tuple(run)] = trained_state(run, tmp_path_factory.mktemp("uninterrupted"))
        return finished[tuple(run)]

    return final


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_a_random_step_then_resume_matches_the_uninterrupted_run(
    tmp_path, uninterrupted, seed
):
    kill_step = random.Random(seed).randrange(3, STEPS - 2)  # mid-epoch for most seeds
    last = killed_run(RUN, tmp_path, kill_step)
    assert torch.load(last, weights_only=True)["global_step"] == kill_step - 1

    assert_resumes_exactly(RUN, tmp_path, last, uninterrupted(RUN))


@pytest.mark.slow
def test_a_cnn_with_dropout_stopped_after_an_epoch_resumes_exactly_from_its_epoch_checkpoint(
    tmp_path, uninterrupted
):
    """The default end-of-epoch checkpoint is written before the next epoch's loader draws its
    seed from the RNG; the resumed run must draw it from the restored state too."""
    train(compose_config(tmp_path, [*DEFAULT_CHECKPOINTS, "trainer.max_epochs=1", "test=false"]))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    assert_resumes_exactly(
        DEFAULT_CHECKPOINTS, tmp_path, "last", uninterrupted(DEFAULT_CHECKPOINTS)
    )


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    last = signalled_run(DEFAULT_CHECKPOINTS, tmp_path, step=13, name="SIGTERM")
    assert torch.load(last, weights_only=True)["global_step"] == 14  # after the step in progress
    assert_resumes_exactly(DEFAULT_CHECKPOINTS, tmp_path, last, uninterrupted(DEFAULT_CHECKPOINTS))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "kill_step", "saved_step"),
    [
        (DEFAULT_CHECKPOINTS, STEPS_PER_EPOCH + 3, STEPS_PER_EPOCH),  # back to the epoch's end
        (EVERY_5_STEPS, 28, 25),  # back to a periodic checkpoint mid-epoch
    ],
    ids=["epoch checkpoint", "every 5 steps"],
)
def test_sigkill_then_resume_from_the_default_checkpoints_matches_the_uninterrupted_run(
    tmp_path, uninterrupted, run, kill_step, saved_step
):
    last = killed_run(run, tmp_path, kill_step)
    assert torch.load(last, weights_only=True)["global_step"] == saved_step
    assert_resumes_exactly(run, tmp_path, last, uninterrupted(run))


@pytest.mark.parametrize("drop_last", [True, False], ids=["drops last batch", "keeps it"])
@pytest.mark.parametrize("at_epoch_end", [True, False], ids=["last batch", "first batch"])
def test_a_loader_state_saved_after_an_epoch_s_last_batch_resumes_as_the_next_epoch(
    drop_last, at_epoch_end
):
    """Lightning resumes a checkpoint saved after an epoch's last batch as the next epoch's
    start, iterating the loader restored from it: that loader must yield the next epoch, in the
    uninterrupted run's order, and a loader saved mid-epoch the rest of its epoch."""
    datamodule = SimpleNamespace(trainer=None, shuffle_seed=0, num_workers=0)
    dataset = list(range(11))  # 3 batches of 4, the last partial one dropped or kept

    def loader() -> StatefulDataLoader:
        if drop_last:  # the text datamodules' training loader
            return resumable_loader(datamodule, dataset, batch_size=4, shuffle=True)
        sampler = resumable_sampler(datamodule, dataset, shuffle=True, shuffle_seed=0)
        return StatefulDataLoader(dataset, batch_size=4, sampler=sampler)  # the image ones'

    def epoch(loader: StatefulDataLoader, number: int) -> list[list[int]]:
        loader.sampler.set_epoch(number)  # as Lightning does before each epoch
        return [batch.tolist() for batch in loader]

    uninterrupted = loader()
    expected = [epoch(uninterrupted, 0), epoch(uninterrupted, 1)]
    saved = loader()
    iterator = iter(saved)
    # Lightning takes no more batches than the loader's length, so the state is not "finished".
    before = [next(iterator).tolist() for _ in range(len(saved) if at_epoch_end else 1)]
    resumed = loader()
    resumed.load_state_dict(saved.state_dict())
    rest = [batch.tolist() for batch in resumed]  # before Lightning sets the epoch on resume

    if at_epoch_end:
        assert rest == expected[1]
    else:
        assert before + rest == expected[0]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("count", "ranks"), [(0, 2), (7, 1), (7, 3), (100, 8), (1001, 2)])
def test_the_sampler_gives_torch_s_distributed_order_without_listing_it(count, ranks, drop_last):
    for rank, shuffle, epoch in itertools.product(range(ranks), (True, False), (0, 3)):
        options = {"num_replicas": ranks, "rank": rank, "shuffle": shuffle, "seed": 5}
        expected = DistributedSampler(range(count), drop_last=drop_last, **options)
        sampler = ResumableDistributedSampler(range(count), drop_last=drop_last, **options)
        expected.set_epoch(epoch)
        sampler.set_epoch(epoch)
        assert list(sampler) == list(expected), (rank, shuffle, epoch)
    sampler.set_epoch(0)
    assert isinstance(sampler.rank_indices(), torch.Tensor)


@pytest.mark.slow
def test_a_periodic_checkpoint_at_the_last_step_of_an_epoch_resumes_into_the_next_epoch(
    tmp_path, uninterrupted
):
    last = killed_run(EVERY_5_STEPS, tmp_path, STEPS_PER_EPOCH + 1)
    assert torch.load(last, weights_only=True)["global_step"] == STEPS_PER_EPOCH
    assert_resumes_exactly(EVERY_5_STEPS, tmp_path, last, uninterrupted(EVERY_5_STEPS))


@pytest.mark.slow
def test_simplenet_stopped_after_an_epoch_resumes_exactly(tmp_path):
    run = [*FAST, "model=simplenet", "trainer.deterministic=true", "test=false"]
    train(compose_config(tmp_path / "whole", [*run, "trainer.max_epochs=2"]))
    train(compose_config(tmp_path / "stopped", [*run, "trainer.max_epochs=1"]))
    train(compose_config(tmp_path / "stopped", [*run, "trainer.max_epochs=2", "ckpt_path=last"]))
    expected_checkpoint, expected_metrics = final_state(tmp_path / "whole")
    checkpoint, metrics = final_state(tmp_path / "stopped")
    assert checkpoint["global_step"] == expected_checkpoint["global_step"] == STEPS
    assert_same_training_state(expected_checkpoint, checkpoint)
    assert metrics == expected_metrics


# Each LM at its tiniest, on a packed Tiny Shakespeare excerpt.
TINY_LMS = {
    "qwen3_tiny": TINY_LM,
    "qwen3_next_tiny": [
        "model=qwen3_next_tiny",
        "model.config.hidden_size=32",
        "model.config.intermediate_size=64",
        "model.config.head_dim=16",
        "model.config.linear_key_head_dim=8",
        "model.config.linear_value_head_dim=8",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(TINY_LMS))
def test_a_packed_lm_run_killed_in_its_second_epoch_resumes_exactly(tmp_path, model):
    """Epoch-based, with a cosine schedule over the run's total steps: asking the Trainer for
    them before the restore would lose the data loader's position (Lightning #20550)."""
    run = [
        *FAST,
        *text_lm_overrides(shakespeare_excerpt(tmp_path, 6000)),
        *TINY_LMS[model],
        "scheduler.scheduler.warmup_steps=2",
        "data.max_seq_len=64",
        "data.batch_size=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=2",
        *RESUMABLE_EVERY_STEP,
    ]
    expected = trained_state(run, tmp_path / "whole")
    kill_step = expected[0]["global_step"] // 2 + 3  # inside the second epoch
    last = killed_run(run, tmp_path / "killed", kill_step)
    assert_resumes_exactly(run, tmp_path / "killed", last, expected)


@pytest.mark.slow
def test_ckpt_path_last_in_a_fresh_run_dir_is_refused_naming_the_runs_to_resume(tmp_path):
    runs = tmp_path / "train" / "runs"
    for age, name in enumerate(["newest", "older", "oldest"]):
        last = runs / name / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.touch()
        os.utime(last, (1e9 - age, 1e9 - age))
    (runs / "no_checkpoint").mkdir()
    result = run_train(
        [*FAST, "ckpt_path=last", f"paths.log_dir={tmp_path}"], run_dir=None, check=False
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: ckpt_path=last"), error
    assert "hydra.run.dir is not set" in error, error
    listed = f"{runs / 'newest'}, {runs / 'older'}, {runs / 'oldest'}."
    assert listed in error, error
    assert f"hydra.run.dir={runs / 'newest'} ckpt_path=last" in error, error
    assert "no_checkpoint" not in error, error


def test_ckpt_path_last_in_a_pinned_run_dir_without_a_checkpoint_starts_fresh(tmp_path):
    run = [*FAST, "ckpt_path=last", "trainer.limit_train_batches=2", "test=false"]
    record = train(compose_config(tmp_path, run))
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert "train/loss" in record["metrics"]


# Every shipped model at its tiniest, with the default checkpoints: last.ckpt at the end of
# each epoch (the CNN has its own tests above). Deterministic, without a test stage.
INTERRUPTIONS = ["clean stop", "SIGTERM", "kill -9", "kill -9, every 3 steps"]


@pytest.fixture(scope="module")
def shipped_runs(tmp_path_factory):
    corpus = shakespeare_excerpt(tmp_path_factory.mktemp("corpus"), 4000)
    lm = [
        *text_lm_overrides(corpus),
        "data.max_seq_len=64",
        "data.batch_size=2",
        f"data.cache_dir={corpus.parent / 'cache'}",
    ]
    common = [*FAST, "trainer.max_epochs=2", "trainer.deterministic=true", "test=false"]
    return {
        "simplenet": [*common, "model=simplenet"],
        **{model: [*common, *lm, *overrides] for model, overrides in TINY_LMS.items()},
    }


@pytest.mark.slow
@pytest.mark.parametrize("interruption", INTERRUPTIONS)
@pytest.mark.parametrize("model", ["simplenet", *TINY_LMS])
def test_every_shipped_model_resumes_exactly_from_its_default_checkpoints(
    tmp_path, shipped_runs, uninterrupted, model, interruption
):
    run = shipped_runs[model]
    if interruption == "clean stop" and model != "simplenet":
        run = [*run, "scheduler=none"]  # a schedule over the run's steps changes with max_epochs
    if interruption == "kill -9, every 3 steps":
        run = [
            *run,
            "callbacks.last_checkpoint.every_n_train_steps=3",
            "callbacks.last_checkpoint.every_n_epochs=null",
        ]
    expected = uninterrupted(run)
    steps_per_epoch = expected[0]["global_step"] // 2
    if interruption == "clean stop":
        train(compose_config(tmp_path, [*run, "trainer.max_epochs=1"]))
        last, saved_step = "last", steps_per_epoch
    elif interruption == "SIGTERM":
        last = signalled_run(run, tmp_path, step=steps_per_epoch + 2, name="SIGTERM")
        saved_step = steps_per_epoch + 3  # after the step in progress
    else:
        kill_step = steps_per_epoch + 5
        last = killed_run(run, tmp_path, kill_step)
        saved_step = steps_per_epoch if interruption == "kill -9" else (kill_step - 1) // 3 * 3
    if last != "last":
        assert torch.load(last, weights_only=True)["global_step"] == saved_step
    assert_resumes_exactly(run, tmp_path, last, expected)
