"""The commands of the README and of the guides work as written, and what they name exists.

A shell block whose info string is `bash runnable` (CONTRIBUTING.md) holds commands that must
succeed, one per line. The tests run a document's commands in its order in a temporary copy of
the tracked files, with the current interpreter for `python` and overrides appended that shrink
each run to a few batches (a value the command sets itself wins, except the FORCED ones);
Python scripts run in a warm interpreter (tests/warm_interpreter.py), which differs from a
cold one only in the project's own variables, and those no preloaded library reads. `<run>` in
a path is the run directory of the newest matching file that an earlier command of the same
document wrote. `make test-slow` runs every document's commands. The site's nav (mkdocs.yml)
must list every guide.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from tests.warm_interpreter import run_warm

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The README and every guide: each is read and checked the same way.
DOCUMENTS = [README, *sorted(DOCS.glob("*.md"))]
# The document whose table of config groups must list every group in conf/.
GROUPS_TABLE = DOCS / "configuration.md"
MKDOCS = ROOT / "mkdocs.yml"
RUNNABLE = "bash runnable"

# Appended to every `train.py` run unless the command sets the key: a few batches, no bar.
QUICK = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.enable_progress_bar=false",
    "callbacks.rich_progress_bar=null",
]
# Language models: two steps of a model a few hundred times smaller.
TINY_LM = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.head_dim=16",
]
HYDRA_SCRIPTS = ("train.py", "eval.py", "predict.py", "scripts/export.py", "scripts/evaluate_lm.py")
OTHER_SCRIPTS = (
    "scripts/check_env.py",
    "scripts/check_packing.py",
    "scripts/generate.py",
    "scripts/make_sft_data.py",
)
CHEAP_MAKE_TARGETS = ("help", "check-env", "train")


def name(document: Path) -> str:
    return str(document.relative_to(ROOT))


@dataclass(frozen=True)
class Command:
    text: str  # as written, without its comment
    document: Path
    line: int  # in the document

    @property
    def where(self) -> str:
        return f"{name(self.document)} line {self.line}"

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def code_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """Every fenced block: (info string, line number of its first line, its lines)."""
    blocks, info, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = re.match(r"\s*```(.*)$", line)
        if fence and info is None:
            info, start, lines = fence.group(1).strip(), number + 1, []
        elif fence and line.strip() == "```":
            blocks.append((info, start, lines))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def runnable_commands(document: Path) -> list[Command]:
    commands = []
    for info, start, lines in code_blocks(document.read_text()):
        if info != RUNNABLE:
            continue
        for offset, line in enumerate(lines):
            text = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if text:
                commands.append(Command(text, document, start + offset))
    return commands


each_document = pytest.mark.parametrize("document", DOCUMENTS, ids=name)
each_document_with_commands = pytest.mark.parametrize(
    "document", [d for d in DOCUMENTS if runnable_commands(d)], ids=name
)


def anchors(document: Path) -> set[str]:
    """The anchors of a document's headings, as the repository host names them."""
    return {
        re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", document.read_text(), re.MULTILINE)
    }


def setting(arg: str) -> str | None:
    """The key a Hydra override sets (`+trainer.x=1` -> `trainer.x`), None for other args."""
    if "=" not in arg or arg.startswith("-"):
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def train_overrides(args: list[str]) -> tuple[list[str], list[str]]:
    """(defaults, forced) that shrink `python train.py <args>` to seconds."""
    if "--help" in args or "--cfg" in args:
        return [], []
    defaults = list(QUICK)
    if any(arg.startswith("debug=") for arg in args):  # debug configs have no callbacks
        defaults.remove("callbacks.rich_progress_bar=null")
    if any(arg.startswith("+profile=") for arg in args):  # past the recorded window
        defaults.append("trainer.limit_train_batches=8")
    if any(arg.startswith("+tune=lr_find") for arg in args):  # enough points for a suggestion
        defaults += ["trainer.limit_train_batches=null", "callbacks.lr_find.num_training_steps=20"]
    if "trainer.strategy=ddp_spawn" in args:  # its ranks start afresh for fit and again for test
        defaults.append("test=false")  # the test stage: tests/run/test_distributed.py's multirun
    if any(arg.startswith(("experiment=lm_", "model=qwen")) for arg in args):
        defaults += ["trainer.max_steps=2", *TINY_LM]
    if "experiment=lm_sft" in args:
        defaults += ["data.synthetic_count=200", "data.exact_match_samples=2"]
    if "experiment=lm_dpo" in args:
        defaults += ["data.synthetic_count=200"]
    if "experiment=lm_grpo" in args:
        defaults += ["data.synthetic_count=200", "data.batch_size=4"]
    forced = ["hydra.sweeper.n_trials=2"] if "hparams_search=optuna" in args else []
    return defaults, forced


