"""Runs functions whose Triton kernels execute on CPU tensors through Triton's interpreter.

`python -m tests.models.triton_interpreter module:function ...` sets TRITON_INTERPRET=1 before
triton is imported (Triton reads it then), adapts the interpreter to flash-linear-attention's
kernels, calls each function and prints their results as one JSON object keyed by function.

Two adaptations: autotuned kernels would time every config through a GPU driver, so only the
first config is kept; and some kernels call `.to()` on the index of a plain `range` loop, which
the interpreter, running the kernel as Python, hands over as an int: inside kernels, `range`
yields the interpreter's tensors instead (what a compiled kernel's loop index is).
"""

import builtins
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime import interpreter
from triton.runtime.autotuner import Autotuner

_prune_configs = Autotuner.prune_configs
_patch_lang = interpreter._patch_lang


def _first_config(self, kwargs):
    return _prune_configs(self, kwargs)[:1]


def _tensor_range(*args):
    return (interpreter._implicit_cvt(index) for index in builtins.range(*args))


def _patch_lang_and_range(fn):
    """The interpreter's own patches for one kernel run, plus `range` in the kernel's module."""
    scope = _patch_lang(fn)
    scope.set_attr(sys.modules[fn.__module__], "range", _tensor_range)
    return scope


Autotuner.prune_configs = _first_config
interpreter._patch_lang = _patch_lang_and_range


def main(targets: list[str]) -> None:
    results = {}
    for target in targets:
        module, name = target.split(":")
        results[target] = getattr(importlib.import_module(module), name)()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
