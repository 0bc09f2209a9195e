"""The token store behind the text datamodules: formats read through `datasets`, the dtype, reuse
without tokenising, rebuilds of broken stores, bad input, and packing on the lengths arrays."""

import bisect
import errno
import json
import os
import pickle
import random
import shutil
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import src.data.corpus.readers as readers
import src.data.corpus.token_store as token_store
from src.data.corpus.token_store import token_dtype
from src.data.corpus.tokenizers import train_bpe
from src.data.packing.packing import pack
from src.data.text.pretraining import TextDataModule
from src.data.text.sft import SFTDataModule
from src.utils.errors import DataError, MissingFileError

DOCUMENTS = [f"Speech {i}: " + " ".join(["thou"] * (1 + (i * 11) % 50)) for i in range(40)]


def write_corpus(folder, kind: str, documents=DOCUMENTS, field: str = "text"):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        path = folder / "corpus.txt"
        path.write_text("\n\n".join(documents) + "\n")
    elif kind == "jsonl":
        path = folder / "corpus.jsonl"
        path.write_text(
            "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(documents))
        )
    else:
        path = folder / "corpus.parquet"
        pq.write_table(pa.table({field: documents}), path)
    return path


def text_store(paths, cache, **options):
    module = TextDataModule(paths=[str(p) for p in paths], cache_dir=str(cache), **options)
    module.setup()
    return module


def counting_reads(module) -> list[int]:
    reads = []
    original = module.read_corpus
    module.read_corpus = lambda *args: reads.append(1) or original(*args)
    return reads


def tokens_of(module) -> list[list[int]]:
    store = module.token_store
    bounds = store.offsets.tolist()
    return [store.tokens[bounds[i] : bounds[i + 1]].tolist() for i in range(store.num_documents)]


# -- formats -------------------------------------------------------------------------------


def test_txt_jsonl_and_parquet_give_the_same_documents(tmp_path):
    stores = {
        kind: tokens_of(text_store([write_corpus(tmp_path / kind, kind)], tmp_path / "cache"))
        for kind in ("txt", "jsonl", "parquet")
    }
    assert len(stores["txt"]) == len(DOCUMENTS)
    assert stores["txt"] == stores["jsonl"] == stores["parquet"], "the formats disagree"
    assert bytes(stores["txt"][3][:-1]).decode() == DOCUMENTS[3]
    assert stores["txt"][3][-1] == 256, "each document ends with the end-of-text token"


def test_txt_documents_do_not_depend_on_where_the_file_is_read_in_chunks(tmp_path, monkeypatch):
    documents = ["é" * (i % 7 + 1) + f" speech {i}" for i in range(200)]
    path = tmp_path / "corpus.txt"
    path.write_text(" \n \n".join(documents) + "\n")
    whole = tokens_of(text_store([path], tmp_path / "whole"))
    monkeypatch.setattr(readers, "CHUNK_BYTES", 5)  # cuts separators and characters alike
    chunked = tokens_of(text_store([path], tmp_path / "chunked"))
    assert chunked == whole
    assert len(whole) == len(documents)


def test_globs_and_folders_read_every_file_they_hold_in_name_order(tmp_path):
    for kind in ("txt", "jsonl", "parquet"):
        write_corpus(tmp_path / "mixed", kind)
    folder = text_store([tmp_path / "mixed"], tmp_path / "cache")
    assert folder.token_store.num_documents == 3 * len(DOCUMENTS)
    globbed = text_store([tmp_path / "mixed" / "*.json*"], tmp_path / "cache")
    assert tokens_of(globbed) == tokens_of(folder)[: len(DOCUMENTS)], "corpus.jsonl comes first"


