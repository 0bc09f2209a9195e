"""The installed and the required Lightning are outside every release with a known advisory,
and the environment's requirements are consistent."""

import importlib.metadata
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT

COMPROMISED = "GHSA-w37p-236h-pfx3"  # 2.6.2 and 2.6.3 on PyPI: credential theft on import
CHECKPOINT_RCE = "GHSA-qqmf-gpg7-g8gw"  # `_instantiator` in a checkpoint runs code; fixed 2.6.6
COMPROMISED_VERSIONS = ("2.6.2", "2.6.3")
FIRST_FIXED = Version("2.6.6")
FIX = 'pip install "lightning>=2.6.6"'
# Every known-bad version a requirement could admit: the compromised ones and releases of the
# 2.x line before the checkpoint fix.
KNOWN_BAD = (
    "2.0.0",
    "2.4.0",
    "2.5.0",
    "2.5.6",
    "2.6.0",
    "2.6.1",
    *COMPROMISED_VERSIONS,
    "2.6.4",
    "2.6.5",
)


def lightning_advisory(version: str) -> str | None:
    """The advisory that makes this Lightning version unsafe to install, or None."""
    if Version(version) in {Version(bad) for bad in COMPROMISED_VERSIONS}:
        return COMPROMISED
    if Version(version) < FIRST_FIXED:
        return CHECKPOINT_RCE
    return None


@pytest.mark.parametrize("distribution", ["lightning", "pytorch-lightning"])
def test_the_installed_lightning_has_no_known_advisory(distribution):
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed")
    advisory = lightning_advisory(version)
    assert advisory is None, (
        f"{distribution} {version} is affected by {advisory}; upgrade it: {FIX} "
        f"(and pytorch-lightning to the same version if installed)"
    )


def lightning_requirement() -> Requirement:
    """The `lightning` entry of pyproject.toml's dependencies."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"]]
    matches = [requirement for requirement in requirements if requirement.name == "lightning"]
    assert len(matches) == 1, f"pyproject.toml should require lightning once, found {matches}"
    return matches[0]


def test_the_lightning_requirement_excludes_every_known_bad_version():
    requirement = lightning_requirement()
    admitted = [v for v in KNOWN_BAD if requirement.specifier.contains(v, prereleases=True)]
    assert not admitted, (
        f"pyproject.toml's {requirement} admits {admitted} ({COMPROMISED}, {CHECKPOINT_RCE}); "
        f"require lightning>={FIRST_FIXED} or exclude them with !="
    )
    assert requirement.specifier.contains(str(FIRST_FIXED)), (
        f"pyproject.toml's {requirement} refuses {FIRST_FIXED}, the first fixed release"
    )


def test_the_installed_requirements_are_consistent():
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"pip check failed:\n{result.stdout}{result.stderr}"
