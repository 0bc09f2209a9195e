"""The floors of the project's dependencies and their audit: `python scripts/dependencies.py`.

`floors [--extras dev,loggers,eval]` prints `name==floor` for each direct dependency (the
runtime list of pyproject.toml and the extras named), the constraints with which
`make install-min` installs the lowest versions the floors allow.

`audit` asks the package index's JSON API (`<index>/<name>/<version>/json`, the data pip-audit
reads) about every installed distribution and about the floor of each direct dependency, and
prints each advisory found. It fails (exit 1) on an advisory with a fixed release that affects a
direct dependency, at its floor (raise the floor) or as installed (upgrade it), and on a floor
the index has yanked; an advisory in a package that only other packages need, or with no fixed
release yet, is printed as a note. Where the index does not answer, the audit prints why and
passes: it is a check for machines with the network, and `make lint` runs it everywhere
(docs/dependencies.md).
"""

import argparse
import importlib.metadata
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/pypi"
PROJECT = "pytorch-template"  # the project itself: installed from this tree, not the index
PROBE_TIMEOUT_S = 5
QUERY_TIMEOUT_S = 15
THREADS = 16


@dataclass(frozen=True)
class Advisory:
    package: str
    version: str
    where: str  # "floor" or "installed"
    id: str
    aliases: tuple[str, ...]
    fixed_in: tuple[str, ...]
    direct: bool

    @property
    def fails(self) -> bool:
        """Whether the audit fails on it: a direct dependency that a fixed release would mend."""
        return self.direct and bool(self.fixed_in)

    def line(self) -> str:
        names = ", ".join((self.id, *self.aliases))
        fixed = f"fixed in {', '.join(self.fixed_in)}" if self.fixed_in else "no fixed release yet"
        fix = first_fix(self.version, self.fixed_in) if self.fixed_in else None
        if fix is None:
            remedy = "; nothing to upgrade to"
        elif self.where == "floor" and self.direct:
            remedy = f"; raise its floor in pyproject.toml to >={fix}"
        else:
            remedy = f'; pip install -U "{self.package}>={fix}"'
        label = "FAIL" if self.fails else "note"
        kind = "" if self.direct else " (not a direct dependency)"
        return (
            f"{label} {self.package} {self.version} ({self.where}){kind}: {names}, {fixed}{remedy}"
        )


def first_fix(version: str, fixed_in: tuple[str, ...]) -> str:
    """The lowest fixed release above the affected one (advisories list one per branch)."""
    try:
        fixes = [Version(v) for v in fixed_in]
        above = [v for v in fixes if v > Version(version)]
    except InvalidVersion:  # a fix named in no scheme pip compares: pass it on as written
        return fixed_in[0]
    return str(min(above or fixes))


def requirements(extras: list[str] | None) -> list[Requirement]:
    """The runtime requirements of pyproject.toml and those of the extras named (None: all)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise SystemExit("reading pyproject.toml needs Python 3.11 or newer (tomllib)") from None
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras or []) - set(optional))
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra {unknown}; it has {sorted(optional)}")
    lines = list(project["dependencies"])
    for extra in optional if extras is None else extras:
        lines += optional[extra]
    found: dict[str, Requirement] = {}
    for line in lines:
        requirement = Requirement(line)
        found.setdefault(canonicalize_name(requirement.name), requirement)
    return list(found.values())


def floor(requirement: Requirement) -> str:
    """The lowest version the requirement admits, as written (`>=`, `==` or `~=`)."""
    bounds = [s.version for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    if not bounds:
        raise SystemExit(
            f"pyproject.toml's {requirement} has no floor: give it one (>=) that the tests run on"
        )
    return max(bounds, key=Version)


def print_floors(extras: list[str] | None) -> int:
    for requirement in requirements(extras):
        # Constraints name no extras: `lm-eval[hf]>=0.4.13` constrains lm-eval.
        print(f"{canonicalize_name(requirement.name)}=={floor(requirement)}")
    return 0


def fetch(url: str, timeout: float) -> dict | None:
    """The JSON document at the address, or None when the index has no such release."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    except urllib.error.URLError as error:
        if isinstance(error.reason, FileNotFoundError):  # a file:// index without the release
            return None
        raise


