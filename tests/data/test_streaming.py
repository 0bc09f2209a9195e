"""`data.streaming=true`: training documents read lazily from local shards, split across ranks
and workers, packed online, served with the store's samples and metadata, resumed exactly."""

import itertools
import json
from collections import Counter
from functools import partial
from types import SimpleNamespace

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from src.callbacks.training.loader_workers import stop_workers
from src.data.corpus.readers import resolve_stream_files
from src.data.corpus.rows import PackedRows
from src.data.packing.collate import collate_rows
from src.data.packing.packing import fit_to_length
from src.data.text.pretraining import TextDataModule
from src.utils.errors import ConfigError, DataError, MissingFileError, user_message
from tests.data.streams import (
    COLLATE,
    TOKENIZER,
    assert_loader_resumes,
    batches,
    document,
    document_numbers,
    stream,
    write_shards,
)
from tests.helpers import (
    FAST,
    RESUMABLE_EVERY_STEP,
    TINY_LM,
    assert_same_tensors,
    killed_run,
    run_train,
    trained_state,
)


@pytest.mark.parametrize("shards", [8, 7])
def test_two_ranks_by_two_workers_see_every_document_of_a_pass_exactly_once(tmp_path, shards):
    """7 shards do not split over 2 ranks: each reads every file and keeps every other document."""
    files = write_shards(tmp_path / "shards", shards, per_shard=9)
    seen = {}
    for rank in (0, 1):
        rows = stream(files, rank=rank, world_size=2, passes=1)
        loader = torch.utils.data.DataLoader(
            rows, batch_size=None, num_workers=2, collate_fn=lambda row: row
        )
        seen[rank] = document_numbers(loader)
    counts = Counter(seen[0] + seen[1])
    assert sorted(counts) == list(range(shards * 9))
    assert set(counts.values()) == {1}
    assert seen[0]
    assert seen[1]


def test_shards_behind_urls_stream_the_documents_of_the_same_local_files(tmp_path):
    """Object storage is reached through fsspec: `memory://` stands in for `s3://` here, and
    `file://` globs list local files as a bucket's would be."""
    files = write_shards(tmp_path / "shards", 3, per_shard=5)
    memory = fsspec.filesystem("memory")
    for path in files:
        memory.pipe(f"/bucket/{path.name}", path.read_bytes())
    urls = resolve_stream_files(["memory://bucket/*.parquet"])
    assert urls == [f"memory:///bucket/{path.name}" for path in files]
    local = resolve_stream_files([f"file://{tmp_path / 'shards'}/"])
    expected = document_numbers(stream(files, passes=1, shuffle=False))
    assert document_numbers(stream(urls, passes=1, shuffle=False)) == expected
    assert document_numbers(stream(local, passes=1, shuffle=False)) == expected
    assert sorted(expected) == list(range(15))
    memory.rm(f"/bucket/{files[1].name}")
    with pytest.raises(DataError, match=r"the shard memory:///bucket/part-01\.parquet vanished"):
        list(stream(urls, passes=1))


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("unknown://bucket/*.parquet", "Protocol not known: unknown"),
        ("memory://none/x.parquet", "is neither a file, a folder nor a glob"),
    ],
)
def test_a_url_that_cannot_be_read_is_named_in_one_line(url, match):
    with pytest.raises((ConfigError, MissingFileError)) as error:
        resolve_stream_files([url])
    assert url in str(error.value)
    assert match in str(error.value)


def test_every_rank_keeps_yielding_batches_after_its_pass_ends(tmp_path):
    """Rank 0's shards hold 4 documents, rank 1's 40: the stream is endless, so both yield the
    batches asked of them, rank 0 reading its documents again in later passes."""
    small, large = write_shards(tmp_path / "a", 1, 4), write_shards(tmp_path / "b", 1, 40)
    for rank in (0, 1):
        loader = StatefulDataLoader(
            stream([small[0], large[0]], rank=rank, world_size=2), batch_size=2, collate_fn=COLLATE
        )
        assert len(batches(loader, 30)) == 30


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_resumed_from_its_loader_state_yields_the_uninterrupted_batches(
    tmp_path, num_workers
):
    """Stopped inside a buffer (after 23 batches: one worker in its first pass over the files,
    the other in its second) and resumed in a new loader."""
    files = write_shards(tmp_path / "shards", 4, per_shard=5)

    def loader():
        return StatefulDataLoader(
            stream(files, buffer_documents=4),
            batch_size=3,
            num_workers=num_workers,
            collate_fn=COLLATE,
        )

    assert_loader_resumes(loader, stop=23, total=40)


