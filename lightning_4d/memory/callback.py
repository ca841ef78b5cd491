"""``MemoryEstimatorCallback``: refuse, in a second and before any model memory is allocated, a layout that would run
out of memory, saying why and which layouts would fit.

It runs in ``Callback.setup`` (Lightning calls it after the strategy has built the process group and the mesh, and
before ``configure_model`` and the strategy's ``setup`` allocate the model), on every rank. The estimate is a pure
function of the model config, the layout, the batch shape, the precision and the device memory, so every rank
computes the same figure and every rank raises (or none does): no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_4d.memory.hardware import GIB, parse_bytes

log = logging.getLogger(__name__)

__all__ = ["MemoryBudgetExceeded", "MemoryEstimatorCallback", "suggestion_line"]


def _size(n: float) -> str:
    """``n`` bytes as GiB (2^30), or MiB (2^20) below 1 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def suggestion_line(parallel_config: Any, micro_batch_size: int) -> str:
    """A ``FourDStrategy(...)`` call with every dimension of ``parallel_config`` (data, tensor, pipeline and context
    parallel sizes, ZeRO stage, activation checkpointing; with pp > 1 the pipeline schedule and the micro-batch
    count), followed by a comment naming the micro-batch size it assumes: a line that can be pasted as it is."""
    pc = parallel_config
    args = [f"data_parallel_size={pc.dp}", f"tensor_parallel_size={pc.tp}", f"pipeline_parallel_size={pc.pp}",
            f"context_parallel_size={pc.cp}", f"zero_stage={pc.zero_stage}",
            f"activation_checkpointing={pc.activation_checkpointing!r}"]
    if pc.pp > 1:
        args += [f"pipeline_schedule={pc.pipeline_schedule!r}", f"num_microbatches={pc.microbatches}"]
    return f"FourDStrategy({', '.join(args)})  # with micro_batch_size={micro_batch_size}"


class MemoryBudgetExceeded(RuntimeError):
    """The estimated peak memory of a rank exceeds the budget. ``estimate`` is the worst rank's
    :class:`~lightning_4d.memory.model.MemoryEstimate` (or the paper's estimate), ``suggestions`` a list of
    ``(ParallelConfig, estimate)`` that fit."""

    def __init__(self, message: str, estimate: Any = None, suggestions: Optional[list] = None) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.suggestions = suggestions or []


