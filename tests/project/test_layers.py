"""The import rules that `lint-imports` cannot check, because they concern single-file modules.

The layers of `src/` and the packages it must not import are contracts in pyproject.toml
(`[tool.importlinter]`), checked by `make lint`.
"""

import ast
from pathlib import Path

from tests.helpers import ROOT

ENTRY_MODULES = ("train", "eval", "predict")


def imports_from(path: Path) -> list[tuple[str, list[str]]]:
    """Each absolute import in the file, at the top or inside a function: (module, names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_src_imports_no_entry_point_and_entry_points_import_no_test():
    for path in sorted((ROOT / "src").rglob("*.py")):
        entry = [module for module, _ in imports_from(path) if module in ENTRY_MODULES]
        assert not entry, f"{path.relative_to(ROOT)} imports the entry point {entry}"
    for name in ENTRY_MODULES:
        imported = [module for module, _ in imports_from(ROOT / f"{name}.py")]
        tests = [module for module in imported if module.split(".")[0] == "tests"]
        assert not tests, f"{name}.py imports test code: {tests}"


def test_tests_share_code_only_through_support_modules_and_call_scripts_only_through_main():
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        where = path.relative_to(ROOT)
        for module, names in imports_from(path):
            if module.startswith("tests."):  # helpers.py and the like, never a test_*.py
                assert not module.rsplit(".", 1)[-1].startswith("test_"), (
                    f"{where} imports the test module {module}"
                )
            if module.startswith("scripts."):
                assert names == ["main"], f"{where} imports {names or module} of {module}"


def test_no_folder_under_src_holds_more_than_twelve_modules():
    """Rooms stay rooms: a folder that outgrows twelve modules is split by domain."""
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in [ROOT / "src", *(ROOT / "src").rglob("*/")]
        if folder.is_dir() and folder.name != "__pycache__"
        if (count := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 12
    }
    assert not crowded, f"folders with more than 12 modules: {crowded}"