def with_overrides(args: list[str], defaults: list[str], forced: list[str]) -> list[str]:
    """`args`, then each default whose key they do not set (the last one per key), then forced."""
    taken = {setting(arg) for arg in args}
    chosen = {setting(d): d for d in defaults if setting(d) not in taken}
    return [*args, *chosen.values(), *forced]


def adapt(argv: list[str]) -> list[str]:
    """The command to run for a documented command: this interpreter, shrunk to seconds."""
    program, *args = argv
    if program == "make":
        (target,) = args[:1] or ["help"]
        assert target in CHEAP_MAKE_TARGETS, f"make {target} is not cheap enough to run here"
        # -o: never (re)install the environment from the copy; PY: this interpreter.
        make = ["make", "-s", "-o", ".venv/.installed", f"PY={sys.executable}", *args]
        if target == "train":
            make.append(f"ARGS={shlex.join(with_overrides([], *train_overrides([])))}")
        return make
    assert program in ("python", ".venv/bin/python"), f"{program}: not a command this test runs"
    script, *args = args
    assert script in HYDRA_SCRIPTS + OTHER_SCRIPTS, f"{script}: not a script this test knows"
    if script == "train.py":
        args = with_overrides(args, *train_overrides(args))
    elif script == "eval.py":
        args = with_overrides(args, QUICK[3:], [])
    elif script == "scripts/evaluate_lm.py":
        args = with_overrides(args, ["limit=12"], [])
    elif script == "scripts/check_packing.py":
        args = with_overrides(args, TINY_LM, [])
    elif script == "scripts/generate.py" and "--max-new-tokens" not in args:
        args += ["--max-new-tokens", "16"]
    return [sys.executable, script, *args]


def resolve(arg: str, root: Path) -> str:
    """`arg` with a path holding `<run>` pointed at the newest such file under `root`."""
    match = re.search(r"[^=\s]*<run>[^\s]*", arg)
    if not match:
        return arg
    pattern = match.group(0)
    found = [path for path in root.glob(pattern.replace("<run>", "*")) if path.exists()]
    assert found, f"no earlier command wrote {pattern}"
    newest = max(found, key=lambda path: path.stat().st_mtime_ns)
    return arg.replace(pattern, str(newest.relative_to(root)))


def write_user_files(root: Path) -> None:
    """What the documents expect users to bring: an image and a folder of images of digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index in range(4):
        pixels = (digits.images[index] * (255 / 16)).astype(np.uint8)  # light on dark, as trained
        image = Image.fromarray(pixels).resize((32, 32), Image.Resampling.NEAREST)
        (root / "my_images" / str(digits.target[index])).mkdir(parents=True, exist_ok=True)
        image.save(root / "my_images" / str(digits.target[index]) / f"{index}.png")
        if index == 0:
            image.save(root / "digit.png")


def copy_repository(dest: Path) -> Path:
    """The tracked files of the working tree (as they are now) under `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    write_user_files(dest)
    return dest


def run_in_copy(commands: list[Command], tmp_path: Path) -> None:
    root = copy_repository(tmp_path / "repo")
    # The copy is the root, and its logs/ and data/ are where a fresh clone has them.
    moved = ("PROJECT_ROOT", "PROJECT_LOG_DIR", "PROJECT_DATA_DIR")
    env = {k: v for k, v in os.environ.items() if k not in moved}
    for command in commands:
        argv = [resolve(arg, root) for arg in adapt(command.argv)]
        start = time.perf_counter()
        if argv[0] == sys.executable:
            result = run_warm(argv[1:], cwd=root, env=env, timeout=600)
        else:
            result = subprocess.run(
                argv, cwd=root, env=env, capture_output=True, text=True, timeout=600
            )
        print(f"{time.perf_counter() - start:6.1f} s  {command.where}  {command.text}")
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-4000:]
            pytest.fail(
                f"{command.where}: `{command.text}` exited with "
                f"{result.returncode}.\nRan: {shlex.join(argv)}\n{output}"
            )


@pytest.mark.slow
@each_document_with_commands
def test_every_runnable_command_runs_as_written(document, tmp_path):
    run_in_copy(runnable_commands(document), tmp_path)


@each_document
def test_every_runnable_command_can_be_run(document):
    for command in runnable_commands(document):
        argv = adapt(command.argv)  # fails for a program or make target it cannot run
        others = [p for p in re.findall(r"<[^>]*>", " ".join(argv)) if p != "<run>"]
        assert not others, f"{command.where}: placeholders {others} cannot run"


@each_document
def test_blocks_are_closed_and_runnable_lines_are_single_commands(document):
    assert document.read_text().count("```") % 2 == 0, f"{name(document)}: an unclosed code fence"
    for command in runnable_commands(document):
        assert not re.search(r"\\$|&&|\|\||;|\|", command.text), (
            f"{command.where}: one plain command per line (no `\\`, `&&`, `;`, "
            f"pipes), so that the tests can run it"
        )


