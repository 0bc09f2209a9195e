"""Every dependency with a known advisory is required, and installed, above the releases it
affects; the floors `make install-min` installs are pyproject.toml's; the audit fails on an
advisory it can mend and only there; and the environment's requirements are consistent.

ADVISORIES is the record: add a row when an advisory is published for a dependency (the
audit, `make audit`, names it), then raise the floor in pyproject.toml until the tests pass.
"""

import importlib.metadata
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from scripts.dependencies import main
from tests.helpers import ROOT


@dataclass(frozen=True)
class Advisory:
    package: str
    id: str  # the GHSA id, or the PYSEC id where the advisory has none
    fixed: str | None  # the first release without it; None where no fixed release is named
    affected: tuple[str, ...]  # releases it affects, the last one known among them

    def __str__(self) -> str:
        fixed = f"fixed in {self.fixed}" if self.fixed else "no fixed release named"
        return f"{self.package} {self.id} ({fixed}; affects {', '.join(self.affected)})"


ADVISORIES = [
    # Compromised uploads: credentials harvested on `import lightning`.
    Advisory("lightning", "GHSA-w37p-236h-pfx3", None, ("2.6.2", "2.6.3")),
    # A checkpoint's `_instantiator` hyperparameters run code (CVE-2026-58659).
    Advisory("lightning", "GHSA-qqmf-gpg7-g8gw", "2.6.6", ("2.0.0", "2.5.6", "2.6.1", "2.6.5")),
    Advisory("lightning", "GHSA-75m9-98v2-hjpm", None, ("2.6.0",)),  # CVE-2026-31221
    # config.json's `_attn_implementation_internal` names code that runs (CVE-2026-4372).
    Advisory("transformers", "GHSA-29pf-2h5f-8g72", "5.3.0", ("4.56.0", "4.57.6", "5.2.0")),
    # Trainer._load_rng_state unpickles a checkpoint in full (CVE-2026-1839).
    Advisory("transformers", "GHSA-69w3-r845-3855", "5.0.0rc3", ("4.57.6", "5.0.0rc2")),
    # LightGlue's nested config overrides trust_remote_code (CVE-2026-5241).
    Advisory("transformers", "GHSA-fgcw-684q-jj6r", "5.5.0", ("5.2.0", "5.4.0")),
    # custom_generate code written to the cache before consent (CVE-2026-80047).
    Advisory("transformers", "GHSA-x9r9-c232-4q39", None, ("5.8.1",)),
    # save_pretrained writes outside its folder through chat-template names (CVE-2026-9856).
    Advisory("transformers", "GHSA-xrqw-3rrv-vx5w", "5.10.0", ("5.9.0",)),
    # The X-CLIP checkpoint conversion script unpickles (CVE-2025-14929).
    Advisory("transformers", "PYSEC-2025-217", None, ("5.0.0rc0",)),
    # torch.jit.script memory corruption (CVE-2025-3000).
    Advisory("torch", "GHSA-rrmf-rvhw-rf47", "2.13.0", ("2.11.0", "2.12.1")),
    # The weights_only unpickler corrupts memory on a crafted file (CVE-2026-24747).
    Advisory("torch", "GHSA-63cw-57p8-fm3p", "2.10.0", ("2.8.0", "2.9.1")),
    Advisory("torch", "PYSEC-2026-139", None, ("2.10.0",)),  # pt2 loading (CVE-2026-4538)
    # torch.load(weights_only=True) runs code (CVE-2025-32434).
    Advisory("torch", "GHSA-53q9-r3pm-6pq6", "2.6.0", ("2.5.1",)),
    Advisory("torch", "PYSEC-2022-43015", "1.13.1", ("1.13.0",)),  # CVE-2022-45907
    # instantiate() of a config runs security-sensitive callables (CVE-2026-68508).
    Advisory("hydra-core", "GHSA-2cp2-2r3c-7p7r", "1.3.4", ("1.3.2", "1.3.3")),
    # Callables resolved from the logging config, and two more closed by 1.3.7 (the release
    # that carries the fixes; the first fixed one may be earlier).
    Advisory("hydra-core", "GHSA-c3wx-c55w-pxjq", "1.3.6", ("1.3.2",)),
    Advisory("hydra-core", "GHSA-mwj6-rfh8-7qf4", "1.3.7", ("1.3.2",)),
    Advisory("hydra-core", "GHSA-rqx7-p7vv-w7hr", "1.3.7", ("1.3.2",)),
    # TfidfVectorizer keeps the discarded tokens in `stop_words_` (CVE-2024-5206).
    Advisory("scikit-learn", "GHSA-jw8x-6495-233v", "1.5.0", ("1.3.2", "1.4.2")),
    Advisory("numpy", "GHSA-6p56-wp2h-9hxr", "1.21.0", ("1.20.3",)),  # CVE-2021-33430
    Advisory("sqlalchemy", "GHSA-887w-45rq-vxgf", "1.2.18", ("1.2.17",)),  # CVE-2019-7164
    # MLflow's default credentials and a missing authorisation (CVE-2026-2635, CVE-2026-8147),
    # reported against mlflow-skinny 3.12 with 3.13.0 as the fix; no GHSA names mlflow-skinny.
    Advisory("mlflow-skinny", "CVE-2026-8147", "3.13.0", ("3.12.0",)),
    # The session's Vary: Cookie header missing on some accesses (CVE-2026-27205).
    Advisory("flask", "CVE-2026-27205", "3.1.3", ("3.1.2",)),
    # CORS rules matched against a path with '+' read as a space (CVE-2024-6844), and two more
    # path-matching flaws fixed in the same release (CVE-2024-6839, CVE-2024-6866).
    Advisory("flask-cors", "CVE-2024-6844", "6.0.0", ("4.0.1",)),
    # tmp_path's /tmp/pytest-of-<user> can be owned by another local user (CVE-2025-71176).
    Advisory("pytest", "GHSA-6w46-j5rx-g56g", "9.0.3", ("8.4.2", "9.0.2")),
    # Script injection through the search suggestions' `q` parameter (CVE-2026-73295).
    Advisory("mkdocs-material", "GHSA-xvg9-69gf-fjrf", "9.7.7", ("9.7.6",)),
]


