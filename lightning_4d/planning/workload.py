"""What a training job runs, apart from its layout: the objects the memory model, the step-time model and the planner
take beside a :class:`~lightning_4d.config.ParallelConfig`.

- :class:`Workload`: the model, the batch shape (micro-batch size b, sequence length s, micro-batches per step m),
  the precision and the optimizer: what :func:`~lightning_4d.planning.model.estimate_memory` estimates one rank of;
- :class:`Job`: a job for the planner: the model, the GPUs (count, per node, kind), the sequence length, the global
  batch and the precision (:func:`~lightning_4d.planning.planner.plan`);
- :class:`Search`: which layouts of a job the planner enumerates (a fixed micro-batch size, fixed sizes, the
  optional features it also tries: :func:`~lightning_4d.planning.planner.enumerate_layouts`).

Plain containers: each function that takes one checks the values it reads, as it checked its keyword arguments.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Job", "Search", "Workload", "document_attention_context"]


def document_attention_context(seq_length: int, document_tokens: Optional[int]) -> float:
    """The context a token's attention spans on average in a window of ``seq_length`` tokens packed with documents of
    ``document_tokens`` tokens from the window's start (``lightning-4d measure``'s synthetic windows: an EOS every
    ``document_tokens`` tokens): ``Σ n_d² / s`` over the window's documents, ``(⌊s/N⌋·N² + (s mod N)²) / s``, the
    definition of :func:`lightning_4d.models.document_mask.attention_context` (which reads it from a batch's
    document ids), what :meth:`LlamaConfig.flops_per_token <lightning_4d.models.LlamaConfig.flops_per_token>` takes
    as ``attention_context``. ``seq_length`` without document masking (``None``) or for documents of ``s`` tokens or
    more: causal attention over the whole window."""
    s = seq_length
    if document_tokens is None or document_tokens >= s:
        return float(s)
    n = document_tokens
    return ((s // n) * n * n + (s % n) ** 2) / s


@dataclass(frozen=True)
class Workload:
    """One rank's training work for the memory model, beside its layout.

    Attributes:
        model: a :class:`~lightning_4d.models.LlamaConfig` (or a preset name, where the function says so).
        micro_batch_size: samples per micro-batch per dp rank (b).
        seq_length: tokens per sample (s, the full sequence before cp splits it).
        precision: ``"32-true"``, ``"bf16-mixed"`` (default), ``"bf16-true"`` or ``"16-mixed"``.
        num_microbatches: m, micro-batches per optimizer step (default: the layout's
            :attr:`~lightning_4d.config.ParallelConfig.microbatches`: its ``num_microbatches``, else pp; 2·pp for
            dualpipev).
        expert_load_imbalance: under expert parallelism, the rows the most loaded ep rank's experts receive in an MoE
            layer over the balanced figure (the rank's own ``T·k`` assignments), >= 1.0 (at most ``ep``). Default
            :data:`~lightning_4d.features.moe.costs.DEFAULT_EXPERT_LOAD_IMBALANCE` (measured on
            ``configs/tiny_moe.yaml``).
        fused_optimizer: the optimizer steps in place, with no temporaries (``torch.optim.AdamW(fused=True)``,
            :class:`~lightning_4d.tasks.CausalLMModule`'s; default); ``False``: ``AdamW(foreach=True)``, whose
            ``_foreach_sqrt`` of the second moments holds one moment's bytes at the step.
        document_masking: ``CausalLMModule(document_masking=True)``: every micro-batch's forward keeps its
            per-sample rotary tables and, without cp, one additive mask ``[b, 1, s, s]`` in the compute dtype that
            every layer's attention saves (under cp the whole sequence's document ids instead; the ``rope`` part of
            :func:`~lightning_4d.planning.model.saved_activation_bytes`).
        document_tokens: the length in tokens of the documents of a window under document masking: those
            ``lightning-4d measure`` packs its synthetic windows with (an EOS every ``document_tokens`` tokens), and
            those the step-time model counts the attention work of (:func:`document_attention_context`;
            :func:`~lightning_4d.planning.step_time.attention_work`); the memory model does not read it.
    """

    model: Any
    micro_batch_size: int
    seq_length: int
    precision: str = "bf16-mixed"
    num_microbatches: Optional[int] = None
    expert_load_imbalance: Optional[float] = None
    fused_optimizer: bool = True
    host_memory: Optional[int] = None
    document_masking: bool = False
    document_tokens: Optional[int] = None

    def job(self, num_gpus: int, gpus_per_node: int, global_batch_size: int, gpu: Any) -> "Job":
        """The :class:`Job` of this workload's model, sequence length, precision, ``expert_load_imbalance`` and
        ``fused_optimizer`` on ``num_gpus`` GPUs (``gpus_per_node`` per node, of kind ``gpu``) at
        ``global_batch_size`` samples per step (the memory check's suggestions)."""
        return Job(
            self.model,
            num_gpus,
            gpus_per_node,
            self.seq_length,
            global_batch_size,
            gpu,
            self.precision,
            self.expert_load_imbalance,
            self.fused_optimizer,
        )


@dataclass(frozen=True)
class Job:
    """A training job for the planner: what runs and on which GPUs.

    Attributes:
        model: a :class:`~lightning_4d.models.LlamaConfig`.
        num_gpus: GPUs of the job; gpus_per_node: GPUs per node.
        seq_length: tokens per sample (s).
        global_batch_size: samples per optimizer step (b · m · dp).
        gpu: the GPU kind (a :class:`~lightning_4d.planning.hardware.GpuSpec`, e.g. of
            :data:`~lightning_4d.planning.hardware.GPU_PRESETS`); ``None`` where layouts are only enumerated, not timed.
        precision: the training precision (default ``"bf16-mixed"``).
        expert_load_imbalance, fused_optimizer: as :class:`Workload`'s, for every layout's memory estimate.
        host_memory: bytes of host memory per node; the planner drops an optimizer-offload layout needing more than
            its memory budget of it (``None``: not checked).
        document_tokens: document masking (``CausalLMModule(document_masking=True)``) with documents of this many
            tokens: every layout's memory estimate counts its masks (:attr:`Workload.document_masking`) and its step
            time the attention its masked kernels compute (:func:`~lightning_4d.planning.step_time.attention_work`);
            ``None``: no masking.
    """

    model: Any
    num_gpus: int
    gpus_per_node: int
    seq_length: int
    global_batch_size: int
    gpu: Any = None
    precision: str = "bf16-mixed"
    expert_load_imbalance: Optional[float] = None
    fused_optimizer: bool = True
    host_memory: Optional[int] = None
    document_tokens: Optional[int] = None

    def workload(self, micro_batch_size: int, num_microbatches: int) -> Workload:
        """The :class:`Workload` of one rank of a layout with micro-batch size b and m micro-batches per step."""
        return Workload(
            self.model,
            micro_batch_size,
            self.seq_length,
            self.precision,
            num_microbatches,
            self.expert_load_imbalance,
            self.fused_optimizer,
            document_masking=self.document_tokens is not None,
            document_tokens=self.document_tokens,
        )


@dataclass(frozen=True)
class Search:
    """Which layouts of a :class:`Job` the planner enumerates.

    Attributes:
        micro_batch_size: keep b fixed (the memory check's suggestions keep the user's batch shape); ``None``: every
            divisor of the samples per dp rank.
        fixed: keep some sizes fixed: any of ``tp``, ``pp``, ``cp``, ``dp``, ``ep``, ``zero_stage``, ``dp_replicate``
        tensor_parallel_overlap: also the layouts with ``tensor_parallel_overlap=True`` (tp > 1, sp, checkpointing
            none or full).
        compile: the layouts ``compile=True`` takes (checkpointing none or full), with it on.
    """

    micro_batch_size: Optional[int] = None
    fixed: Optional[dict[str, int]] = None
    tensor_parallel_overlap: bool = False
    compile: bool = False

    def considered(self) -> dict[str, bool]:
        """What ``plan``'s output reports of the search beside its layouts: whether it also tried the overlapped
        tp rings."""
        return {"tensor_parallel_overlap_considered": self.tensor_parallel_overlap}