@each_document
def test_links_and_paths_exist(document):
    """Links resolve from the document's folder, named paths from the root, anchors too."""
    text = document.read_text()
    links = {
        link
        for link in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text)
        if not link.startswith(("http:", "https:"))
    }
    named = re.findall(
        # docs/ by its pages only: a word such as the `docs/step` of a table header is no path.
        r"(?<![\w/.<-])((?:conf|src|scripts|tests|notebooks)/[\w./*-]*|docs/[\w.-]+\.md|"
        r"CONTRIBUTING\.md|Makefile|train\.py|eval\.py|predict\.py)",
        text,
    )
    paths = {p.rstrip(".,:") for p in named}
    if document == README:
        for required in ("docs/BENCHMARKS.md", "CONTRIBUTING.md", "notebooks/quickstart.ipynb"):
            assert required in paths | links, f"the README does not link {required}"
    missing = sorted(p for p in paths if not any(ROOT.glob(p)))
    missing += sorted(link for link in links if not (document.parent / link).exists())
    assert not missing, f"{name(document)} names files that do not exist: {missing}"
    broken = [
        f"{target}#{anchor}"
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text)
        if anchor not in anchors(document.parent / target if target else document)
    ]
    assert not broken, f"{name(document)} links to headings that do not exist: {broken}"


@each_document
def test_every_make_target_and_config_option_exists(document):
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    for info, start, lines in code_blocks(document.read_text()):
        if not info.startswith("bash"):
            continue
        for number, line in enumerate(lines, start):
            where = f"{name(document)} line {number}"
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["make"]:
                assert argv[1] in targets, f"{where}: no make target {argv[1]}"
            for arg in argv:
                group, equals, option = arg.lstrip("+").partition("=")
                if not equals or not (ROOT / "conf" / group).is_dir() or "." in group:
                    continue
                for option_name in option.strip("[]").split(","):
                    path = ROOT / "conf" / group / f"{option_name}.yaml"
                    assert path.is_file(), f"{where}: no option {group}={option_name}"


def groups_table(document: Path) -> dict[str, str]:
    """The rows of a document's tables that name a config group: group -> its options cell."""
    rows = re.findall(r"^\| `([\w/]+)` \| (.*?) \|", document.read_text(), re.MULTILINE)
    return {group: cell for group, cell in rows if (ROOT / "conf" / group).is_dir()}


@each_document
def test_the_options_a_groups_table_lists_exist(document):
    for group, cell in groups_table(document).items():
        for option in re.findall(r"`([\w-]+)`", cell):
            path = ROOT / "conf" / group / f"{option}.yaml"
            assert path.is_file(), f"{name(document)}: no option {group}={option}"


def test_the_groups_table_lists_every_group():
    groups = {
        str(path.relative_to(ROOT / "conf"))
        for path in (ROOT / "conf").rglob("*")
        if path.is_dir() and any(path.glob("*.yaml"))
    }
    undocumented = groups - set(groups_table(GROUPS_TABLE)) - {"paths", "hydra"}
    assert not undocumented, f"config groups missing from {name(GROUPS_TABLE)}: {undocumented}"


def nav_pages(entries: list) -> list[str]:
    """Every page a mkdocs nav names, sections walked into."""
    pages = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_nav_names_every_guide_and_each_entry_exists():
    config = yaml.safe_load(MKDOCS.read_text())
    root_pages = config["extra"]["root_pages"]  # site page -> repository file, by a hook
    pages = nav_pages(config["nav"])
    missing = [
        page
        for page in pages
        if not (DOCS / page).is_file() and not (ROOT / root_pages.get(page, "")).is_file()
    ]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    unlisted = sorted({path.name for path in DOCS.glob("*.md")} - set(pages))
    assert not unlisted, f"guides missing from mkdocs.yml's nav: {unlisted}"
    assert root_pages.get("index.md") == "README.md", "the site's home page is not the README"
    assert "index.md" in pages, "mkdocs.yml's nav has no home page"
