"""``TrainingMonitor``: throughput, MFU, memory, communication volume and the pipeline timeline, logged to the
Trainer's loggers under any strategy (ours or Lightning's)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_parallel._compat import tree_leaves
from lightning_parallel.parallel.devices import host_all_reduce
from lightning_parallel.parallel.measure.comm_volume import CommCounter, CommEvent
from lightning_parallel.parallel.measure.flops import LocalFlopCounter, matmul_dtype, peak_flops, peak_memory_bytes
from lightning_parallel.parallel.measure.memory import model_state_bytes
from lightning_parallel.parallel.measure.timeline import (
    TimelineRecorder,
    bubble_fractions,
    gather_timelines,
    write_timeline,
)


class TrainingMonitor(pl.Callback):
    """Logs every ``log_every_n_steps`` optimizer steps: ``samples_per_second``, ``tokens_per_second`` (token
    batches), ``mfu`` (GPUs in :data:`~lightning_parallel.parallel.measure.flops.PEAK_FLOPS`),
    ``peak_memory_bytes``, ``model_state_bytes`` and ``comm_sent_bytes_per_step`` of this rank.

    One optimizer step, ``measure_step``, runs under a FLOP counter and a communication counter
    (:class:`~lightning_parallel.parallel.measure.comm_volume.CommCounter`); under pipeline parallelism with
    ``timeline_dir`` the next step is recorded as a timeline (``timeline.json``, a Chrome trace, and
    ``timeline.png``). Those steps are left out of the throughput (counting slows them down). Put it before
    other callbacks that enter dispatch modes, so the modes nest.

    Args:
        log_every_n_steps: optimizer steps between logs.
        tokens_per_sample: tokens in one sample; default: the model's ``tokens_per_sample`` attribute, else the
            second size of the batch's first tensor when it holds integer ids ``(B, T)``, else no token rate.
        flops_per_step: model FLOPs of one optimizer step over all ranks (forward and backward); default: the
            model's ``flops_per_sample`` times the samples of a step, else counted on ``measure_step`` (what
            every rank computed, summed: recomputation by activation checkpointing included).
        measure_step: the optimizer step counted (0-based); one late enough to leave out one-off work (pipeline
            shape inference, DDP's bucket rebuild). Runs shorter than that measure their last step.
        timeline_dir: where rank 0 writes the pipeline timeline; None: no timeline.

    Attributes:
        summary: the latest values: ``samples_per_second``, ``tokens_per_second``, ``mfu``, ``model_state_bytes``,
            ``comm_bytes_per_step`` (this rank's, by op kind), ``flops_per_step``, ``pipeline_bubble`` (rank 0:
            the idle fraction of each pp rank).
    """

    def __init__(
        self,
        log_every_n_steps: int = 10,
        tokens_per_sample: int | None = None,
        flops_per_step: float | None = None,
        measure_step: int = 2,
        timeline_dir: str | Path | None = None,
    ) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be 1 or more.")
        self.log_every_n_steps, self.tokens_per_sample = log_every_n_steps, tokens_per_sample
        self.flops_per_step, self.measure_step = flops_per_step, measure_step
        self.timeline_dir = Path(timeline_dir) if timeline_dir is not None else None
        self.summary: dict[str, Any] = {}
        self.comm_events: list[CommEvent] = []
        self._modes: list[Any] = []
        self._last_end: float | None = None
        self._window = [0.0, 0, 0]  # seconds, samples, tokens of the uninstrumented steps since the last log
        self._total = [0.0, 0, 0]  # the same over the whole fit: the steady-state rate (steady_rates)
        self._step_samples = self._step_tokens = 0
        self._samples_per_step = 0  # over all dp ranks
        self._instrumented = False

    # ----- which steps are instrumented -----
    def _chosen(self, trainer: pl.Trainer) -> tuple[int, int | None]:
        last = trainer.max_steps - 1 if trainer.max_steps and trainer.max_steps > 0 else self.measure_step + 1
        measure = min(self.measure_step, last)
        timeline = min(measure + 1, last) if self.timeline_dir is not None and _pp_rank(trainer) is not None else None
        return measure, timeline

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timeline_dir is not None and _pp_rank(trainer) is None:
            rank_zero_warn(
                f"TrainingMonitor(timeline_dir={str(self.timeline_dir)!r}) records pipeline schedules, but "
                f"{type(trainer.strategy).__name__} does not pipeline: no timeline is written (use hybrid3d, pp > 1)."
            )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        samples, tokens = self._batch_size(pl_module, batch)
        self._step_samples += samples * _dp_size(trainer)
        self._step_tokens += tokens * _dp_size(trainer)
        if self._modes or not _first_microbatch(trainer, idx):
            return
        measure, timeline = self._chosen(trainer)
        step = trainer.global_step
        if step == measure:
            self._modes = [CommCounter(), LocalFlopCounter()]
        if step == timeline:
            self._modes.append(TimelineRecorder(_pp_rank(trainer), trainer.strategy.root_device))
        for mode in self._modes:
            mode.__enter__()
        self._instrumented = self._instrumented or bool(self._modes)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not _last_microbatch(trainer, args[-1]):
            return
        now = time.perf_counter()
        if self._modes:
            self._finish_measurement(trainer, pl_module)
        elif self._last_end is not None and not self._instrumented:
            for totals in (self._window, self._total):
                totals[0] += now - self._last_end
                totals[1] += self._step_samples
                totals[2] += self._step_tokens
        self._instrumented = False
        self._samples_per_step = self._step_samples or self._samples_per_step
        self._step_samples = self._step_tokens = 0
        self._last_end = time.perf_counter()  # after the measurement's own collectives
        if trainer.global_step % self.log_every_n_steps == 0 or trainer.global_step == trainer.max_steps:
            self._log(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_end is not None:  # validation inside fit: the next step's time starts after it
            self._last_end = time.perf_counter()

    def steady_rates(self) -> dict[str, float]:
        """``samples_per_second`` and ``tokens_per_second`` (None without tokens) over every step of the fit but the
        first, the instrumented ones and validation (the steady state; {} when no step qualified)."""
        seconds, samples, tokens = self._total
        if seconds <= 0:
            return {}
        return {"samples_per_second": samples / seconds, "tokens_per_second": tokens / seconds if tokens else None}

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._exit_modes()

    def _exit_modes(self) -> list[Any]:
        modes, self._modes = self._modes, []
        for mode in reversed(modes):
            mode.__exit__(None, None, None)
        return modes

    def _batch_size(self, pl_module: pl.LightningModule, batch: Any) -> tuple[int, int]:
        first = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
        if first is None or first.dim() == 0:
            return 0, 0
        per_sample = self.tokens_per_sample or getattr(pl_module, "tokens_per_sample", None)
        if per_sample is None and first.dim() == 2 and not first.is_floating_point():
            per_sample = first.shape[1]  # token ids (B, T)
        return first.shape[0], first.shape[0] * int(per_sample or 0)

    # ----- measurements -----
    def _finish_measurement(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for mode in self._exit_modes():
            if isinstance(mode, CommCounter):
                self.comm_events = mode.events
                axes_of = _group_axes(trainer)
                self.summary["comm_bytes_per_step"] = mode.by_kind(axes_of)
                if axes_of is not None:  # what each mesh axis sent: the outer axes' bytes cross nodes
                    self.summary["comm_bytes_by_axis"] = mode.by_axis(axes_of)
                self.summary["comm_sent_bytes_per_step"] = mode.sent_bytes
            elif isinstance(mode, LocalFlopCounter):
                self._set_flops(trainer, pl_module, mode.flops)
            elif isinstance(mode, TimelineRecorder):
                self._write_timeline(trainer, mode)
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.summary["model_state_bytes"] = model_state_bytes(trainer.strategy.model, opts)

    def _set_flops(self, trainer: pl.Trainer, pl_module: pl.LightningModule, local: int) -> None:
        per_sample = getattr(pl_module, "flops_per_sample", None)
        if self.flops_per_step is not None:
            flops = float(self.flops_per_step)
        elif per_sample is not None:
            flops = float(per_sample() if callable(per_sample) else per_sample) * self._step_samples
        else:
            total = torch.tensor(float(local), dtype=torch.float64)
            if dist.is_available() and dist.is_initialized():  # every rank counted its share (dp batch, tp, pp)
                total = host_all_reduce(total)
            flops = float(total)
        self.summary["flops_per_step"] = flops

    def _write_timeline(self, trainer: pl.Trainer, recorder: TimelineRecorder) -> None:
        timelines = gather_timelines(recorder)
        if timelines is None:
            return
        assert self.timeline_dir is not None
        self.timeline_dir.mkdir(parents=True, exist_ok=True)
        write_timeline(timelines, self.timeline_dir / "timeline.json", self.timeline_dir / "timeline.png")
        self.summary["pipeline_bubble"] = bubble_fractions(timelines)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds, samples, tokens = self._window
        if seconds > 0:
            self.summary["samples_per_second"] = samples / seconds
            self.summary["tokens_per_second"] = tokens / seconds if tokens else None
        self._window = [0.0, 0, 0]
        self.summary["mfu"] = self._mfu(trainer)
        self.summary["peak_memory_bytes"] = peak_memory_bytes(trainer.strategy.root_device)
        values = {k: self.summary.get(k) for k in ("samples_per_second", "tokens_per_second", "mfu")}
        values["peak_memory_bytes"] = self.summary["peak_memory_bytes"]
        values["comm_sent_bytes_per_step"] = self.summary.get("comm_sent_bytes_per_step")
        states = self.summary.get("model_state_bytes")
        values["model_state_bytes"] = states["total"] if states else None
        metrics = {k: float(v) for k, v in values.items() if v is not None}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _mfu(self, trainer: pl.Trainer) -> float | None:
        device = trainer.strategy.root_device
        if device.type != "cuda" or "flops_per_step" not in self.summary or "samples_per_second" not in self.summary:
            return None
        peak = peak_flops(torch.cuda.get_device_name(device), matmul_dtype(str(trainer.precision)))
        if peak is None:
            return None
        steps_per_second = self.summary["samples_per_second"] / max(1, self._samples_per_step)
        return self.summary["flops_per_step"] * steps_per_second / (peak * trainer.world_size)


def _dp_size(trainer: pl.Trainer) -> int:
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    return int(kwargs["num_replicas"]) if kwargs else 1


def _first_microbatch(trainer: pl.Trainer, batch_idx: int) -> bool:
    return batch_idx % trainer.accumulate_grad_batches == 0


def _last_microbatch(trainer: pl.Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


def _pp_rank(trainer: pl.Trainer) -> int | None:
    """This rank's pp coordinate when the strategy pipelines (pp > 1), else None."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or dims.pp <= 1:
        return None
    return trainer.strategy.mesh.rank("stage")


def _group_axes(trainer: pl.Trainer) -> dict[str, str] | None:
    """Process group name -> mesh axes, under the mesh strategies (None under others)."""
    mesh = getattr(trainer.strategy, "_mesh", None)
    return mesh.group_axes() if mesh is not None else None
