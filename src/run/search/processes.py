"""Runs calls at once, each in a fresh Python process, with one GPU each when there are GPUs.

A call travels to its process by cloudpickle (a Hydra task function is defined in the entry
point's `__main__`, which plain pickle cannot send) through a file, and its result or error
comes back the same way: `python -m src.run.search.processes <call file> <result file>`.
"""

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cloudpickle


def run_in_processes(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each call's result, or the exception it raised or the error its process died of."""
    devices = gpu_slots(len(calls), visible_gpus())
    with tempfile.TemporaryDirectory(prefix="search-") as folder:
        paths = [Path(folder) / str(index) for index in range(len(calls))]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(run_in_process, calls, paths, devices))


def run_in_process(call: Callable[[], Any], path: Path, device: str | None) -> Any:
    call_file, result_file = path.with_suffix(".call"), path.with_suffix(".result")
    call_file.write_bytes(cloudpickle.dumps(call))
    env = dict(os.environ) if device is None else {**os.environ, "CUDA_VISIBLE_DEVICES": device}
    command = [sys.executable, "-m", __name__, str(call_file), str(result_file)]
    code = subprocess.run(command, env=env).returncode
    if not result_file.exists():
        return ChildProcessError(f"the process of this job exited with code {code}")
    return cloudpickle.loads(result_file.read_bytes())


def gpu_slots(jobs: int, gpus: Sequence[str]) -> list[str | None]:
    """The GPU of each job, round-robin over `gpus`; None for every job when there is none."""
    return [gpus[job % len(gpus)] if gpus else None for job in range(jobs)]


def visible_gpus() -> list[str]:
    """The GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else every one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip()]
    import torch  # slow to import: only a parallel batch needs it, in the parent

    return [str(index) for index in range(torch.cuda.device_count())]


def main(call_file: str, result_file: str) -> None:
    call = cloudpickle.loads(Path(call_file).read_bytes())
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - whatever the trial raised is the parent's to raise
        result = error
    try:
        payload = cloudpickle.dumps(result)
    except Exception as error:  # noqa: BLE001 - a result that does not pickle fails with anything
        payload = cloudpickle.dumps(RuntimeError(f"{result!r} (unpicklable: {error})"))
    Path(result_file).write_bytes(payload)


if __name__ == "__main__":
    main(*sys.argv[1:])