class MemoryEstimatorCallback(L.Callback):
    """Check the memory estimate of the job before the model is built.

    Args:
        budget: fraction of the device memory the estimated peak may use (0.8: the paper's rule; our estimate
            already includes the overhead allowance, so 0.8 leaves a further margin).
        device_memory: bytes or a size such as ``"80GiB"`` / ``"94GB"``; default the CUDA device's total memory.
            Without CUDA and without this argument there is nothing to check against and the check is skipped
            (logged).
        formula: ``"lightning_4d"`` (:func:`~lightning_4d.memory.model.estimate_memory`) or ``"fujii2024"``.
        enabled: ``False`` turns the check off.
        micro_batch_size, seq_length: the batch shape (default: read from the datamodule's ``micro_batch_size``
            and ``seq_length``).

    Raises:
        MemoryBudgetExceeded: (in ``setup``) the estimate of the worst pipeline stage exceeds
            ``budget · device_memory``; the message gives its breakdown and up to three layouts of the same world
            size that fit.
        ValueError: (at construction) a budget outside (0, 1], an unparsable ``device_memory``, an unknown formula.
    """

    def __init__(self, budget: float = 0.8, device_memory: Union[None, int, str] = None,
                 formula: str = "lightning_4d", enabled: bool = True, micro_batch_size: Optional[int] = None,
                 seq_length: Optional[int] = None) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget!r} is not valid: expected a fraction in (0, 1], e.g. 0.8.")
        if formula not in ("lightning_4d", "fujii2024"):
            raise ValueError(f"formula={formula!r} is not valid: expected 'lightning_4d' or 'fujii2024'.")
        self.budget = budget
        self.device_memory = parse_bytes(device_memory) if device_memory is not None else None
        self.formula = formula
        self.enabled = enabled
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.estimate: Any = None

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _model_config(pl_module: L.LightningModule) -> Any:
        from lightning_4d.models.config import LlamaConfig

        cfg = getattr(pl_module, "model_config", None)
        if isinstance(cfg, LlamaConfig):
            return cfg
        for m in pl_module.modules():
            if isinstance(getattr(m, "config", None), LlamaConfig):
                return m.config
        return None

    def _batch_shape(self, trainer: L.Trainer) -> tuple[Optional[int], Optional[int]]:
        dm = getattr(trainer, "datamodule", None)
        b = self.micro_batch_size or getattr(dm, "micro_batch_size", None)
        s = self.seq_length or getattr(dm, "seq_length", None)
        return b, s

    def _device(self, trainer: L.Trainer) -> tuple[Optional[int], Optional[str], str]:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            import torch

            props = torch.cuda.get_device_properties(device)
            return self.device_memory or props.total_memory, props.name, "cuda"
        return self.device_memory, None, device.type

    # ------------------------------------------------------------------ the check
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        from lightning_4d.memory.model import estimate_memory

        parallel_config = getattr(trainer.strategy, "parallel_config", None)
        cfg = self._model_config(pl_module)
        b, s = self._batch_shape(trainer)
        memory, gpu_name, device_type = self._device(trainer)
        missing = [name for name, value in (("a FourDStrategy layout", parallel_config), ("a lightning_4d Llama "
                   "model config", cfg), ("micro_batch_size", b), ("seq_length", s), ("device memory", memory))
                   if value is None]
        if missing:
            rank_zero_info(f"MemoryEstimatorCallback: check skipped (no {', '.join(missing)}).")
            return
        from lightning_4d.memory.model import PRECISIONS, _precision

        try:
            precision = _precision(str(trainer.precision))
        except ValueError:
            rank_zero_info(f"MemoryEstimatorCallback: check skipped (precision {trainer.precision!r} is not modelled; "
                           f"modelled: {list(PRECISIONS)}).")
            return
        # micro-batches per step: the pipeline schedule's m (resolved by the strategy), else gradient accumulation
        m = parallel_config.microbatches if parallel_config.pp > 1 else trainer.accumulate_grad_batches
        if self.formula == "fujii2024":
            from lightning_4d.memory.fujii2024 import fujii2024_from_config

            est = fujii2024_from_config(cfg, tp=parallel_config.tp, pp=parallel_config.pp, dp=parallel_config.dp,
                                        cp=parallel_config.cp, seq_length=s, micro_batch_size=b, num_microbatches=m,
                                        distributed_optimizer=parallel_config.zero_stage >= 1)
            total, breakdown = est.total, {"model_states": est.model_states, "activations": est.activations}
        else:
            est = estimate_memory(cfg, parallel_config, b, s, precision, num_microbatches=m,
                                  device_type=device_type, gpu_name=gpu_name)
            total = est.total
            breakdown = {k: getattr(est, k) for k in ("parameters", "gradients", "optimizer_states", "activations",
                                                      "logits", "buffers", "overhead")}
        self.estimate = est
        limit = self.budget * memory
        layout = (f"tp={parallel_config.tp} pp={parallel_config.pp} cp={parallel_config.cp} dp={parallel_config.dp} "
                  f"zero_stage={parallel_config.zero_stage} activation_checkpointing="
                  f"{parallel_config.activation_checkpointing}, micro_batch_size={b}, seq_length={s}, {precision}")
        if total <= limit:
            rank_zero_info(f"MemoryEstimatorCallback ({self.formula}): {layout}: estimated peak {_size(total)} "
                           f"per GPU = {100 * total / memory:.1f}% of {_size(memory)} (budget "
                           f"{100 * self.budget:.0f}%).")
            return
        lines = [f"estimated peak memory {_size(total)} per GPU exceeds the budget {_size(limit)} "
                 f"({100 * self.budget:.0f}% of {_size(memory)}) for {layout} ({self.formula} estimate, "
                 f"pp rank {getattr(est, 'pp_rank', 0)}; nothing was allocated). Breakdown:"]
        lines += [f"  {k:<17}{_size(v):>14}" for k, v in breakdown.items()]
        if self.formula == "lightning_4d":
            lines.append(f"  (peak phase: {est.peak_phase}; total = parameters + optimizer_states + overhead + the "
                         "largest phase, see docs/memory.md)")
        suggestions = self._suggest(trainer, cfg, b, s, precision, memory, device_type, gpu_name)
        if suggestions:
            lines.append(f"Layouts of the same {parallel_config.world_size} GPUs that fit (fastest predicted first):")
            for pc, e in suggestions:
                lines.append(f"  {suggestion_line(pc, b)}: {_size(e.total)}")
        else:
            lines.append("No layout of this world size fits with this micro-batch size and sequence length: use more "
                         "GPUs, a smaller micro_batch_size or a shorter seq_length (try `lightning-4d plan`).")
        lines.append("Disable this check with FourDStrategy(memory_check=False) or MemoryEstimatorCallback(enabled="
                     "False).")
        raise MemoryBudgetExceeded("\n".join(lines), est, suggestions)

    def _suggest(self, trainer: L.Trainer, cfg: Any, b: int, s: int, precision: str, memory: int,
                 device_type: str, gpu_name: Optional[str]) -> list:
        from lightning_4d.memory.planner import suggest_layouts

        pc = trainer.strategy.parallel_config
        try:
            return suggest_layouts(cfg, pc.world_size, b, s, precision, memory, self.budget,
                                   gpus_per_node=trainer.num_devices, device_type=device_type, gpu_name=gpu_name)
        except ValueError as err:  # no suggestion is better than hiding the real error
            log.debug("no layout suggestions: %s", err)
            return []
