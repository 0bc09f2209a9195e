"""What the benchmark scripts share: the machine they ran on, model configs by name, and the
Markdown report they print and write."""

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import OmegaConf

from src.models.language.qwen import QwenConfig
from src.utils.hardware import cpu_name

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
# The language models of `--quick` runs: the same architecture, a few seconds per benchmark.
QUICK_SIZES = dict(hidden_size=64, intermediate_size=128, head_dim=16, linear_key_head_dim=16,
                   linear_value_head_dim=16)  # fmt: skip


def machine() -> dict[str, object]:
    """The CPU (or GPU), cores, threads and versions that a benchmark's numbers belong to."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def machine_line(**versions: str) -> str:
    """`machine()` as the first line of a report, with more library versions if given."""
    info = machine()
    libraries = [f"torch {info['torch']}", *(f"{k} {v}" for k, v in versions.items())]
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads; "
        f"{', '.join(libraries)}, Python {info['python']}"
    )


def model_config(name: str, quick: bool = False) -> QwenConfig:
    """The `config` node of conf/model/<name>.yaml, shrunk to QUICK_SIZES when `quick`."""
    config = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))["config"]
    if quick:
        config.update({k: v for k, v in QUICK_SIZES.items() if k in config})
    return QwenConfig.from_dict(config)


def markdown(rows: Sequence[dict[str, str]], columns: Sequence[str]) -> str:
    """The rows as a Markdown table with these columns, in this order."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def publish(report: str, output: Path | None) -> None:
    """Print the report, and write it to `output` too when given."""
    print(report)
    if output:
        output.write_text(report + "\n")


def in_fresh_process(script: str, call: str) -> dict:
    """What `call` (a call of the functions of `scripts/<script>.py`) prints last as JSON, run
    in a new process."""
    # As `python scripts/<script>.py` imports it: beside this module, the scripts' shared code.
    scripts = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {scripts!r}); from {script} import *; {call}"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{call} failed:\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])
