"""Serves the repository's root pages (README.md, CONTRIBUTING.md) as pages of the site.

mkdocs reads pages from docs/ only, and the links in these pages are written for the
repository: from the root into docs/ (`docs/sweeps.md`) or from a guide up to the root
(`../CONTRIBUTING.md`). Each link that names a page of the site is pointed at that page, so
the same Markdown reads right on the repository host and on the site.
"""

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# A Markdown link's target up to its anchor: `](target#anchor)`.
LINK_TARGET = re.compile(r"(?<=\]\()([^)#\s]+)")
DOCS = "docs/"


def _root_pages(config) -> dict[str, str]:
    """Site page -> repository file, as `extra.root_pages` of mkdocs.yml lists them."""
    return dict(config.extra["root_pages"])


def on_files(files, config):
    root = Path(config.config_file_path).parent
    for page, source in _root_pages(config).items():
        files.append(File.generated(config, page, abs_src_path=str(root / source)))
    return files


def on_page_markdown(markdown, page, config, files):
    root_pages = _root_pages(config)
    site_page_of = {source: page for page, source in root_pages.items()}
    source = root_pages.get(page.file.src_uri, DOCS + page.file.src_uri)

    def site_link(match: re.Match) -> str:
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:|/", target):  # a URL or an absolute path: as written
            return target
        in_repository = posixpath.normpath(posixpath.join(posixpath.dirname(source), target))
        site_page = site_page_of.get(in_repository)
        if site_page is None and in_repository.startswith(DOCS):
            site_page = in_repository.removeprefix(DOCS)
        if site_page is None:  # not a page of the site: left for --strict to report
            return target
        return posixpath.relpath(site_page, posixpath.dirname(page.file.src_uri) or ".")

    return LINK_TARGET.sub(site_link, markdown)
