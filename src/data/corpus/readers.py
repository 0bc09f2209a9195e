"""Local corpora as Hugging Face `datasets` tables (Arrow, memory-mapped).

`.txt` files are cut into documents, `.jsonl`/`.json` and `.parquet` files read as they are, from
files, globs or folders, and Hugging Face datasets named by `hf://datasets/<org>/<name>` as the
Parquet file of their split (`src.data.corpus.hub`).

Bad input stops with a one-line `DataError` naming the file and the line or row.
"""

import codecs
import glob
import itertools
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import datasets
import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from src.data.corpus.hub import HubOptions, hub_dataset_file, is_hub_url
from src.utils.errors import ConfigError, DataError, MissingFileError
from src.utils.files import hash_file

log = logging.getLogger(__name__)

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CHUNK_BYTES = 4 << 20
PART_BYTES = 64 << 20  # text per Arrow file of a `.txt` corpus

datasets.disable_progress_bars()
# Its failures reach the user as our one-line errors, not as its log lines.
datasets.logging.set_verbosity(datasets.logging.CRITICAL)


def resolve_files(
    paths: list[str], key: str = "data.paths", hub: HubOptions | None = None
) -> list[Path]:
    """The files `paths` name, in order.

    Files as given, globs and folders (their files of a known format, not recursing) in name order;
    a dataset `hf://datasets/<org>/<name>` as the Parquet file of the split `hub` names, written
    into its cache folder once.
    """
    found: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if is_hub_url(entry):
            found.append(hub_dataset_file(str(entry), hub or HubOptions(), key))
        elif glob.has_magic(str(entry)):
            matches = [Path(p) for p in sorted(glob.glob(str(entry), recursive=True))]
            found += [p for p in matches if p.is_file() and p.suffix in FORMATS]
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FORMATS)
        elif path.is_file():
            if path.suffix not in FORMATS:
                raise DataError(f"{key}: {str(path)!r} is not one of the formats {list(FORMATS)}")
            found.append(path)
        else:
            raise MissingFileError(f"{key}: {str(path)!r} is neither a file, a folder nor a glob")
    if not found:
        raise DataError(f"{key}={[str(p) for p in paths]} holds no {'/'.join(FORMATS)} files")
    return found


def resolve_stream_files(paths: list[str], key: str = "data.paths") -> list[str]:
    """The files a stream reads, in order.

    Local entries as `resolve_files` finds them, and URLs (`s3://`, `gs://`, `hf://`, any protocol
    of an installed fsspec filesystem) listed through fsspec the same way: a file as given, a
    glob's or a folder's files of a known format in name order.
    """
    found: list[str] = []
    for entry in paths:
        if "://" not in str(entry):
            found += [str(path) for path in resolve_files([entry], key)]
            continue
        try:
            fs, path = fsspec.core.url_to_fs(entry)
        except (ImportError, ValueError) as error:
            raise ConfigError(f"{key}: {entry!r} cannot be read here: {error}") from None
        if glob.has_magic(path):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(fs.ls(path, detail=False))
        elif fs.isfile(path):
            matches = [path]
        else:
            raise MissingFileError(f"{key}: {entry!r} is neither a file, a folder nor a glob")
        found += [fs.unstrip_protocol(m) for m in matches if Path(m).suffix in FORMATS]
    if not found:
        raise DataError(f"{key}={list(paths)} holds no {'/'.join(FORMATS)} files")
    return found


def open_file(url: str):
    """A local path or a URL opened for binary reading (fsspec for both)."""
    return fsspec.open(url, "rb")


def file_exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.isfile(path)


def content_fingerprint(files: list[Path]) -> str:
    """A hash of the files' names and contents, read in chunks.

    xxh3-128: a 1 GB corpus in a tenth of a second, where SHA-256 takes a second.
    """
    digest = xxhash.xxh3_128()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        hash_file(digest, path)
        digest.update(b"\0")
    return digest.hexdigest()


def read_documents(
    files: list[Path],
    separator: re.Pattern | None,
    text_field: str,
    work_dir: Path,
    missing_text: str = "raise",
) -> datasets.Dataset:
    """One row per non-empty document, in a column `text`.

    `.txt` files cut by `separator` (None: a file is a document) and stripped, JSON and Parquet
    rows' `text_field`; rows without it are refused unless `missing_text="skip"`
    (`check_rows_have_text`).
    """
    parts = []
    for number, (kind, run) in enumerate(itertools.groupby(files, lambda p: FORMATS[p.suffix])):
        group = list(run)
        if kind == "text":
            parts += read_text_files(group, separator, work_dir / f"text-{number}")
            continue
        records = read_records(group, kind, work_dir)
        check_text_field(group[0], text_field, records.column_names)
        records = records.select_columns([text_field])
        check_rows_have_text(group, text_field, records.data.column(text_field), missing_text)
        if text_field != "text":
            records = records.rename_column(text_field, "text")
        parts.append(records.with_format("arrow").filter(_has_text, batched=True).with_format())
    if len(parts) > 1:  # one text type, so that the parts concatenate
        string = datasets.Value("string")
        parts = [
            p if p.features["text"] == string else p.cast_column("text", string) for p in parts
        ]
    corpus = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if not len(corpus):
        raise DataError(f"{[str(p) for p in files]} contain no text")
    return corpus


def check_text_field(path: Path | str, text_field: str, columns: list[str]) -> None:
    """Raise a DataError naming the columns there are when `text_field` is not one of them."""
    if text_field not in columns:
        raise DataError(
            f"{path} has no column data.text_field={text_field!r}; its columns are {columns}"
        )


