"""Streams of small numbered documents, and the loader helpers their tests share."""

from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq

from src.data.corpus.tokenizers import ByteTokenizer
from src.data.packing.collate import collate_rows
from src.data.text.pretraining import encode_documents
from src.data.text.streaming import StreamedRows
from tests.helpers import assert_same_tensors

TOKENIZER = ByteTokenizer()
COLLATE = partial(collate_rows, pad_id=TOKENIZER.pad_token_id, row_length=48)


def document(number: int) -> str:
    """Document `number`: its number first, then 0 to 60 words (some longer than a row)."""
    return f"doc{number:04d} " + " ".join(["word"] * ((number * 7) % 61))


def write_shards(folder, count: int, per_shard: int, column: str = "text") -> list:
    """`count` Parquet shards of `per_shard` numbered documents each, shard s holding
    documents s * per_shard onwards."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(count):
        numbers = range(shard * per_shard, (shard + 1) * per_shard)
        paths.append(folder / f"part-{shard:02d}.parquet")
        pq.write_table(pa.table({column: [document(n) for n in numbers]}), paths[-1])
    return paths


def stream(files, **options) -> StreamedRows:
    values = dict(
        separator=None,
        text_field="text",
        encoder=partial(encode_documents, tokenizer=TOKENIZER),
        max_seq_len=48,
        overlong="split",
        packing=True,
        packing_strategy="best_fit",
        buffer_documents=7,
        seed=3,
    )
    return StreamedRows(files, **(values | options))


def document_numbers(rows) -> list[int]:
    """The numbers of the documents whose first pieces the rows hold."""
    numbers = []
    for row in rows:
        for sample in row:
            if sample.position_offset == 0:
                numbers.append(int(TOKENIZER.decode(sample.tokens[:7].tolist())[3:]))
    return numbers


def batches(loader, count: int) -> list[dict]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


def assert_loader_resumes(loader, stop: int, total: int) -> None:
    """A loader from `loader()` stopped after `stop` batches and a new one loaded with its
    state yield the `total` batches an uninterrupted one does."""
    expected = batches(loader(), total)
    first = loader()
    head = batches(first, stop)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert_same_tensors(expected, head + batches(resumed, total - stop), "batches")
