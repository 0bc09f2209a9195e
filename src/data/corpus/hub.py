"""Hugging Face datasets named by URL, `hf://datasets/<org>/<name>[@<revision>]`, as local Parquet.

The dataset is loaded through `datasets` in `load_dataset`'s own three steps (a builder for the
name, config and revision; download and prepare into its cache under HF_HOME; the split), and
that split is written once as a Parquet file in the datamodule's cache folder, named by the
commit it came from. From then on it is a local file like any other: read, fingerprinted and
tokenised into the token store as they are. A later run resolves the revision again (one
request to the hub, none offline) and finds the file instead of loading the split.

`datasets` reads an existing local folder `<org>/<name>` (relative to the working directory) as
that dataset before it asks the hub: the tests build their datasets that way.
"""

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import datasets
from datasets.exceptions import DatasetNotFoundError
from datasets.packaged_modules.cache.cache import Cache

from src.utils.errors import ConfigError, DataError
from src.utils.files import write_atomically

log = logging.getLogger(__name__)

SCHEME = "hf://"
PREFIX = "hf://datasets/"
FORM = "hf://datasets/<org>/<name> or hf://datasets/<org>/<name>@<revision>"


@dataclass(frozen=True)
class HubOptions:
    """What to load of a dataset named by URL, and where its Parquet file is kept.

    `data.hf_split` (any split `datasets` accepts: `test`, `train[:10%]`), `data.hf_config` (the
    dataset's config name; null: its default) and `data.hf_revision` (a branch, tag or commit;
    null: `main`, or the URL's `@<revision>`). `cache_dir` is the datamodule's; null: data/cache.
    """

    split: str = "train"
    config: str | None = None
    revision: str | None = None
    cache_dir: Path | None = None


def is_hub_url(entry: str) -> bool:
    return str(entry).startswith(SCHEME)


def hub_dataset_file(url: str, options: HubOptions, key: str = "data.paths") -> Path:
    """The Parquet file of the split `options` name of the dataset `url` names.

    Written once into `options.cache_dir`, under a name that holds the commit (a local folder's
    files' hash), then found there.
    """
    repo, revision = parse_hub_url(url, options.revision, key)
    where = f"{key}: {url}" + (f" (data.hf_config={options.config})" if options.config else "")
    builder = _builder(repo, options.config, revision, options.split, where, key)
    _check_cached_revision(builder, repo, revision, where)
    folder = (options.cache_dir or Path("data/cache")) / "hf-datasets"
    path = folder / _file_name(repo, builder.config.name, options.split, builder.hash)
    if path.is_file():
        log.info("%s: split %s already in %s", where, options.split, path)
        return path
    split = _split(builder, repo, revision, options.split, where, key)
    write_atomically(path, lambda file: split.to_parquet(file), what="dataset file")
    log.info("%s: wrote split %s (%d rows) to %s", where, options.split, len(split), path)
    return path


def parse_hub_url(url: str, revision_option: str | None, key: str) -> tuple[str, str | None]:
    """`<org>/<name>` and the revision: the URL's `@<revision>`, else `data.hf_revision`.

    Refuses another kind of `hf://` URL (models, spaces, files inside a dataset) and a URL whose
    revision differs from `data.hf_revision`.
    """
    if not url.startswith(PREFIX):
        raise ConfigError(f"{key}: {url!r} is not a dataset of the Hugging Face hub; write {FORM}")
    parts = url[len(PREFIX) :].rstrip("/").split("/")
    name, _, revision = parts[-1].partition("@")
    if len(parts) != 2 or not parts[0] or not name:
        raise ConfigError(
            f"{key}: {url!r} does not name a dataset; write {FORM} (the files inside a dataset "
            f"are read by data.streaming=true, or download them and pass them as local files)"
        )
    revision = unquote(revision)  # hf:// paths write a revision's slashes as %2F
    if revision and revision_option and revision != revision_option:
        raise ConfigError(
            f"{key}: {url!r} asks for revision {revision!r} and data.hf_revision for "
            f"{revision_option!r}; keep one of them"
        )
    return f"{parts[0]}/{name}", revision or revision_option


