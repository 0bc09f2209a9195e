"""`data.mixture`: several sources drawn by weight, stored or streamed, each validated apart,
counted apart in the data report, and resumed exactly."""

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.data.text.pretraining import TextDataModule
from src.data.text.sft import SFTDataModule
from src.data.text.sources.mixture import (
    MixedStream,
    MixtureSampler,
    endless_rows,
    parse_mixture,
    rows_per_epoch,
)
from src.utils.errors import ConfigError, DataError
from tests.data.streams import COLLATE, assert_loader_resumes, stream
from tests.helpers import (
    FAST,
    RESUMABLE_EVERY_STEP,
    TINY_LM,
    assert_resumes_exactly,
    compose_config,
)
from train import train

# -- the config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([], "a non-empty list of sources"),
        ("a.txt", "a non-empty list of sources"),
        (["a.txt"], r"data.mixture\[0\] is 'a.txt', not a source"),
        ([{"paths": ["a"], "weigth": 1}], r"data.mixture\[0\].weigth .*did you mean weight"),
        ([{"weight": 1}], r"data.mixture\[0\] needs paths"),
        ([{"paths": ["a"]}], r"data.mixture\[0\].weight=None"),
        ([{"paths": ["a"], "weight": 1}, {"paths": ["b"], "weight": 0}], r"\[1\].weight=0"),
        ([{"paths": ["a"], "weight": -0.5}], "a positive number"),
        ([{"paths": ["a"], "weight": True}], "a positive number"),
        ([{"paths": ["a"], "weight": float("inf")}], "a positive number"),
        ([{"paths": ["a"], "weight": 1, "val_paths": ["v"]}], "val_paths is for data.streaming"),
        ([{"paths": ["a"], "weight": 1, "name": "a b"}], "letters, digits"),
        (
            [
                {"paths": ["a"], "weight": 1, "name": "x"},
                {"paths": ["b"], "weight": 1, "name": "x"},
            ],
            "two sources are named 'x'",
        ),
    ],
)
def test_a_malformed_mixture_is_one_line_naming_the_entry(entries, match):
    with pytest.raises(ConfigError, match=match):
        parse_mixture(entries)


def test_streamed_sources_each_need_held_out_files():
    with pytest.raises(ConfigError, match=r"data.mixture\[0\].val_paths=\["):
        parse_mixture([{"paths": ["a/"], "weight": 1}], streaming=True)
    (source,) = parse_mixture([{"paths": "a/", "weight": 2, "val_paths": "v.txt"}], streaming=True)
    assert (source.paths, source.val_paths, source.weight) == (["a/"], ["v.txt"], 1.0)


def test_weights_are_normalised_and_names_come_from_the_paths():
    sources = parse_mixture(
        [
            {"paths": ["corpora/web/*.parquet"], "weight": 3},
            {"paths": "books.jsonl", "weight": 1},
            {"paths": ["hf://datasets/org/math@v2"], "weight": 2},
            {"paths": ["other/books.txt"], "weight": 1},
            {"paths": ["code/"], "weight": 1, "name": "my-code"},
        ]
    )
    assert [s.name for s in sources] == ["web", "books", "math", "books_3", "my-code"]
    assert [s.weight for s in sources] == pytest.approx([3 / 8, 1 / 8, 2 / 8, 1 / 8, 1 / 8])


def test_an_epoch_s_rows_follow_the_weights_to_within_one_row():
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = rng.dirichlet(np.ones(rng.integers(1, 6)))
        total = int(rng.integers(0, 5000))
        counts = rows_per_epoch(weights, total)
        assert counts.sum() == total
        assert np.abs(counts - weights * total).max() < 1


# -- the stored sampler ------------------------------------------------------------------------


def sampler(sizes, weights, epoch=0, **options) -> MixtureSampler:
    values = dict(num_replicas=1, rank=0, shuffle=True, seed=7)
    drawn = MixtureSampler(range(sum(sizes)), sizes, weights, **(values | options))
    drawn.set_epoch(epoch)
    return drawn