def pyproject_requirements() -> dict[str, list[Requirement]]:
    """Each package pyproject.toml requires, runtime or in an extra: name -> its requirements."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    found: dict[str, list[Requirement]] = {}
    for line in lines:
        requirement = Requirement(line)
        found.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return found


def floor_of(requirement: Requirement) -> Version:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    assert bounds, f"pyproject.toml's {requirement} has no floor"
    return max(bounds)


@pytest.mark.parametrize("advisory", ADVISORIES, ids=str)
def test_every_requirement_of_an_advised_package_excludes_the_releases_it_affects(advisory):
    requirements = pyproject_requirements().get(canonicalize_name(advisory.package))
    assert requirements, f"{advisory.package} is no longer required: remove its rows"
    for requirement in requirements:
        admitted = [v for v in advisory.affected if requirement.specifier.contains(v, True)]
        assert not admitted, f"pyproject.toml's {requirement} admits {admitted}: {advisory}"
        floor = floor_of(requirement)
        if advisory.fixed is not None:
            assert floor >= Version(advisory.fixed), (
                f"pyproject.toml's {requirement} admits releases before {advisory.fixed}: "
                f"{advisory}; raise its floor"
            )
            assert requirement.specifier.contains(advisory.fixed, True) or floor > Version(
                advisory.fixed
            ), f"pyproject.toml's {requirement} refuses {advisory.fixed}, the fixed release"
        else:
            last = max(Version(v) for v in advisory.affected)
            assert floor > last, (
                f"pyproject.toml's {requirement} reaches down to {last}: {advisory}"
            )


@pytest.mark.parametrize(
    "distribution", sorted({a.package for a in ADVISORIES} | {"pytorch-lightning"})
)
def test_the_installed_release_of_an_advised_package_is_outside_every_advisory(distribution):
    try:
        installed = Version(importlib.metadata.version(distribution))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed")
    name = "lightning" if distribution == "pytorch-lightning" else distribution  # the same code
    for advisory in (a for a in ADVISORIES if a.package == name):
        if advisory.fixed is not None:
            bad = installed < Version(advisory.fixed)
        else:
            bad = installed <= max(Version(v) for v in advisory.affected)
        fix = f'pip install -U "{name}>{advisory.fixed or max(advisory.affected)}"'
        assert not bad, f"{distribution} {installed} is affected by {advisory}: {fix}"
        assert str(installed) not in advisory.affected, f"{distribution} {installed}: {advisory}"


def test_the_floors_are_pyprojects_lower_bounds_one_line_each_without_extras(capsys):
    required = pyproject_requirements()
    assert main(["floors", "--extras", "dev,loggers,eval"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pins = dict(line.split("==") for line in lines)
    assert len(pins) == len(lines), f"a package is pinned twice: {lines}"
    runtime_and_extras = {"lm-eval", "pytest", "mlflow-skinny", "torch", "transformers"}
    assert runtime_and_extras <= set(pins), f"missing from the floors: {lines}"
    assert "mkdocs-material" not in pins, "the docs extra was not asked for"
    for name, pinned in pins.items():
        assert "[" not in name, f"a constraint names an extra: {name}"
        for requirement in required[name]:
            assert Version(pinned) == floor_of(requirement), f"{name}=={pinned} vs {requirement}"
            assert requirement.specifier.contains(pinned), f"{requirement} refuses its floor"


def test_floors_refuse_an_extra_pyproject_does_not_define():
    pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    with pytest.raises(SystemExit, match="no extra"):
        main(["floors", "--extras", "nonexistent"])


def write_index(root: Path, releases: dict[tuple[str, str], dict]) -> str:
    """A package index on disk in the JSON API's layout, <root>/<name>/<version>/json, from
    each release's vulnerabilities and fields of its `info`."""
    for (name, version), release in releases.items():
        folder = root / name / version
        folder.mkdir(parents=True)
        info = {"name": name, "version": version, **release.get("info", {})}
        document = {"info": info, "vulnerabilities": release.get("vulnerabilities", [])}
        (folder / "json").write_text(json.dumps(document))
    return root.as_uri()