def _builder(repo: str, config: str | None, revision: str | None, split: str, where: str, key: str):
    """`datasets`' builder of the dataset: its name, config and revision resolved."""
    try:
        return datasets.load_dataset_builder(repo, name=config, revision=revision)
    except ConnectionError:
        raise DataError(_unreachable(repo, revision, split, where, key)) from None
    except DatasetNotFoundError as error:
        raise DataError(
            f"{where}: {error} Check the name and the revision; a private or gated dataset "
            f"needs a token (hf auth login, or HF_TOKEN)"
        ) from None
    except ValueError as error:  # no such config, or a config needed and none named
        message = str(error).splitlines()[0]
        raise DataError(f"{where}: {message} (data.hf_config picks the config)") from None


def _check_cached_revision(builder, repo: str, revision: str | None, where: str) -> None:
    """Refuse a revision that cannot be checked because the hub is out of reach.

    Without the hub, `datasets` serves the latest commit in its cache whatever the revision
    asks for; that commit is used only when no revision is named, or the revision is it.
    """
    if not isinstance(builder, Cache):
        return
    cached = builder.hash
    if revision is None or cached.startswith(revision):
        log.warning("%s: the hub is out of reach; using commit %s from the cache", where, cached)
        return
    raise DataError(
        f"{where}: revision {revision!r} cannot be resolved {_offline_reason()}, and the local "
        f"cache holds commit {cached} of {repo}: train on that one with {PREFIX}{repo}@{cached}, "
        f"or run where the hub can be reached"
    )


def _split(
    builder, repo: str, revision: str | None, split: str, where: str, key: str
) -> datasets.Dataset:
    """The split `split` of the prepared dataset, downloaded first unless cached."""
    try:
        builder.download_and_prepare()
    except ConnectionError:
        raise DataError(_unreachable(repo, revision, split, where, key)) from None
    try:
        return builder.as_dataset(split=split, in_memory=False)
    except (ValueError, KeyError):  # `datasets` raises either for an unknown split
        splits = list(builder.info.splits or {})
        raise DataError(
            f"{where}: data.hf_split={split!r} is not a split of it; its splits are {splits} "
            f"(or a slice of them, such as {splits[0] if splits else 'train'}[:10%])"
        ) from None


def _unreachable(repo: str, revision: str | None, split: str, where: str, key: str) -> str:
    at = f", revision={revision!r}" if revision else ""
    return (
        f"{where}: the dataset {repo} is not in the local Hugging Face cache "
        f"({datasets.config.HF_DATASETS_CACHE}) and cannot be downloaded here "
        f"({_offline_reason()}). Point HF_HOME at a cache that holds it; or, on a machine "
        f"online, load it once (python -c \"import datasets; datasets.load_dataset('{repo}', "
        f"split='{split}'{at})\") and copy its HF_HOME here, or download its files (hf download "
        f"{repo} --repo-type dataset --local-dir <folder>) and pass them in {key}"
    )


def _offline_reason() -> str:
    if datasets.config.HF_HUB_OFFLINE:
        return "offline: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set"
    return "the hub cannot be reached"


def _file_name(repo: str, config: str, split: str, commit: str) -> str:
    """`<org>--<name>--<config>--<split>--<key>.parquet`, the split spelt safely for a file name.

    The key is a hash of all four, so that two splits spelt alike differ.
    """
    key = hashlib.sha256(f"{repo}|{config}|{split}|{commit}".encode()).hexdigest()[:16]
    safe_split = re.sub(r"[^\w.+-]", "_", split)
    return f"{repo.replace('/', '--')}--{config}--{safe_split}--{commit[:12]}-{key}.parquet"