def source_of(indices, sizes) -> np.ndarray:
    return np.searchsorted(np.cumsum(sizes), np.asarray(indices), side="right")


def test_each_epoch_draws_every_source_s_share_of_an_epoch_as_long_as_all_their_rows():
    sizes, weights = [100, 20, 30], [0.2, 0.5, 0.3]
    for epoch in range(4):
        indices = list(sampler(sizes, weights, epoch))
        assert len(indices) == sum(sizes)
        counts = np.bincount(source_of(indices, sizes), minlength=3)
        assert counts.tolist() == rows_per_epoch(weights, 150).tolist() == [30, 75, 45]


def test_a_down_weighted_source_shows_new_rows_each_epoch_until_its_pass_ends():
    """Source 0 (100 rows, 30 an epoch) shows 90 different rows in epochs 0-2 and the other 10
    in epoch 3, where its second pass begins; source 1 (20 rows, 75 an epoch) repeats its rows
    within an epoch."""
    sizes, weights = [100, 20, 30], [0.2, 0.5, 0.3]
    drawn = [np.asarray(list(sampler(sizes, weights, epoch))) for epoch in range(4)]
    first_source = [d[source_of(d, sizes) == 0].tolist() for d in drawn]
    seen = first_source[0] + first_source[1] + first_source[2]
    assert len(set(seen)) == 90
    assert set(range(100)) - set(seen) <= set(first_source[3])
    repeated = Counter(drawn[0][source_of(drawn[0], sizes) == 1].tolist())
    assert set(repeated) == set(range(100, 120))
    assert max(repeated.values()) - min(repeated.values()) <= 1  # 75 rows over 20: 3 or 4 each


def test_the_draws_are_the_endless_passes_of_each_source():
    rows = torch.cat([endless_rows(7, 3, epoch, [1, 0]) for epoch in range(7)])
    passes = rows.reshape(3, 7)  # 21 rows: three whole passes over 7
    assert all(sorted(p) == list(range(7)) for p in passes.tolist())
    assert len({tuple(p) for p in passes.tolist()}) == 3


def test_ranks_share_an_epoch_s_draws_and_a_seed_repeats_them():
    sizes, weights = [50, 10], [0.5, 0.5]
    ranks = [list(sampler(sizes, weights, 2, num_replicas=2, rank=r)) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == sorted(sampler(sizes, weights, 2))
    assert list(sampler(sizes, weights, 2)) == list(sampler(sizes, weights, 2))
    assert list(sampler(sizes, weights, 2)) != list(sampler(sizes, weights, 2, seed=8))


def test_a_sampler_resumed_mid_epoch_yields_the_rest_of_that_epoch():
    sizes, weights = [40, 8], [0.3, 0.7]
    whole = list(sampler(sizes, weights, 3))
    first = sampler(sizes, weights, 3)
    iterator = iter(first)
    head = [next(iterator) for _ in range(17)]
    resumed = sampler(sizes, weights, 0)
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed) == whole


# -- the stored datamodule ---------------------------------------------------------------------


def write_letters(path, letter: str, count: int, seed: int = 0):
    """`count` paragraphs of 2 to 30 words made of `letter` only, so each token names its source."""
    rng = np.random.default_rng(seed)
    words = [
        " ".join([letter * int(rng.integers(1, 6))] * int(rng.integers(2, 30)))
        for _ in range(count)
    ]
    path.write_text("\n\n".join(words))
    return path


def row_source(batch_row: torch.Tensor) -> str:
    letters = {chr(t) for t in batch_row.tolist() if chr(t).isascii() and chr(t).isalpha()}
    assert len(letters) == 1, f"a row mixes sources: {letters}"
    return letters.pop()


@pytest.fixture(scope="module")
def two_letters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixture")
    return write_letters(folder / "a.txt", "a", 200), write_letters(folder / "b.txt", "b", 60, 1)


