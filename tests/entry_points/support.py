"""What the bad-input tables of this folder share."""

from pathlib import Path


def files_and_contents(*folders: Path) -> dict[str, bytes]:
    """Every file under `folders` with its bytes."""
    return {
        str(path): path.read_bytes()
        for folder in folders
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def assert_unchanged(before: dict[str, bytes], *folders: Path, case: str) -> None:
    """Every file of `before` is still there with the same bytes (new files may have come)."""
    after = files_and_contents(*folders)
    changed = [path for path, content in before.items() if after.get(path) != content]
    assert not changed, f"{case}: changed or removed: {changed}"
