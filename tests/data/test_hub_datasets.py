"""Hugging Face datasets named by `hf://datasets/<org>/<name>`: loaded through `datasets`' own
code path, offline. `datasets` reads a local folder `<org>/<name>` of the working directory as
that dataset, and a folder of its cache laid out as a hub download as the cached dataset."""

import json
import shutil
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from src.data.corpus.readers import resolve_files
from src.data.text.pretraining import TextDataModule
from src.data.text.sft import SFTDataModule
from src.utils.errors import ConfigError, DataError
from tests.helpers import FAST, TINY_LM, compose_config, text_lm_overrides
from train import train

TRAIN = [f"Training document {i}: " + "word " * (1 + i % 9) for i in range(40)]
HELD_OUT = [f"Held-out document {i}" for i in range(6)]
COMMIT = "c0ffee" + "0" * 34


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    """No hub: offline mode, `datasets`' cache in `tmp_path`, which is the working directory."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)


def write_dataset(root, repo: str, splits: dict[str, list[dict]]) -> None:
    """`root/<repo>/data/<split>-00000-of-00001.parquet`, the layout of a hub dataset's files."""
    folder = root / repo / "data"
    folder.mkdir(parents=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}-00000-of-00001.parquet")


@pytest.fixture
def documents(tmp_path):
    write_dataset(
        tmp_path,
        "org/docs",
        {"train": [{"text": t} for t in TRAIN], "test": [{"text": t} for t in HELD_OUT]},
    )
    return "hf://datasets/org/docs"


def text_module(tmp_path, url: str, **options) -> TextDataModule:
    options = {"max_seq_len": 128, "batch_size": 4, "cache_dir": str(tmp_path / "cache")} | options
    module = TextDataModule(paths=[url], **options)
    module.setup()
    return module


def stored_texts(module: TextDataModule) -> list[str]:
    assert module.token_store is not None
    assert module.tokenizer is not None
    store, offsets = module.token_store, module.token_store.offsets
    ends = range(1, store.num_documents + 1)  # each document without its end-of-text token
    documents = [store.tokens[offsets[d - 1] : offsets[d] - 1].tolist() for d in ends]
    return sorted(module.tokenizer.decode(document) for document in documents)


def test_a_named_dataset_trains_on_its_split_and_validates_on_the_fractions(documents, tmp_path):
    module = text_module(tmp_path, documents)
    assert stored_texts(module) == sorted(TRAIN), "not the train split's rows"
    sizes = {split: len(rows.pieces) for split, rows in module.datasets.items()}
    assert sizes == {"train": 36, "val": 2, "test": 2}, f"split by the fractions: {sizes}"
    held_out = text_module(tmp_path, documents, hf_split="test")
    assert stored_texts(held_out) == sorted(HELD_OUT), "data.hf_split=test read another split"


def test_the_split_is_written_once_and_found_again_without_loading(
    documents, tmp_path, monkeypatch
):
    text_module(tmp_path, documents)
    (written,) = (tmp_path / "cache" / "hf-datasets").iterdir()
    stamp = written.stat().st_mtime_ns

    def load_again(*args, **kwargs):
        raise AssertionError("the split was loaded again")

    monkeypatch.setattr(datasets.DatasetBuilder, "as_dataset", load_again)
    monkeypatch.setattr(datasets.DatasetBuilder, "download_and_prepare", load_again)
    again = text_module(tmp_path, documents)
    assert [p.name for p in (tmp_path / "cache" / "hf-datasets").iterdir()] == [written.name]
    assert written.stat().st_mtime_ns == stamp, "the Parquet file was written again"
    assert again.token_store is not None
    assert again.token_store.num_documents == len(TRAIN)