def check_rows_have_text(
    files: list[Path] | list[str], text_field: str, column: pa.ChunkedArray, missing_text: str
) -> None:
    """Refuse rows whose `text_field` is missing or null, naming how many and the first.

    With `missing_text="skip"` they are left out, and the log says how many.
    """
    missing = column.null_count
    if not missing:
        return
    where = str(files[0]) if len(files) == 1 else f"{len(files)} files from {files[0]} on"
    if missing_text == "skip":
        log.warning(
            "Skipped %d of %d rows of %s without a %r", missing, len(column), where, text_field
        )
        return
    first = pc.index(pc.is_null(column), True).as_py() + 1
    raise DataError(
        f"{missing} of {len(column)} rows of {where} have no {text_field!r} (missing or null; "
        f"the first is row {first}): point data.text_field at the column that holds the text, "
        f"or pass data.missing_text=skip to train without those rows"
    )


def read_text_files(
    files: list[Path], separator: re.Pattern | None, folder: Path
) -> list[datasets.Dataset]:
    """`.txt` documents written to Arrow files of about `PART_BYTES` each, which `datasets` maps.

    Cut here, because the `text` builder of `datasets` cuts only at lines or at exactly two
    newlines; in parts, so that tokenising one part at a time keeps no more than one part's pages
    resident (see `separately_mapped_parts`).
    """
    schema = pa.schema([("text", pa.string())])
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    writer: pa.RecordBatchStreamWriter | None = None
    written = PART_BYTES
    try:
        for path in files:
            for documents in text_documents(path, separator):
                if written >= PART_BYTES:
                    if writer is not None:
                        writer.close()
                    paths.append(folder / f"part-{len(paths):05d}.arrow")
                    writer, written = pa.ipc.new_stream(str(paths[-1]), schema), 0
                assert writer is not None  # written starts at PART_BYTES: the first batch opens one
                batch = pa.record_batch([pa.array(documents, pa.large_string())], schema)
                writer.write_batch(batch)
                written += batch.nbytes
    finally:
        if writer is not None:
            writer.close()
    return [datasets.Dataset.from_file(str(path)) for path in paths]


def separately_mapped_parts(corpus: datasets.Dataset) -> Iterator[datasets.Dataset]:
    """`corpus` as one Dataset per Arrow file, each opened with a map of its own in turn.

    A file is opened when the previous one is done. That takes a corpus of exactly those files in
    order (the `.txt` parts); any other corpus comes back as it is.

    A page of a memory-mapped file counts in the process's resident memory from when it is
    read until the map is closed: tokenising a 1 GB corpus through one map would end with all
    of it resident. A part's map closes when its Dataset is dropped.
    """
    files = [file["filename"] for file in corpus.cache_files]
    if corpus._indices is not None or not _is_concatenation_of(corpus, files):
        yield corpus  # a filtered or reordered view (JSON, Parquet)
        return
    for file in files:
        yield datasets.Dataset.from_file(file)


def _is_concatenation_of(corpus: datasets.Dataset, files: list[str]) -> bool:
    rows = 0
    for file in files:
        part = datasets.Dataset.from_file(file)
        if part.column_names != corpus.column_names:
            return False
        rows += len(part)
    return rows == len(corpus)


def text_documents(path: Path | str, separator: re.Pattern | None) -> Iterator[list[str]]:
    """The stripped, non-empty documents of one file, a chunk of the file at a time.

    The text after a chunk's last separator is carried into the next chunk.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    carried, lines = "", 0
    with open_file(str(path)) as file:
        while True:
            chunk = file.read(CHUNK_BYTES if separator is not None else -1)
            try:
                text = carried + decoder.decode(chunk, final=not chunk or separator is None)
            except UnicodeDecodeError as error:
                line = lines + chunk[: error.start].count(b"\n") + 1
                raise DataError(
                    f"{path}, line {line} is not UTF-8 text ({error.reason}); convert the file "
                    f"to UTF-8 or leave it out of data.paths"
                ) from None
            lines += chunk.count(b"\n")
            pieces = [text] if separator is None else separator.split(text)
            carried = pieces.pop() if chunk and separator is not None else ""
            documents = [piece.strip() for piece in pieces]
            yield [document for document in documents if document]
            if not chunk or separator is None:
                return


def read_records(files: list[Path], kind: str, work_dir: Path) -> datasets.Dataset:
    """JSON lines or Parquet rows through `datasets.load_dataset`, its errors named by file.

    A JSON error names the file and the line, a Parquet error the file.
    """
    try:
        return datasets.load_dataset(
            kind, data_files=[str(p) for p in files], split="train", cache_dir=str(work_dir)
        )
    except Exception as error:  # noqa: BLE001 - datasets fails with anything: the checks name it
        check = _check_json_lines if kind == "json" else _check_parquet
        for path in files:
            check(path)
        cause = error.__cause__ or error
        raise DataError(f"{[str(p) for p in files]} cannot be read as {kind}: {cause}") from None


def _check_json_lines(path: Path) -> None:
    """Raise a DataError naming the first line of `path` that is not a JSON object."""
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                raise DataError(f"{path}, line {number} is not UTF-8 text") from None
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}, line {number} is not valid JSON: {error.msg} (column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{path}, line {number} is not a JSON object: {line[:80]!r}")


def _check_parquet(path: Path) -> None:
    """Raise a DataError naming `path` when it is not a Parquet file or a row group won't decode.

    A row group that does not decode is named by its first row.
    """
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path} is not a Parquet file ({error})") from None
    row = 0
    for group in range(file.num_row_groups):
        try:
            file.read_row_group(group)
        except (pa.ArrowException, OSError) as error:
            message = f"{path}, rows from {row + 1}: not readable Parquet ({error})"
            raise DataError(message) from None
        row += file.metadata.row_group(group).num_rows


def _has_text(table: pa.Table) -> pa.Array:
    text = table["text"]
    return pc.fill_null(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0), False)