def release(index: str, name: str, version: str) -> tuple[str, dict] | None:
    """The index's document of that release, trying `2.4` as written and then as `2.4.0`."""
    candidates = [version]
    parts = version.split(".")
    if len(parts) < 3 and all(part.isdigit() for part in parts):
        candidates.append(".".join(parts + ["0"] * (3 - len(parts))))
    for candidate in candidates:
        document = fetch(f"{index}/{name}/{candidate}/json", QUERY_TIMEOUT_S)
        if document is not None:
            return candidate, document
    return None


def advisories_of(document: dict) -> list[dict]:
    return [v for v in document.get("vulnerabilities") or [] if not v.get("withdrawn")]


def installed() -> dict[str, str]:
    """Every installed distribution but the project itself: canonical name -> version."""
    found = {}
    for distribution in importlib.metadata.distributions():
        name = canonicalize_name(distribution.metadata["Name"] or "")
        if name and name != PROJECT:
            found.setdefault(name, distribution.version)
    return found


def probe(index: str) -> str | None:
    """Why the index's per-release JSON API cannot be used from here, or None when it can."""
    pip = importlib.metadata.version("pip")
    try:
        if fetch(f"{index}/pip/{pip}/json", PROBE_TIMEOUT_S) is None:
            return f"{index}/pip/{pip}/json is not found (no per-release JSON API there)"
    except (OSError, ValueError) as error:  # URLError, timeouts, refused connections, bad JSON
        return f"{index} does not answer ({error})"
    return None


def audit(index: str) -> int:
    started = time.perf_counter()
    reason = probe(index)
    if reason is not None:
        print(f"audit skipped: {reason}; run `make audit` where the package index is reachable")
        return 0
    direct = {canonicalize_name(r.name): floor(r) for r in requirements(None)}
    queries = [(name, version, "installed") for name, version in sorted(installed().items())]
    queries += [(name, version, "floor") for name, version in sorted(direct.items())]

    def ask(query: tuple[str, str, str]) -> tuple[tuple[str, str, str], tuple[str, dict] | str]:
        name, version, _ = query
        try:
            answer = release(index, name, version)
        except (OSError, ValueError) as error:  # one release the index did not answer for
            return query, f"{name} {version} ({error})"
        return query, answer if answer is not None else f"{name} {version} (not on the index)"

    found: list[Advisory] = []
    yanked = []  # floors the index has withdrawn: pip installs them only when pinned
    unanswered = []
    with ThreadPoolExecutor(THREADS) as pool:
        for (name, _, where), answer in pool.map(ask, queries):
            if isinstance(answer, str):
                unanswered.append(answer)
                continue
            info = answer[1].get("info") or {}
            if where == "floor" and info.get("yanked"):
                reason = info.get("yanked_reason") or "no reason given"
                yanked.append(
                    f"FAIL {name} {answer[0]} (floor): yanked from the index ({reason}); "
                    f"raise its floor in pyproject.toml past it"
                )
            for v in advisories_of(answer[1]):
                found.append(
                    Advisory(
                        package=name,
                        version=answer[0],
                        where=where,
                        id=v["id"],
                        aliases=tuple(v.get("aliases") or ()),
                        fixed_in=tuple(v.get("fixed_in") or ()),
                        direct=name in direct,
                    )
                )
    for line in sorted(yanked):
        print(line)
    for advisory in sorted(found, key=lambda a: (not a.fails, a.package, a.where, a.id)):
        print(advisory.line())
    failing = sum(advisory.fails for advisory in found) + len(yanked)
    elapsed = time.perf_counter() - started
    print(
        f"audit: {len(queries) - len(unanswered)} releases checked ({len(direct)} floors) in "
        f"{elapsed:.1f} s: {failing} failing, {len(found) + len(yanked) - failing} notes"
        + (f"; unchecked: {', '.join(unanswered)}" if unanswered else "")
    )
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    floors = commands.add_parser("floors", help="print name==floor for each direct dependency")
    floors.add_argument(
        "--extras", default="", help="comma-separated extras of pyproject.toml to include"
    )
    audit_parser = commands.add_parser("audit", help="ask the package index for advisories")
    audit_parser.add_argument("--index-url", default=INDEX, help=f"default {INDEX}")
    args = parser.parse_args(argv)
    if args.command == "floors":
        return print_floors([extra for extra in args.extras.split(",") if extra])
    return audit(args.index_url.rstrip("/"))


if __name__ == "__main__":
    sys.exit(main())