def advisory_record(id: str, fixed_in: list[str], withdrawn: str | None = None) -> dict:
    return {"id": id, "aliases": [f"CVE-{id}"], "fixed_in": fixed_in, "withdrawn": withdrawn}


def floor_as_written(name: str) -> str:
    """The floor of a pyproject.toml requirement as the audit asks the index for it."""
    (requirement,) = pyproject_requirements()[name]
    return next(s.version for s in requirement.specifier if s.operator == ">=")


def test_the_audit_fails_on_a_fixable_advisory_of_a_direct_dependency_only(tmp_path, capsys):
    pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    pip, lightning, packaging = (
        importlib.metadata.version(name) for name in ("pip", "lightning", "packaging")
    )
    index = write_index(
        tmp_path,
        {
            ("pip", pip): {},
            # A direct dependency as installed, with a fixed release on each of two branches.
            ("lightning", lightning): {
                "vulnerabilities": [advisory_record("LIGHT-1", ["1.0.1", "99.0"])]
            },
            # A package only other packages need: a note, whatever its fix.
            ("packaging", packaging): {"vulnerabilities": [advisory_record("PACK-1", ["99.0"])]},
            # A direct dependency at its floor (asked for as x.y.0) with no fixed release yet.
            ("cmaes", "0.12.0"): {"vulnerabilities": [advisory_record("CMA-1", [])]},
            # A withdrawn advisory is no advisory.
            ("rich", "13.0.0"): {
                "vulnerabilities": [advisory_record("RICH-1", ["99.0"], withdrawn="2026-01-01")]
            },
        },
    )
    assert main(["audit", "--index-url", index]) == 1
    out = capsys.readouterr().out
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    failing = lines.get(f"FAIL lightning {lightning} (installed)", "")
    assert 'LIGHT-1, CVE-LIGHT-1, fixed in 1.0.1, 99.0; pip install -U "lightning>=99.0"' in (
        failing
    ), out
    noted = lines.get(f"note packaging {packaging} (installed) (not a direct dependency)", "")
    assert noted.endswith('fixed in 99.0; pip install -U "packaging>=99.0"'), out
    assert "no fixed release yet" in lines.get("note cmaes 0.12.0 (floor)", ""), out
    assert "RICH-1" not in out
    # Where a release is installed at its floor (as in `make test-min`), the index's answer
    # about it counts twice: once as installed, once as the floor.
    at_floor = Version(lightning) == Version(floor_as_written("lightning"))
    cmaes_at_floor = importlib.metadata.version("cmaes") == "0.12.0"
    assert f"{1 + at_floor} failing, {2 + cmaes_at_floor} notes" in out, out


def test_the_audit_fails_on_a_floor_below_a_fixed_release_or_withdrawn_from_the_index(
    tmp_path, capsys
):
    optuna, hydra = floor_as_written("optuna"), floor_as_written("hydra-core")
    index = write_index(
        tmp_path,
        {
            ("pip", importlib.metadata.version("pip")): {},
            ("optuna", optuna): {"vulnerabilities": [advisory_record("OPT-1", ["99.1", "99.0"])]},
            ("hydra-core", hydra): {"info": {"yanked": True, "yanked_reason": "a broken wheel"}},
        },
    )
    assert main(["audit", "--index-url", index]) == 1
    out = capsys.readouterr().out
    assert (
        f"FAIL optuna {optuna} (floor): OPT-1, CVE-OPT-1, fixed in 99.1, 99.0; raise its floor "
        f"in pyproject.toml to >=99.0"
    ) in out, out
    assert f"FAIL hydra-core {hydra} (floor): yanked from the index (a broken wheel)" in out, out
    assert "2 failing, 0 notes" in out, out


def test_the_audit_passes_with_a_reason_where_the_index_does_not_answer(tmp_path, capsys):
    assert main(["audit", "--index-url", (tmp_path / "no-index").as_uri()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("audit skipped: "), out
    assert "/pip/" in out, out
    assert "`make audit`" in out, out


def test_the_installed_requirements_are_consistent():
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"pip check failed:\n{result.stdout}{result.stderr}"