def as_tuples(rows) -> list[list[tuple]]:
    """Rows of samples as plain values: ids, targets, position offset, next token."""
    return [
        [(s.tokens.tolist(), s.targets.tolist(), s.position_offset, s.next_token) for s in row]
        for row in rows
    ]


@pytest.mark.parametrize("packing", [True, False])
def test_a_whole_corpus_buffer_gives_the_token_store_s_rows_and_metadata(tmp_path, packing):
    """Over-long documents included: split continuations keep their offsets and next tokens."""
    corpus = write_shards(tmp_path / "shards", 1, per_shard=30)
    module = TextDataModule(
        paths=[str(corpus[0])], packing=packing, max_seq_len=48, cache_dir=str(tmp_path / "c")
    )
    store = module.store()
    pieces, _ = fit_to_length(store.lengths(), 48, "split")
    store_rows = PackedRows(store, pieces, module.rows_of(pieces.length))
    store_rows = [store_rows[i] for i in range(len(store_rows))]
    streamed = list(stream(corpus, packing=packing, buffer_documents=100, shuffle=False, passes=1))
    assert any(s.position_offset > 0 for row in streamed for s in row)
    assert as_tuples(streamed) == as_tuples(store_rows)
    collate = partial(
        collate_rows, pad_id=TOKENIZER.pad_token_id, row_length=48 if packing else None
    )
    assert_same_tensors(collate(store_rows), collate(streamed), "batch")


def test_a_text_file_streams_the_documents_the_store_cuts_from_it(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(document(n) for n in range(20)) + "\n\n  \n\n")
    module = TextDataModule(paths=[str(path)], cache_dir=str(tmp_path / "cache"))
    store = module.store()
    rows = list(
        stream([path], separator=module.separator, shuffle=False, passes=1, overlong="drop")
    )
    streamed = [sample for row in rows for sample in row]
    kept = [d for d in range(store.num_documents) if store.lengths()[d] <= 48]
    assert sorted(tuple(s.tokens.tolist()) for s in streamed) == sorted(
        tuple(store.tokens[store.offsets[d] : store.offsets[d + 1]].tolist()) for d in kept
    )


@pytest.mark.parametrize(("vanished", "num_workers"), [(0, 0), (3, 0), (3, 2)])
def test_a_shard_that_vanishes_mid_stream_is_a_one_line_data_error_naming_it(
    tmp_path, num_workers, vanished
):
    """Shard 3 vanishes before it is opened, shard 0 (already read) before the next pass."""
    files = write_shards(tmp_path / "shards", 4, per_shard=6)
    loader = StatefulDataLoader(
        stream(files, shuffle=False),
        batch_size=2,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        collate_fn=COLLATE,
    )
    iterator = iter(loader)
    next(iterator)
    files[vanished].unlink()
    with pytest.raises(DataError) as raised:
        list(itertools.islice(iterator, 100))
    message = user_message(raised.value)
    stop_workers(loader)  # as a failed run does (StopLoaderWorkersOnError)
    assert message.startswith(f"data.paths: the shard {files[vanished]} vanished while streaming")
    assert "\n" not in message


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_missing_text_field_is_a_one_line_data_error_naming_the_columns(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"body": ["one", "two"]}), path)
    else:
        path.write_text("".join(json.dumps({"body": text}) + "\n" for text in ("one", "two")))
    with pytest.raises(DataError, match=r"has no column data.text_field='text'.*\['body'\]"):
        stream([path])