def test_text_field_names_the_column_and_a_missing_one_lists_those_there_are(tmp_path):
    path = write_corpus(tmp_path / "body", "jsonl", field="body")
    module = text_store([path], tmp_path / "cache", text_field="body")
    assert module.token_store.num_documents == len(DOCUMENTS)
    with pytest.raises(DataError, match=r"no column data.text_field='text'.*\['body', 'id'\]"):
        text_store([path], tmp_path / "cache")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_rows_without_text_are_refused_with_their_count_unless_skipped(tmp_path, kind, caplog):
    path = write_corpus(tmp_path / kind, kind)
    if kind == "jsonl":  # row 8 lacks the field, row 21 holds null
        rows = path.read_text().splitlines()
        rows[7], rows[20] = json.dumps({"body": DOCUMENTS[7]}), json.dumps({"text": None})
        path.write_text("\n".join(rows) + "\n")
    else:
        texts = [None if i in (7, 20) else d for i, d in enumerate(DOCUMENTS)]
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)
    with pytest.raises(DataError) as refused:
        text_store([path], tmp_path / "cache")
    assert str(refused.value).startswith(
        f"2 of {len(DOCUMENTS)} rows of {path} have no 'text' (missing or null; the first is row 8)"
    ), refused.value
    assert "data.missing_text=skip" in str(refused.value)

    module = text_store([path], tmp_path / "cache", missing_text="skip")
    kept = [d for i, d in enumerate(DOCUMENTS) if i not in (7, 20)]
    assert [bytes(t[:-1]).decode() for t in tokens_of(module)] == kept
    assert f"Skipped 2 of {len(DOCUMENTS)} rows of {path} without a 'text'" in caplog.text


def test_sft_reads_parquet_conversations_as_it_reads_jsonl(tmp_path):
    records = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(30)]
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    stores = []
    for path in (jsonl, parquet):
        module = SFTDataModule(path=str(path), cache_dir=str(tmp_path / "cache"))
        module.setup()
        stores.append((tokens_of(module), module.token_store.targets.tolist()))
    assert stores[0] == stores[1], "the Parquet conversations differ from the JSONL ones"


