"""The import graph follows the layers CONTRIBUTING.md describes: no arrow points upward."""

import ast

import pytest

from tests.helpers import ROOT

# Lowest first. A module may import its own package and the packages of lower layers, never a
# package of its own layer or of a higher one.
LAYERS = (
    ("src.utils",),
    ("src.models", "src.data", "src.callbacks", "src.checkpoints"),
    ("src.run",),
)
ENTRY_POINTS = ("train.py", "eval.py", "predict.py", "scripts")


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer_of(package: str) -> int:
    for index, packages in enumerate(LAYERS):
        if package in packages:
            return index
    raise AssertionError(f"{package} belongs to no layer: add it to LAYERS and CONTRIBUTING.md")


def imported_modules(path) -> set[str]:
    """Every `src...` module the file imports, at the top or inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "src":  # `from src import data`
                modules.update(f"src.{alias.name}" for alias in node.names)
            else:
                modules.add(node.module)
    return {module for module in modules if module.startswith("src.")}


def source_files():
    return sorted(path for path in (ROOT / "src").rglob("*.py") if path.parent != ROOT / "src")


def entry_point_files():
    for name in ENTRY_POINTS:
        path = ROOT / name
        yield from sorted(path.glob("*.py")) if path.is_dir() else [path]


def module_name(path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def violations(path, own_package: str | None) -> list[str]:
    """The imports of `path` that point to its own layer (another package) or above."""
    own_layer = len(LAYERS) if own_package is None else layer_of(own_package)
    wrong = []
    for module in sorted(imported_modules(path)):
        package = package_of(module)
        if package == own_package:
            continue
        if layer_of(package) >= own_layer:
            wrong.append(module)
    return wrong


@pytest.mark.parametrize("path", source_files(), ids=lambda path: module_name(path))
def test_a_source_module_imports_only_its_package_and_lower_layers(path):
    package = package_of(module_name(path))
    assert not (wrong := violations(path, package)), (
        f"{module_name(path)} (layer {layer_of(package)}) imports {wrong}, which sit on its own "
        f"layer or above: {LAYERS}"
    )


def test_entry_points_import_no_test_code_and_every_src_package_has_a_layer():
    for path in entry_point_files():
        assert not any(m.startswith("tests") for m in imported_modules(path)), path
        assert not violations(path, None)
    packages = {package_of(module_name(path)) for path in source_files()}
    assert packages == {package for layer in LAYERS for package in layer}


def test_tests_share_code_only_through_support_modules_and_call_scripts_only_through_main():
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            names = [alias.name for alias in node.names]
            if node.module.startswith("tests."):  # helpers.py and the like, never a test_*.py
                assert not node.module.removeprefix("tests.").startswith("test_"), (
                    f"{path.name} imports the test module {node.module}"
                )
            if node.module.startswith("scripts."):
                assert names == ["main"], f"{path.name} imports {names} of {node.module}"


def test_the_check_finds_an_upward_import(tmp_path):
    module = tmp_path / "upward.py"
    module.write_text("def f():\n    from src.run.trainer import build_trainer\n")
    assert violations(module, "src.models") == ["src.run.trainer"]
    module.write_text("from src.utils.errors import ConfigError\nfrom src import data\n")
    assert violations(module, "src.models") == ["src.data"]
    module.write_text("from src.checkpoints.io import save_atomically\n")
    assert violations(module, "src.models") == ["src.checkpoints.io"]
    assert violations(module, "src.run") == []