def test_a_streamed_row_without_text_is_refused_unless_skipped(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": pa.array(["doc0000 one", None, "doc0002 two"])}), path)
    with pytest.raises(DataError, match=r"has no 'text' \(missing or null\).*missing_text=skip"):
        list(stream([path], passes=1))
    rows = stream([path], passes=1, shuffle=False, missing_text="skip")
    assert document_numbers(list(rows)) == [0, 2]


def test_streaming_files_of_two_formats_is_a_config_error(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("one\n\ntwo\n")
    with pytest.raises(ConfigError, match=r"mixes \['parquet', 'text'\]"):
        stream([*write_shards(tmp_path / "shards", 1, per_shard=2), text])


def test_a_non_utf8_text_file_is_a_data_error_naming_its_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"fine\n\nfine too\n\nbad \xff here\n")
    rows = stream([path], passes=1)
    with pytest.raises(DataError, match=r"corpus.txt, line 5 is not UTF-8"):
        list(rows)


def streaming_module(tmp_path, **options) -> TextDataModule:
    shards = write_shards(tmp_path / "shards", 2, per_shard=20)
    heldout = write_shards(tmp_path / "heldout", 1, per_shard=10)
    values = dict(
        paths=[str(p) for p in shards],
        val_paths=[str(heldout[0])],
        streaming=True,
        packing_buffer=10,
        max_seq_len=48,
        cache_dir=str(tmp_path / "cache"),
    )
    return TextDataModule(**(values | options))


def test_streaming_validates_and_tests_on_the_held_out_files(tmp_path):
    module = streaming_module(tmp_path)
    module.setup()
    held_out = {len(module.datasets[split].pieces) for split in ("val", "test")}
    assert "train" not in module.datasets
    assert sum(held_out) >= 10
    metrics = module.packing_metrics()
    assert metrics["data/rows"] > 0
    assert 0 <= metrics["data/padding_fraction"] < 1
    assert module.accounting["train"].input > 0
    assert module.vocab_size == TOKENIZER.vocab_size
    assert module.state_dict()["tokenizer"]


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (0, 2)])
def test_a_stream_resumed_with_another_number_of_workers_is_refused_before_training(
    tmp_path, saved, resumed
):
    state = streaming_module(tmp_path / "saved", num_workers=saved).state_dict()
    assert state["stream_workers"] == saved
    with pytest.raises(ConfigError) as error:
        streaming_module(tmp_path / "resumed", num_workers=resumed).load_state_dict(state)
    assert f"data.num_workers={saved}, and this run asks for {resumed}" in str(error.value)
    assert str(error.value).endswith(f"Resume with data.num_workers={saved}.")
    streaming_module(tmp_path / "same", num_workers=saved).load_state_dict(state)  # resumes