def mixed_text(files, weights=(0.25, 0.75), tmp_path=None, **options) -> TextDataModule:
    mixture = [{"paths": [str(f)], "weight": w} for f, w in zip(files, weights, strict=True)]
    values = dict(max_seq_len=64, batch_size=8, shuffle_seed=0, cache_dir=tmp_path)
    module = TextDataModule(paths=[], mixture=mixture, **(values | options))
    module.setup()
    return module


@pytest.mark.parametrize("packing", [True, False])
def test_training_batches_draw_the_sources_by_weight_and_validation_serves_each_apart(
    two_letters, tmp_path, packing
):
    # Truncated, so that no row is a split document's last token alone, with no letter in it.
    module = mixed_text(two_letters, tmp_path=tmp_path, packing=packing, overlong="truncate")
    assert module.source_names == ("a", "b")
    assert module.token_store.part_documents == [200, 60]
    drawn = Counter(
        row_source(row) for batch in module.train_dataloader() for row in batch["input_ids"]
    )
    rows = len(module.datasets["train"])
    expected = rows_per_epoch([0.25, 0.75], rows)
    batch_rows = rows // 8 * 8  # the last partial batch is dropped
    assert sum(drawn.values()) == batch_rows
    assert abs(drawn["a"] - expected[0]) <= rows - batch_rows
    val_loaders = module.val_dataloader()
    assert [
        {row_source(row) for batch in loader for row in batch["input_ids"]}
        for loader in val_loaders
    ] == [{"a"}, {"b"}]
    assert len(module.test_dataloader()) == 2


def test_the_data_report_counts_each_source_s_tokens_and_share(two_letters, tmp_path):
    module = mixed_text(two_letters, tmp_path=tmp_path)
    metrics = module.packing_metrics()
    accounting = module.accounting["train"]
    assert (
        accounting.input
        == metrics["data/sources/a/tokens_input"] + metrics["data/sources/b/tokens_input"]
    )
    parts = module.source.parts
    for name, rows, weight in (("a", parts[0]["train"], 0.25), ("b", parts[1]["train"], 0.75)):
        assert metrics[f"data/sources/{name}/tokens_kept"] == int(rows.row_lengths().sum())
        assert metrics[f"data/sources/{name}/rows"] == len(rows)
        assert metrics[f"data/sources/{name}/weight"] == weight
    assert (
        metrics["data/sources/a/rows_per_epoch"] + metrics["data/sources/b/rows_per_epoch"]
        == (metrics["data/rows"])
    )
    assert (
        metrics["data/sources/b/repeats_per_epoch"]
        > 1
        > metrics["data/sources/a/repeats_per_epoch"]
    )
    assert metrics["data/sources/a/token_share"] + metrics["data/sources/b/token_share"] == (
        pytest.approx(1)
    )


def test_a_mixture_s_store_is_found_again_and_a_bpe_tokenizer_learns_every_source(
    two_letters, tmp_path
):
    module = mixed_text(
        two_letters, tmp_path=tmp_path, tokenizer={"kind": "bpe", "vocab_size": 300}
    )
    again = mixed_text(
        two_letters, (0.9, 0.1), tmp_path, tokenizer={"kind": "bpe", "vocab_size": 300}
    )
    assert again.token_store.folder == module.token_store.folder  # weights do not touch the store
    for word in ("aaaa", "bbbb"):
        assert len(module.tokenizer.encode(word)) == 1


def test_a_source_too_small_to_split_is_named(two_letters, tmp_path):
    tiny = write_letters(tmp_path / "tiny.txt", "c", 1)
    with pytest.raises(DataError, match="1 documents of the source tiny are too few"):
        mixed_text([two_letters[0], tiny], tmp_path=tmp_path)


def test_a_mixture_with_bucketing_or_held_out_files_of_its_own_is_refused(two_letters):
    with pytest.raises(ConfigError, match="bucket_by_length"):
        mixed_text(two_letters, packing=False, bucket_by_length=True)
    with pytest.raises(ConfigError, match=r"data.mixture\[i\].val_paths"):
        TextDataModule(paths=[], mixture=[{"paths": ["x"], "weight": 1}], val_paths=["v"])