# -- the store -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab_size", "dtype"),
    [(256, np.uint8), (257, np.uint16), (65_536, np.uint16), (65_537, np.uint32)],
)
def test_tokens_take_the_smallest_dtype_that_holds_the_vocabulary(vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype


def test_a_byte_store_holds_uint16_tokens_mapped_from_disk(tmp_path):
    module = text_store([write_corpus(tmp_path, "txt")], tmp_path / "cache")
    assert module.token_store.tokens.dtype == np.uint16  # 256 bytes and the end-of-text id
    assert isinstance(module.token_store.tokens, np.memmap)


def test_a_second_run_reads_the_store_without_tokenising(tmp_path):
    corpus = write_corpus(tmp_path, "txt")
    first = text_store([corpus], tmp_path / "cache")
    tokens_file = first.token_store.folder / "tokens.bin"
    written = tokens_file.stat().st_mtime_ns
    again = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(again)
    again.setup()
    assert reads == [], "tokenised again"
    assert tokens_file.stat().st_mtime_ns == written, "tokenised again"
    assert tokens_of(again) == tokens_of(first)


@pytest.mark.parametrize(
    "damage", ["truncate", "flip a byte", "lose the manifest", "garble the manifest"]
)
def test_a_damaged_store_is_rebuilt_not_read(tmp_path, damage, caplog):
    corpus = write_corpus(tmp_path, "txt")
    expected = tokens_of(text_store([corpus], tmp_path / "cache"))
    (folder,) = (tmp_path / "cache").glob("store-*")
    tokens = folder / "tokens.bin"
    if damage == "truncate":
        tokens.write_bytes(tokens.read_bytes()[:-10])
    elif damage == "flip a byte":
        data = bytearray(tokens.read_bytes())
        data[7] ^= 0xFF
        tokens.write_bytes(bytes(data))
    elif damage == "lose the manifest":
        (folder / "manifest.json").unlink()
    else:
        (folder / "manifest.json").write_text('{"format": 1}')
    again = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(again)
    again.setup()
    assert reads == [1], f"a store with {damage} was used"
    assert tokens_of(again) == expected
    assert "building it again" in caplog.text


def test_a_store_written_by_another_tokenizer_is_rebuilt(tmp_path):
    corpus = write_corpus(tmp_path, "txt")
    byte = text_store([corpus], tmp_path / "cache")
    bpe_options = {"tokenizer": {"kind": "bpe", "vocab_size": 300}}
    bpe = text_store([corpus], tmp_path / "cache", **bpe_options)
    assert bpe.token_store.folder != byte.token_store.folder
    expected = tokens_of(bpe)
    shutil.rmtree(bpe.token_store.folder)
    shutil.copytree(byte.token_store.folder, bpe.token_store.folder)  # the wrong tokens
    again = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"), **bpe_options)
    reads = counting_reads(again)
    again.setup()
    assert reads == [1]
    assert tokens_of(again) == expected


def test_a_full_disk_while_writing_leaves_the_previous_store_usable(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path, "txt")
    text_store([corpus], tmp_path / "cache")
    original = corpus.read_text()
    corpus.write_text(original + "\n\nA new speech.\n")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(token_store.StoreWriter, "add", full)
    with pytest.raises(DataError, match=r"^No space left .* are intact"):
        text_store([corpus], tmp_path / "cache")
    monkeypatch.undo()
    assert not list((tmp_path / "cache").glob(".store-*")), "a half-written store was left"
    corpus.write_text(original)
    again = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(again)
    again.setup()
    assert reads == [], "the previous store was lost"


def test_parallel_tokenisation_writes_the_same_store(tmp_path):
    lines = [f"line {i} " + "ab" * (i % 17) for i in range(45_000)]
    corpus = write_corpus(tmp_path, "txt", documents=lines)
    bpe = train_bpe(lambda: iter(lines[:2000]), 300)
    bpe.save(tmp_path / "bpe")
    options = {"document_split": "line", "tokenizer": {"path": str(tmp_path / "bpe")}}
    one = text_store([corpus], tmp_path / "one", num_proc=1, **options)
    two = text_store([corpus], tmp_path / "two", num_proc=2, **options)
    assert np.array_equal(one.token_store.tokens, two.token_store.tokens)
    assert np.array_equal(one.token_store.offsets, two.token_store.offsets)
    assert one.token_store.num_documents == len(lines)


def test_a_txt_corpus_is_tokenised_a_part_at_a_time_into_the_same_store(tmp_path, monkeypatch):
    lines = [f"line {i} " + "ab" * (i % 17) for i in range(3000)]
    corpus = write_corpus(tmp_path, "txt", documents=lines)
    whole = text_store([corpus], tmp_path / "whole", document_split="line")
    monkeypatch.setattr(readers, "PART_BYTES", 4096)
    monkeypatch.setattr(readers, "CHUNK_BYTES", 1024)  # parts end at a chunk's end
    opened = []
    original = readers.separately_mapped_parts
    monkeypatch.setattr(
        "src.data.text.packed_text.separately_mapped_parts",
        lambda corpus: (opened.append(part) or part for part in original(corpus)),
    )
    parts = text_store([corpus], tmp_path / "parts", document_split="line")
    assert len(opened) > 10, "the corpus was tokenised through one map"
    assert np.array_equal(parts.token_store.tokens, whole.token_store.tokens)
    assert np.array_equal(parts.token_store.offsets, whole.token_store.offsets)


def test_rows_are_read_by_position_as_the_map_holds_them(tmp_path):
    module = text_store([write_corpus(tmp_path, "txt")], tmp_path / "cache", overlong="split")
    store = module.token_store
    for begin, end in [(0, 5), (17, 90), (len(store.tokens) - 3, len(store.tokens))]:
        tokens, targets = store.read(begin, end)
        assert targets is None
        assert np.array_equal(tokens, store.tokens[begin:end])
    copy = pickle.loads(pickle.dumps(store))  # as a spawned loader worker receives it
    assert len(pickle.dumps(store)) < 2000, "the pickle carries the tokens"
    assert np.array_equal(copy.read(3, 40)[0], store.tokens[3:40])


def test_staging_folders_of_killed_builds_on_this_host_are_removed(tmp_path):
    cache = tmp_path / "cache"
    host, dead = socket.gethostname(), 2**22 + 12345  # above any pid this machine gives
    left = [
        cache / f".store-0123abcd.tmp-{host}-{dead}",
        cache / f".store-0123abcd.old-{host}-{dead}",
        cache / f".work-{host}-{dead}.k2j4_x9a",
    ]
    kept = [
        cache / f".store-0123abcd.tmp-{host}-{os.getpid()}",  # a build in progress
        cache / f".store-0123abcd.tmp-another-node-{dead}",  # another host's: not ours to judge
    ]
    for folder in left + kept:
        (folder / "part").mkdir(parents=True)
    text_store([write_corpus(tmp_path, "txt")], cache)
    assert [f for f in left if f.exists()] == []
    assert all(f.exists() for f in kept)
    assert not list(cache.glob(f".work-{host}-{os.getpid()}.*")), "this run's work folder stayed"


# -- bad input -----------------------------------------------------------------------------


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"fine\n\nfine too\n\xff\xfe broken\n")
    with pytest.raises(DataError, match=r"corpus.txt, line 4 is not UTF-8 text"):
        text_store([path], tmp_path / "cache")


