"""Per optimizer step: tokens per second, model FLOPs utilization and peak device memory against the pre-fit estimate
(:class:`StepMonitor`; what to watch: ``docs/monitoring.md``)."""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy

from lightning_4d.contract import layout_strategy, optional_member
from lightning_4d.memory_check import MemoryEstimatorCallback
from lightning_4d.models.document_mask import DOCUMENT_IDS, attention_context
from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.planning.hardware import GIB, peak_flops_of_device

__all__ = ["StepMonitor"]


class StepMonitor(L.Callback):
    """Log, once per optimizer step, how fast the job trains and how much device memory it holds.

    Logged (``on_step``, through the Trainer's logger, rank 0's values but where said):

    - ``tokens_per_sec``: the step's global tokens (``b·s`` of every micro-batch of the step, times cp for the
      sequence shards and dp for the data-parallel replicas; tp and pp ranks share their tokens) over the step's wall
      time, from the start of its first micro-batch to the end of its last (data loading between steps and
      validation are not counted).
    - ``mfu``: model FLOPs utilization, ``tokens_per_sec · flops_per_token / (peak · world_size)`` with
      :meth:`LlamaConfig.flops_per_token` (PaLM's ``6·N + 12·L·h·s``, Chowdhery et al. 2022, appendix B; with
      document masking over the documents' own attention FLOPs, not the masked tiles the kernels compute beside them)
      and ``peak`` the device's dense bf16 FLOP/s: the
      ``peak_tflops`` argument, else on CUDA :func:`~lightning_4d.planning.hardware.peak_flops_of_device` (the
      planner's table). Not logged without a peak (a CPU without ``peak_tflops``, an unknown GPU) or without a
      lightning_4d ``model_config`` on the module.
    - ``peak_memory_gib``: on CUDA, ``torch.cuda.max_memory_allocated`` during the step (GiB = 2^30 bytes), the
      largest of all ranks (the estimate is the worst pipeline stage's); its statistics are reset at each step's
      start. CPU has no device allocator statistics: not logged there.
    - ``estimated_memory_gib``: the pre-fit estimate of the :class:`~lightning_4d.memory_check.MemoryEstimatorCallback`
      in the Trainer's callbacks (``FourDStrategy`` adds one on CUDA; on CPU add
      ``MemoryEstimatorCallback(device_memory=...)`` to have one), when it estimated, less its allowance for the CUDA
      context and allocator fragmentation (``MemoryEstimate.overhead``): the tensor bytes, what
      ``max_memory_allocated`` measures (the support matrix's smoke check compares the same two).
    - ``peak_memory_over_estimate``: ``peak_memory_gib / estimated_memory_gib`` when both are known.

    Args:
        peak_tflops: the device's peak in TFLOP/s (10^12 FLOP/s) for ``mfu``; default: the CUDA device's from the
            planner's table.

    Raises:
        ValueError: ``peak_tflops`` is not positive.
    """

    def __init__(self, peak_tflops: Optional[float] = None) -> None:
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"peak_tflops={peak_tflops!r} is not valid: expected a positive number of TFLOP/s.")
        self.peak_tflops = peak_tflops
        self._step_start: Optional[float] = None
        self._work_of: list[tuple[float, int, Any]] = []  # per micro-batch: global tokens, s, document ids or None
        self._global_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a fit that ended inside an accumulated step leaves no partial tokens or start time to the next fit
        self._step_start, self._work_of = None, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self._step_start is None:
            self._global_step = trainer.global_step
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
            self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._step_start is None:
            return
        # the document ids are kept, not counted here: counting reads them (a device sync on CUDA) inside the step
        documents = batch.get(DOCUMENT_IDS) if isinstance(batch, dict) else None
        self._work_of.append((*self._tokens_of(trainer, batch), documents))
        if trainer.global_step == self._global_step:  # the step accumulates more micro-batches
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        elapsed = time.perf_counter() - self._step_start
        metrics = self._memory(trainer)
        if elapsed > 0:
            metrics["tokens_per_sec"] = sum(tokens for tokens, _, _ in self._work_of) / elapsed
            peak = self._peak_flops(trainer)
            flops = self._flops(pl_module)
            if peak and flops:
                metrics["mfu"] = flops / elapsed / (peak * trainer.world_size)
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False)
        self._step_start, self._work_of = None, []

    def _flops(self, pl_module: L.LightningModule) -> float:
        """The model FLOPs of the step's micro-batches (0 without a lightning_4d ``model_config``); with document
        masking the attention FLOPs of each micro-batch's documents (``attention_context`` of its document ids), not
        of a window-long context."""
        cfg = optional_member(pl_module, "model_config")
        if not isinstance(cfg, LlamaConfig):
            return 0.0
        return sum(
            tokens * cfg.flops_per_token(s, attention_context(documents) if documents is not None else None)
            for tokens, s, documents in self._work_of
        )

    @staticmethod
    def _tokens_of(trainer: L.Trainer, batch: Any) -> tuple[float, int]:
        """The global tokens of one micro-batch (``input_ids`` ``[b, s/cp]``, or the ``[b·m, s/cp]`` of a pipeline
        step) and its window length s (tokens)."""
        if isinstance(batch, dict):
            ids = batch["input_ids"]
        else:  # a plain [b, s] tensor, or a (input_ids, ...) tuple
            ids = batch if isinstance(batch, torch.Tensor) else batch[0]
        b, s = ids.shape
        layout = layout_strategy(trainer.strategy)
        s *= layout.context_parallel_size if layout is not None else 1
        strategy = trainer.strategy
        dp = strategy.distributed_sampler_kwargs if isinstance(strategy, ParallelStrategy) else None
        return float(b * s * (dp or {}).get("num_replicas", 1)), s

    def _peak_flops(self, trainer: L.Trainer) -> Optional[float]:
        """The device's peak FLOP/s (``peak_tflops``, else the CUDA device's from the planner's table), or None."""
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        device = trainer.strategy.root_device
        return peak_flops_of_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    @staticmethod
    def _memory(trainer: L.Trainer) -> dict[str, float]:
        """``peak_memory_gib`` (CUDA: the largest of every rank), ``estimated_memory_gib`` and their ratio, those
        known."""
        out: dict[str, float] = {}
        estimates = [cb.estimate for cb in trainer.callbacks if isinstance(cb, MemoryEstimatorCallback)]
        estimate = next((e for e in estimates if e is not None), None)
        if estimate is not None:  # the tensor bytes: the allocator sees neither the CUDA context nor fragmentation
            out["estimated_memory_gib"] = (estimate.total - getattr(estimate, "overhead", 0)) / GIB
        device = trainer.strategy.root_device
        if device.type == "cuda":
            peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            out["peak_memory_gib"] = peak.item() / GIB
            if estimate is not None:
                out["peak_memory_over_estimate"] = out["peak_memory_gib"] / out["estimated_memory_gib"]
        return out