@pytest.mark.parametrize(
    ("saved", "match"),
    [
        ({}, "trained on no data.mixture, and this run asks for the data mixture {a: 0.25"),
        ({"mixture": [["a", 0.5], ["b", 0.5]]}, "mixture {a: 0.5, b: 0.5}, and this run"),
    ],
)
def test_resuming_another_mixture_is_refused_before_training(two_letters, saved, match):
    module = mixed_text(two_letters)
    module.load_state_dict(module.state_dict())  # its own state resumes
    with pytest.raises(ConfigError, match=match):
        module.load_state_dict(saved)


def test_a_mixture_s_checkpoint_is_refused_by_a_run_without_one(two_letters):
    state = mixed_text(two_letters).state_dict()
    plain = TextDataModule(paths=[str(two_letters[0])], max_seq_len=64)
    with pytest.raises(
        ConfigError, match=r"the data mixture \{a: 0.25, b: 0.75\}, and this run asks for no"
    ):
        plain.load_state_dict(state)


# -- SFT ---------------------------------------------------------------------------------------


def write_chats(path, topic: str, count: int, broken_row: int | None = None):
    rows = [{"prompt": f"{topic} {i}?", "response": f"{topic} answer {i}"} for i in range(count)]
    if broken_row is not None:
        rows[broken_row] = {"prompt": "no answer"}
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_sft_mixes_conversation_sources_and_names_a_bad_row_by_its_source(tmp_path):
    chat = write_chats(tmp_path / "chat.jsonl", "chat", 60)
    maths = write_chats(tmp_path / "maths.jsonl", "sum", 30)
    mixture = [{"paths": [str(chat)], "weight": 1}, {"paths": [str(maths)], "weight": 1}]
    module = SFTDataModule(mixture=mixture, max_seq_len=64, batch_size=4, exact_match_samples=100)
    module.setup()
    answers = [answer for _, answer in module.exact_match_examples("val")]
    assert {answer.split()[0] for answer in answers} == {"chat", "sum"}
    module.exact_match_samples = 4  # the first few prompts take turns between the sources
    assert [answer.split()[0] for _, answer in module.exact_match_examples("val")] == [
        "chat", "sum", "chat", "sum"
    ]  # fmt: skip
    assert len(module.val_dataloader()) == 2
    write_chats(maths, "sum", 30, broken_row=4)
    broken = SFTDataModule(mixture=mixture, max_seq_len=64)
    with pytest.raises(DataError, match=r"data.mixture\[1\] \(maths\), row 5 needs"):
        broken.setup()
    with pytest.raises(ConfigError, match=r"data.path='x.jsonl' and data.mixture"):
        SFTDataModule(path="x.jsonl", mixture=mixture)


# -- streaming ---------------------------------------------------------------------------------


def lettered_stream(letter: str, tmp_path, seed: int):
    folder = tmp_path / letter
    folder.mkdir(exist_ok=True)
    files = [write_letters(folder / f"{n}.txt", letter, 15, seed + n) for n in range(2)]
    return stream(files, separator=re.compile(r"\n[ \t]*\n"), buffer_documents=5)


def test_a_mixed_stream_holds_the_weights_in_every_stretch_of_rows(tmp_path):
    mixed = MixedStream(
        [lettered_stream("a", tmp_path, 0), lettered_stream("b", tmp_path, 5)], [0.7, 0.3]
    )
    rows = iter(mixed)
    sources = [row_source(torch.cat([s.tokens for s in next(rows)])) for _ in range(200)]
    for end in range(1, 201):
        assert abs(sources[:end].count("a") - 0.7 * end) <= 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixed_stream_resumed_from_its_loader_state_yields_the_uninterrupted_batches(
    tmp_path, num_workers
):
    def loader():
        streams = [lettered_stream(letter, tmp_path / "new", 3) for letter in "ab"]
        return StatefulDataLoader(
            MixedStream(streams, [0.4, 0.6]),
            batch_size=3,
            num_workers=num_workers,
            collate_fn=COLLATE,
        )

    (tmp_path / "new").mkdir()
    assert_loader_resumes(loader, stop=13, total=30)


