"""Keep transformers' Qwen3-Next on its PyTorch path where the GPU kernels cannot run.

transformers picks flash-linear-attention and causal-conv1d for Qwen3-Next whenever they import,
when its modeling module is first imported and whatever device the tensors are on later. Their
Triton and CUDA kernels cannot run on a CPU, so with the `dev` or `gpu` extra installed the
reference model (tests, scripts/bench_lm.py, lm-eval on an export) would fail there.
"""

import os
import sys

import torch

GPU_ONLY_PACKAGES = ("fla", "causal_conv1d")


def use_pytorch_kernels_in_transformers() -> None:
    """Mark the GPU-only kernel packages as absent where no CUDA device exists.

    Transformers then falls back to its PyTorch functions, as if the packages were not installed.

    Call it before the first transformers Qwen3-Next model is built. It changes nothing on a
    CUDA machine, under Triton's CPU interpreter (TRITON_INTERPRET=1, where the kernels do run)
    or for a package that is already imported.
    """
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    for name in GPU_ONLY_PACKAGES:
        # None: `import name` raises ImportError (typeshed admits only modules there).
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