def test_sft_reads_conversations_from_a_named_dataset(tmp_path):
    rows = [{"prompt": f"Add {i} and 1.", "response": str(i + 1)} for i in range(30)]
    write_dataset(tmp_path, "org/chats", {"train": rows})
    module = SFTDataModule(
        path="hf://datasets/org/chats", max_seq_len=64, cache_dir=str(tmp_path / "cache")
    )
    module.setup()
    assert module.token_store is not None
    assert module.token_store.num_documents == len(rows)
    assert module.tokenizer is not None
    first = module.datasets["train"].samples[0]
    trained = first.tokens[first.targets].tolist()
    assert trained[-1] == module.tokenizer.eos_token_id, "the answer's stop token is no target"
    answer = module.tokenizer.decode(trained[:-1])
    assert answer.isdigit(), f"the targets are not the response: {answer!r}"


def test_an_unknown_split_names_the_splits_there_are(documents, tmp_path):
    with pytest.raises(DataError) as raised:
        text_module(tmp_path, documents, hf_split="validation")
    message = str(raised.value)
    assert "data.hf_split='validation'" in message, message
    assert "['train', 'test']" in message, message


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("hf://models/org/model", "is not a dataset of the Hugging Face hub"),
        ("hf://datasets/org", "does not name a dataset"),
        ("hf://datasets/org/docs/data/train-00000-of-00001.parquet", "data.streaming=true"),
        ("hf://datasets/org/docs@v1", "keep one of them"),
    ],
)
def test_other_hf_urls_are_refused_in_one_line(url, says):
    with pytest.raises(ConfigError) as raised:
        resolve_files([url], hub=TextDataModule(paths=[url], hf_revision="v2").hub)
    message = str(raised.value)
    assert says in message, message
    assert url in message, message
    assert "\n" not in message, message


def test_a_dataset_out_of_reach_offline_is_refused_saying_how_to_fix(tmp_path):
    with pytest.raises(DataError) as raised:
        text_module(tmp_path, "hf://datasets/org/absent@v2")
    message = str(raised.value)
    assert "\n" not in message, message
    for part in ("data.paths: hf://datasets/org/absent@v2", "not in the local Hugging Face cache"):
        assert part in message, message
    for fix in ("HF_HUB_OFFLINE", "HF_HOME", "revision='v2'", "hf download org/absent"):
        assert fix in message, f"{fix} missing from: {message}"


def cache_as_downloaded(tmp_path, repo: str, commit: str) -> None:
    """Put `repo` in `datasets`' cache as a download of `commit` from the hub would leave it."""
    staging = tmp_path / "staging"
    write_dataset(staging, repo, {"train": [{"text": t} for t in TRAIN]})
    # Prepared from a folder named as the dataset: its Arrow files are named as a download's.
    loaded = datasets.load_dataset(str(staging / repo), split="train")
    prepared = Path(loaded.cache_files[0]["filename"]).parent
    hub_layout = datasets.config.HF_DATASETS_CACHE / repo.replace("/", "___") / "default"
    shutil.copytree(prepared, hub_layout / "0.0.0" / commit)
    shutil.rmtree(staging)


def test_offline_a_revision_is_used_only_when_the_cache_holds_it(tmp_path):
    cache_as_downloaded(tmp_path, "org/cached", COMMIT)
    cached = text_module(tmp_path, "hf://datasets/org/cached")
    assert stored_texts(cached) == sorted(TRAIN)
    pinned = text_module(tmp_path, f"hf://datasets/org/cached@{COMMIT[:10]}")
    assert pinned.token_store is not None
    assert pinned.token_store.num_documents == len(TRAIN)
    with pytest.raises(DataError) as raised:
        text_module(tmp_path, "hf://datasets/org/cached", hf_revision="v2")
    message = str(raised.value)
    assert "revision 'v2' cannot be resolved" in message, message
    assert COMMIT in message, f"the cached commit is not named: {message}"


def test_train_runs_on_a_named_dataset(documents, tmp_path):
    overrides = [
        *FAST,
        *TINY_LM,
        *text_lm_overrides(documents),
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_seq_len=64",
        "data.batch_size=4",
    ]
    train(compose_config(tmp_path / "run", overrides))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert {"val/loss", "test/loss"} <= set(metrics), f"no val or test loss in {sorted(metrics)}"