# -- whole runs --------------------------------------------------------------------------------


def mixture_run(two_letters, *more: str) -> list[str]:
    a, b = two_letters
    return [
        *FAST,
        *TINY_LM,
        "data=text",
        f"data.mixture=[{{paths: [{a}], weight: 0.25}}, {{paths: [{b}], weight: 0.75, name: bee}}]",
        "data.max_seq_len=64",
        "data.batch_size=8",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_test_batches=1",
        "logger=csv",
        *more,
    ]


def test_a_run_logs_each_source_s_validation_loss_and_their_token_weighted_mean(
    two_letters, tmp_path
):
    run = mixture_run(
        two_letters,
        "callbacks.model_checkpoint.monitor=val/sources/bee/loss",
        "callbacks.model_checkpoint.mode=min",
    )
    train(compose_config(tmp_path, run))
    metrics = json.loads((tmp_path / "metrics.json").read_text())["metrics"]
    module = mixed_text(two_letters)
    tokens = [
        sum(int(b["labels"].ne(-100).sum()) for b in loader) for loader in module.val_dataloader()
    ]
    losses = [metrics["val/sources/a/loss"], metrics["val/sources/bee/loss"]]
    assert metrics["val/loss"] == pytest.approx(np.dot(losses, tokens) / sum(tokens), rel=1e-5)
    assert "test/sources/bee/acc" in metrics
    report = json.loads((tmp_path / "data_report.json").read_text())
    assert report["data/sources/bee/weight"] == 0.75


def test_a_mistyped_source_metric_is_refused_with_the_right_one(two_letters, tmp_path):
    run = mixture_run(two_letters, "callbacks.model_checkpoint.monitor=val/sources/be/loss")
    with pytest.raises(
        ConfigError, match=r"did you mean callbacks.model_checkpoint.monitor=val/sources/bee/loss"
    ):
        train(compose_config(tmp_path, run))


def test_a_streamed_mixture_trains_and_validates_each_source_on_its_held_out_files(tmp_path):
    folders = {}
    for letter, seed in (("a", 0), ("b", 9)):
        folders[letter] = tmp_path / letter
        folders[letter].mkdir()
        for n in range(2):
            write_letters(folders[letter] / f"{n}.txt", letter, 20, seed + n)
        write_letters(tmp_path / f"held-out-{letter}.txt", letter, 12, seed + 5)
    mixture = ", ".join(
        f"{{paths: [{folders[x]}], weight: {w}, val_paths: [{tmp_path / f'held-out-{x}.txt'}]}}"
        for x, w in (("a", 1), ("b", 3))
    )
    run = [
        *FAST,
        *TINY_LM,
        "data=text",
        "data.streaming=true",
        f"data.mixture=[{mixture}]",
        "data.packing_buffer=4",
        "data.max_seq_len=64",
        "data.batch_size=4",
        "trainer.max_epochs=-1",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.check_val_every_n_epoch=null",
        "logger=csv",
    ]
    train(compose_config(tmp_path / "run", run))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    losses = [metrics["val/sources/a/loss"], metrics["val/sources/b/loss"]]
    assert min(losses) <= metrics["val/loss"] <= max(losses)
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["data/sources/b/weight"] == 0.75
    assert report["data/sources/a/token_share"] + report["data/sources/b/token_share"] == (
        pytest.approx(1)
    )


@pytest.mark.slow
def test_a_mixture_run_killed_mid_epoch_resumes_exactly(two_letters, tmp_path):
    run = mixture_run(two_letters, "trainer.max_steps=10", "trainer.val_check_interval=5")
    assert_resumes_exactly([*run, *RESUMABLE_EVERY_STEP], tmp_path, kill_step=7)
