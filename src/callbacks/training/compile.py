"""Compile the inner network with torch.compile, time the compilation and watch recompiles.

The network is compiled in place (`nn.Module.compile`), not wrapped, so checkpoint keys stay
`net.*` and load into an uncompiled model; the LightningModule itself is left alone, since
compiling it breaks `self.log` on current Lightning releases.
"""

import logging
import statistics
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

log = logging.getLogger(__name__)

# torch's logger for the reason of each recompilation (enabled by `set_logs(recompiles=True)`).
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


class _RecompileRecorder(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())


class Compile(Callback):
    """`torch.compile` for `pl_module.<module>`, with compile time and recompilation counts.

    Compile time is the first training step's time minus the median of the next
    `timing_steps` steps (compilation happens lazily, inside the first step). More than
    `max_recompiles` recompilations is reported as a recompilation storm, with the reason.
    Both go to the logger and `metrics.json` as `perf/compile_time_s` and `perf/recompiles`.
    """

    def __init__(
        self,
        module: str = "net",
        mode: str = "default",
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
        max_recompiles: int = 4,
        timing_steps: int = 5,
    ):
        self.module = module
        self.options = {
            "mode": mode,
            "fullgraph": fullgraph,
            "dynamic": dynamic,
            "backend": backend,
        }
        if mode == "default":
            del self.options["mode"]  # let backends without modes (e.g. "eager") accept it
        self.max_recompiles = max_recompiles
        self.timing_steps = timing_steps
        self.step_times: list[float] = []
        self.recorder = _RecompileRecorder()
        self._storm_reported = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        network = pl_module.get_submodule(self.module)
        network.compile(**self.options)
        torch._logging.set_logs(recompiles=True)
        recompiles = logging.getLogger(RECOMPILES_LOGGER)
        recompiles.addHandler(self.recorder)
        recompiles.propagate = False  # keep them for the report instead of the console
        log.info("Compiling %s.%s with %s", type(pl_module).__name__, self.module, self.options)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        logging.getLogger(RECOMPILES_LOGGER).removeHandler(self.recorder)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if len(self.step_times) <= self.timing_steps:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)  # only during the first few steps
            self.step_times.append(time.perf_counter() - self._start)
        if len(self.recorder.reasons) > self.max_recompiles and not self._storm_reported:
            self._storm_reported = True
            log.warning(
                "Recompilation storm: %s.%s recompiled %d times (more than %d). Last reason:\n%s"
                "\nCommon causes: changing shapes (use drop_last, fixed sequence lengths or "
                "dynamic=True), Python scalars that change every step, or train/eval switches.",
                type(pl_module).__name__,
                self.module,
                len(self.recorder.reasons),
                self.max_recompiles,
                self.recorder.reasons[-1],
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = {"perf/recompiles": float(len(self.recorder.reasons))}
        if (compile_time := self.compile_time()) is not None:  # 0.0 is a measurement too
            metrics["perf/compile_time_s"] = compile_time
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=False, on_epoch=True, rank_zero_only=True)

    def compile_time(self) -> float | None:
        """First step minus a steady step, in seconds; None until enough steps ran."""
        if len(self.step_times) < 2:
            return None
        return max(0.0, self.step_times[0] - statistics.median(self.step_times[1:]))