def test_invalid_json_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl, line 3 is not valid JSON"):
        text_store([path], tmp_path / "cache")


def test_a_file_that_is_not_parquet_is_named_among_the_shards(tmp_path):
    write_corpus(tmp_path / "shards", "parquet")
    (tmp_path / "shards" / "broken.parquet").write_bytes(b"PAR1 and then nothing useful")
    with pytest.raises(DataError, match=r"broken\.parquet is not a Parquet file") as error:
        text_store([tmp_path / "shards"], tmp_path / "cache")
    assert "corpus.parquet" not in str(error.value)


def test_an_empty_corpus_and_a_missing_path_are_refused(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n \n\n")
    with pytest.raises(DataError, match="contain no text"):
        text_store([path], tmp_path / "cache")
    with pytest.raises(MissingFileError, match="neither a file, a folder nor a glob"):
        text_store([tmp_path / "nowhere.txt"], tmp_path / "cache")
    with pytest.raises(DataError, match="holds no"):
        text_store([tmp_path / "*.parquet"], tmp_path / "cache")


def test_a_conversation_without_an_answer_is_named_by_its_row(tmp_path):
    path = tmp_path / "chats.jsonl"
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"chats.jsonl, row 2: the conversation must end with"):
        SFTDataModule(path=str(path), cache_dir=str(tmp_path / "cache")).setup()


# -- packing on lengths --------------------------------------------------------------------


def previous_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """The packer the lengths-array one replaced: one item at a time, rows kept sorted by free
    space."""
    rows: list[list[int]] = []
    by_free_space: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        position = bisect.bisect_left(by_free_space, (lengths[index], -1))
        if position == len(by_free_space):
            rows.append([index])
            free, row = capacity - lengths[index], len(rows) - 1
        else:
            free, row = by_free_space.pop(position)
            rows[row].append(index)
            free -= lengths[index]
        if free > 0:
            bisect.insort(by_free_space, (free, row))
    return rows


def previous_greedy(lengths: list[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    used = capacity
    for index, length in enumerate(lengths):
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def padding(rows, lengths, capacity) -> float:
    return 1 - sum(lengths) / (len(rows) * capacity)


@pytest.mark.parametrize("capacity", [7, 64, 256, 2048])
def test_packing_on_lengths_gives_the_rows_of_the_previous_packer(capacity):
    generator = random.Random(capacity)
    for trial in range(20):
        count = generator.randint(0, 3000)
        tail = [
            min(capacity, int(generator.paretovariate(1.2) * capacity / 20)) for _ in range(count)
        ]
        uniform = [generator.randint(1, capacity) for _ in range(count)]
        lengths = [max(1, n) for n in (tail if trial % 2 else uniform)]
        greedy = [row.tolist() for row in pack(lengths, capacity, "greedy")]
        assert greedy == previous_greedy(lengths, capacity), f"greedy differs, trial {trial}"
        best_fit = [row.tolist() for row in pack(lengths, capacity, "best_fit")]
        expected = previous_best_fit(lengths, capacity)
        if lengths:
            gap = abs(padding(best_fit, lengths, capacity) - padding(expected, lengths, capacity))
            assert gap < 1e-3, f"best-fit padding differs by {gap:.4%}, trial {trial}"
        assert best_fit == expected, f"best-fit rows differ, trial {trial}"


def test_a_datamodule_packs_the_rows_the_previous_packer_would(tmp_path):
    module = text_store([write_corpus(tmp_path, "txt")], tmp_path / "cache", max_seq_len=64)
    train = module.datasets["train"]
    lengths = train.pieces.length.tolist()
    assert [row.tolist() for row in train.rows] == previous_best_fit(lengths, 64)


def test_preparation_runs_once_per_node_unless_the_cache_is_shared(tmp_path):
    corpus = write_corpus(tmp_path, "txt")
    per_node = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    shared = TextDataModule(
        paths=[str(corpus)], cache_dir=str(tmp_path / "cache"), prepare_per_node=False
    )
    assert per_node.prepare_data_per_node
    assert not shared.prepare_data_per_node
    shared.prepare_data()  # what global rank 0 runs, before every rank's setup
    reads = counting_reads(per_node)
    per_node.setup()
    assert reads == [], "a rank tokenised the corpus that preparation had stored"