def test_a_checkpoint_s_tokenizer_loaded_after_setup_replaces_the_stream_s_too(tmp_path):
    """Lightning sets a datamodule up before it loads the checkpoint's state: a tokenizer that
    differs from the one setup built (bytes here, a BPE in the checkpoint) re-encodes the
    training stream as well as the held-out store, exactly as when the state comes first."""
    heldout = write_shards(tmp_path / "bpe", 1, per_shard=30)
    trained = TextDataModule(
        paths=[str(heldout[0])], tokenizer={"kind": "bpe", "vocab_size": 300}, max_seq_len=48
    )
    trained.setup()
    state = trained.state_dict()
    resumed = streaming_module(tmp_path, shuffle_seed=0)
    resumed.setup()
    byte_batch = next(iter(resumed.train_dataloader()))
    resumed.load_state_dict(state)
    restored = streaming_module(tmp_path, shuffle_seed=0)
    restored.load_state_dict(state)
    restored.setup()
    expected = next(iter(restored.train_dataloader()))
    assert resumed.tokenizer.fingerprint == trained.tokenizer.fingerprint
    assert not torch.equal(byte_batch["input_ids"], expected["input_ids"]), "still bytes"
    assert_same_tensors(expected, next(iter(resumed.train_dataloader())), "first batch")
    assert resumed.packing_metrics() == restored.packing_metrics()
    assert resumed.accounting["train"].input == restored.accounting["train"].input


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"val_paths": None}, "set data.val_paths"),
        ({"tokenizer": {"kind": "bpe"}}, "data.tokenizer.kind=pretrained"),
        ({"packing_buffer": 0}, "data.packing_buffer must be a positive integer"),
    ],
)
def test_streaming_refuses_what_it_cannot_do_in_one_line(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        streaming_module(tmp_path, **options)


@pytest.mark.parametrize(
    ("trainer", "match"),
    [
        ({"max_steps": -1}, "set trainer.max_steps"),
        ({"max_steps": 20, "num_workers": 3}, "data.num_workers=3"),
    ],
)
def test_a_streaming_loader_needs_a_run_length_and_a_shard_per_worker(tmp_path, trainer, match):
    module = streaming_module(tmp_path, num_workers=trainer.pop("num_workers", 0))
    module.trainer = SimpleNamespace(
        world_size=1, global_rank=0, accumulate_grad_batches=1, **trainer
    )
    # The worker count is checked in setup, the run length in train_dataloader.
    with pytest.raises(ConfigError, match=match):  # noqa: PT012
        module.setup()
        module.train_dataloader()


@pytest.mark.slow
def test_a_streaming_run_killed_mid_stream_resumes_exactly(tmp_path):
    """Two workers over four shards of two documents, buffers of two: killed at step 16, the
    run resumes from step 15's checkpoint with both workers in their second pass over the
    files, one inside its second buffer."""
    write_shards(tmp_path / "shards", 4, per_shard=2)
    heldout = write_shards(tmp_path / "heldout", 1, per_shard=10)
    run = [
        *FAST,
        *TINY_LM,
        "data=text",
        f"data.paths=[{tmp_path / 'shards'}]",
        f"data.val_paths=[{heldout[0]}]",
        "data.streaming=true",
        "data.packing_buffer=2",
        "data.num_workers=2",
        "data.max_seq_len=64",
        "data.batch_size=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=-1",
        "trainer.max_steps=20",
        "trainer.val_check_interval=5",
        "trainer.check_val_every_n_epoch=null",
        "callbacks.model_checkpoint.monitor=val/loss",
        "callbacks.model_checkpoint.mode=min",
        *RESUMABLE_EVERY_STEP,
    ]
    expected_checkpoint, expected_metrics = trained_state(run, tmp_path / "whole")
    last = killed_run(run, tmp_path / "killed", kill_step=16)
    loader = torch.load(last, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    workers = loader["combined_loader"][0]["_snapshot"]["_worker_snapshots"].values()
    assert {(w["dataset_state"]["pass"], w["dataset_state"]["buffer"]) for w in workers} == {
        (1, 0),
        (1, 1),
    }
    checkpoint, metrics = trained_state(run, tmp_path / "killed", f"ckpt_path={last}")
    assert checkpoint["global_step"] == expected_checkpoint["global_step"] == 20
    assert_same_tensors(expected_checkpoint["state_dict"], checkpoint["state_dict"], "weights")
    assert metrics == expected_metrics


@pytest.mark.slow
def test_two_ddp_processes_over_shards_of_very_different_sizes_both_train_every_step(tmp_path):
    """Two gloo ranks over four shards of 1, 2, 3 and 60 documents: the rank with the small
    ones passes over them again and again, so both take every step and none waits forever."""
    folder = tmp_path / "shards"
    folder.mkdir()
    start = 0
    for shard, count in enumerate([1, 2, 3, 60]):
        texts = [document(n) for n in range(start, start + count)]
        pq.write_table(pa.table({"text": texts}), folder / f"part-{shard}.parquet")
        start += count
    heldout = write_shards(tmp_path / "heldout", 1, per_shard=10)
    run = [
        *FAST,
        *TINY_LM,
        "data=text",
        "trainer=ddp_cpu",
        f"data.paths=[{folder}]",
        f"data.val_paths=[{heldout[0]}]",
        "data.streaming=true",
        "data.packing_buffer=4",
        "data.max_seq_len=64",
        "data.batch_size=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_epochs=-1",
        "trainer.max_steps=12",
        "trainer.val_check_interval=6",
        "trainer.check_val_every_n_epoch=null",
        "test=false",
    ]
    run_train(run, tmp_path / "run", timeout=240)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 12
