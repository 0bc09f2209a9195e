"""Record a short window of training steps with torch.profiler and explain what limits them.

Lightning's `PyTorchProfiler` names files by local rank (so nodes overwrite each other), cannot
be pickled for `ddp_spawn` and writes no analysis; this callback drives `torch.profiler`
directly around the training steps chosen by a schedule and writes, under
`<run dir>/profile/`:

- `trace_rank<R>_cycle<N>.json`: a Chrome/Perfetto trace per recorded cycle;
- `ops_rank<R>_cycle<N>.txt`: the operator table, by self CPU (and device) time;
- `report.md`, `report.png`, `report.json`: the bottleneck verdict of the last cycle
  (`report_rank<R>.*` on other ranks);
- with `data_batches > 0`, `data_trace_rank<R>.json` and `data_ops_rank<R>.txt`: the data
  loader alone, iterated for that many batches before training starts.
"""

import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.profiler import ProfilerActivity, profile, schedule

from src.callbacks.measurement.profile_report import analyse_trace, classify, write_report

log = logging.getLogger(__name__)


class Profiler(Callback):
    """Profiles training steps `skip_first + wait + warmup .. + active` (per cycle, `repeat` times).

    Steps are counted from the start of training, so `skip_first=500` records around step 500.
    Shapes are always recorded; `profile_memory` and `with_stack` add memory and Python stacks.
    """

    def __init__(
        self,
        dirpath: str,
        skip_first: int = 1,
        wait: int = 0,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        profile_memory: bool = False,
        with_stack: bool = False,
        data_batches: int = 0,
        row_limit: int = 30,
    ):
        self.dirpath = Path(dirpath)
        self.schedule = {
            "skip_first": skip_first,
            "wait": wait,
            "warmup": warmup,
            "active": active,
            "repeat": repeat,
        }
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.data_batches = data_batches
        self.row_limit = row_limit
        self.traces: list[Path] = []
        self._profiler: profile | None = None
        self._rank = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rank = trainer.global_rank
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self._device_sort = "self_cuda_time_total" if pl_module.device.type == "cuda" else None
        if self.data_batches:
            self._profile_data_loading(trainer)
        self._profiler = self._new_profiler(schedule(**self.schedule), self._on_cycle_ready)
        self._profiler.start()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        last = self.schedule["skip_first"] + self.schedule["repeat"] * (
            self.schedule["wait"] + self.schedule["warmup"] + self.schedule["active"]
        )
        if self._profiler.step_num >= last:
            self._finish(self._profiler)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._profiler is not None:
            self._finish(self._profiler)

    def _finish(self, profiler: profile) -> None:
        profiler.stop()
        self._profiler = None
        if not self.traces:
            log.warning(
                "The profiler recorded no complete cycle: train for more steps than "
                "skip_first + wait + warmup + active (%s).",
                self.schedule,
            )
            return
        stats = analyse_trace(self.traces[-1])
        verdict = classify(stats)
        name = "report" if self._rank == 0 else f"report_rank{self._rank}"
        write_report(stats, verdict, self.dirpath, name)
        log.info(
            "Profile: %s (%s); report in %s",
            verdict.title,
            verdict.category,
            self.dirpath / f"{name}.md",
        )

    def _new_profiler(self, step_schedule=None, on_trace_ready=None) -> profile:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        else:  # kineto would print `ERROR: ... gpuGetDeviceCount failed` on a CPU-only machine
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        return profile(
            activities=activities,
            schedule=step_schedule,
            on_trace_ready=on_trace_ready,
            record_shapes=True,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )

    def _on_cycle_ready(self, prof: profile) -> None:
        cycle = len(self.traces)
        trace = self.dirpath / f"trace_rank{self._rank}_cycle{cycle}.json"
        prof.export_chrome_trace(str(trace))
        self._write_table(prof, self.dirpath / f"ops_rank{self._rank}_cycle{cycle}.txt")
        self.traces.append(trace)

    def _write_table(self, prof: profile, path: Path) -> None:
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=self.row_limit)]
        if self._device_sort:
            tables.append(averages.table(sort_by=self._device_sort, row_limit=self.row_limit))
        if self.profile_memory:
            tables.append(averages.table(sort_by="self_cpu_memory_usage", row_limit=self.row_limit))
        path.write_text("\n\n".join(tables))

    def _profile_data_loading(self, trainer: Trainer) -> None:
        """Iterate the training loader alone; the RNG is restored so training is unchanged."""
        loader = trainer.train_dataloader
        with torch.random.fork_rng(), self._new_profiler() as prof:
            # Lightning has built the loader by on_train_start.
            for index, _ in enumerate(loader):  # type: ignore[arg-type]
                if index + 1 >= self.data_batches:
                    break
        prof.export_chrome_trace(str(self.dirpath / f"data_trace_rank{self._rank}.json"))
        self._write_table(prof, self.dirpath / f"data_ops_rank{self._rank}.txt")
