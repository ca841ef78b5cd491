"""Enumerate the layouts of a training job, keep those that fit, rank them by a predicted step time.

A *job* is a model, a number of GPUs (``gpus_per_node`` per node) of one kind, a sequence length and a global batch
(samples per optimizer step). A *layout* is (tp, pp, cp, dp, micro-batch b, ZeRO stage, activation checkpointing)
with ``tp·pp·cp·dp = num_gpus``, tp inside a node, tp dividing the heads, kv heads, FFN size and padded vocabulary,
pp dividing the layers, ``seq_length`` divisible by ``2·cp`` (and by tp: sequence parallelism is on with tp > 1),
``b`` dividing ``global_batch / dp``, and for pp > 1 at least pp micro-batches ``m = global_batch / (dp·b)`` (1F1B).

**Step-time model** (analytical, for ranking; not a measurement). The FLOPs a step executes per token,
:func:`executed_flops_per_token`: ``F = 6N + 6·L·h·s`` with N = ``num_parameters()`` (Kaplan et al. 2020 §2.1 for
6N; causal attention computes half of the ``12·L·h·s`` score and context FLOPs of
:meth:`~lightning_4d.models.LlamaConfig.flops_per_token`: Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, Eq. 3 without the LM head term, which ``6N`` holds),
``F·4/3`` with full activation checkpointing (one more forward), ``F`` with selective checkpointing (its backward
re-runs no matmul and no attention kernel, only pointwise ops: their time is not modelled, nor is the communication
a recomputation repeats — full: the layer's tp collectives, selective: sequence parallelism's two all-gathers per
layer, both: context parallelism's K/V exchange), and an assumed efficiency ``eta = 0.5`` of the dense bf16 peak
``P``:

- per micro-batch and GPU: compute ``t_c = F·b·s / (tp·pp·cp) / (eta·P)``;
- tensor parallel (sp on): per layer 4 all-gathers / reduce-scatters forward and 4 backward of ``b·s·h/cp`` bf16
  values, each moving ``(tp−1)/tp`` of it per GPU over NVLink (``B_intra``): ``t_tp = 8·L/pp·2·b·(s/cp)·h·(tp−1)/tp / B_intra``;
- context parallel (all-gather K/V): per layer K and V gathered forward and their gradients reduce-scattered
  backward: ``t_cp = L/pp·4·2·b·s·(kv·d/tp)·(cp−1)/cp / B_cp``, ``B_cp`` NVLink when ``tp·cp <= gpus_per_node``,
  else the NIC bandwidth ``B_inter``;
- one step: ``(m + pp − 1)·(t_c + t_tp + t_cp)`` (the 1F1B bubble ``(pp−1)/(m+pp−1)``) + pipeline sends
  ``2·(m + pp − 1)·2·b·(s/cp)·h/tp / B_pp`` + data parallel ``t_dp = k·4·P_rank·(D−1)/D / B_dp`` with ``P_rank``
  this rank's parameters, D = dp·cp, k = 2 (ZeRO 0: ring all-reduce; ZeRO 2: reduce-scatter + all-gather), 3
  (ZeRO 1 here: all-reduce + all-gather, see ``parallel/zero.py``; ZeRO 3: + the forward all-gather), ``B_dp``
  NVLink when the whole ``dp_cp`` group is inside a node, else ``B_inter``. Communication is not assumed to
  overlap compute (a pessimistic ranking model; the overlap our ZeRO 0/1 does is a bonus).

Layouts are ranked by predicted step time; at equal times (no checkpointing and selective checkpointing always tie)
the one that recomputes less comes first (none, then selective, then full), then the one that needs less memory: the
unmodelled pointwise recomputation makes selective the slower of the two.

Predicted tokens/s = ``global_batch·s / step``; predicted MFU = model FLOPs per token × tokens/s / (num_gpus·P),
with the model FLOPs of :meth:`~lightning_4d.models.LlamaConfig.flops_per_token` (``6N + 12·L·h·s``, PaLM appendix
B), the figure the training task logs its MFU with, so that predicted and logged MFU compare.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Optional

from lightning_4d.config import (ACTIVATION_CHECKPOINTING, ZERO_STAGES, ParallelConfig, _check_positive_int,
                                  _divisors)
from lightning_4d.memory.fujii2024 import fujii2024_from_config
from lightning_4d.memory.hardware import GIB, GpuSpec
from lightning_4d.memory.model import MemoryEstimate, estimate_memory, model_state_bytes

__all__ = ["Candidate", "enumerate_layouts", "executed_flops_per_token", "plan", "predict_step_time",
           "suggest_layouts"]

EFFICIENCY = 0.5  # assumed fraction of the dense bf16 peak reached by the matmuls
#: how much each activation checkpointing mode recomputes, for ranking layouts of equal predicted step time
_RECOMPUTATION = {"none": 0, "selective": 1, "full": 2}
MAX_CONTEXT_PARALLEL = 32


@dataclass(frozen=True)
class Candidate:
    """One layout of a job with its memory estimate (bytes) and predicted step time (seconds)."""

    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    zero_stage: int
    activation_checkpointing: str
    memory: int
    fraction: float
    fits: bool
    step_time: float
    tokens_per_sec: float
    mfu: float

    def parallel_config(self) -> ParallelConfig:
        """The layout, with its micro-batch count when pp > 1 (the planner's schedule: the default 1F1B)."""
        return ParallelConfig(data_parallel_size=self.dp, tensor_parallel_size=self.tp,
                              pipeline_parallel_size=self.pp, context_parallel_size=self.cp,
                              zero_stage=self.zero_stage, activation_checkpointing=self.activation_checkpointing,
                              num_microbatches=self.num_microbatches if self.pp > 1 else None)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_gib"] = self.memory / GIB
        return out


def _is_valid(model_config: Any, pc: ParallelConfig, seq_length: int) -> bool:
    try:
        pc.validate_model(model_config)
        pc.validate_sequence(seq_length)
    except ValueError:
        return False
    return True


def enumerate_layouts(model_config: Any, num_gpus: int, gpus_per_node: int, seq_length: int, global_batch_size: int,
                      *, micro_batch_size: Optional[int] = None,
                      ) -> Iterator[tuple[ParallelConfig, int, int]]:
    """Every valid ``(parallel_config, micro_batch_size, num_microbatches)`` of a job (see the module docstring).

    Args:
        micro_batch_size: keep b fixed (the memory check's suggestions keep the user's batch shape).
    """
    for tp in _divisors(min(num_gpus, gpus_per_node)):
        if num_gpus % tp:
            continue
        for pp in _divisors(model_config.num_layers):
            if (num_gpus // tp) % pp:
                continue
            for cp in _divisors(num_gpus // (tp * pp)):
                if cp > MAX_CONTEXT_PARALLEL:
                    continue
                dp = num_gpus // (tp * pp * cp)
                if global_batch_size % dp:
                    continue
                base = ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                      context_parallel_size=cp, zero_stage=0)
                if not _is_valid(model_config, base, seq_length):
                    continue
                per_rank = global_batch_size // dp
                sizes = [micro_batch_size] if micro_batch_size else _divisors(per_rank)
                for b in sizes:
                    if per_rank % b:
                        continue
                    m = per_rank // b
                    if pp > 1 and m < pp:
                        continue
                    for zero in ZERO_STAGES:
                        if zero > 0 and dp * cp == 1:
                            continue  # nothing to shard over
                        for ac in ACTIVATION_CHECKPOINTING:
                            pc = ParallelConfig(data_parallel_size=dp, tensor_parallel_size=tp,
                                                pipeline_parallel_size=pp, context_parallel_size=cp, zero_stage=zero,
                                                activation_checkpointing=ac)
                            yield pc, b, m


def executed_flops_per_token(model_config: Any, seq_length: int, activation_checkpointing: str = "none") -> float:
    """FLOPs a training step executes per token, for the step-time prediction (module docstring): ``6N + 6·L·h·s``
    (causal attention computes half the scores of :meth:`~lightning_4d.models.LlamaConfig.flops_per_token`'s
    ``12·L·h·s``), × 4/3 under full activation checkpointing (the forward runs twice); unchanged under selective
    checkpointing (the matmuls and attention kernels are not run again; the pointwise ops it re-runs are not
    counted). Not the MFU numerator: that is ``flops_per_token``."""
    cfg = model_config
    flops = cfg.flops_per_token(seq_length) - 6 * cfg.num_layers * cfg.hidden_size * seq_length
    return flops * (4 / 3) if activation_checkpointing == "full" else flops


def predict_step_time(model_config: Any, pc: ParallelConfig, micro_batch_size: int, num_microbatches: int,
                      seq_length: int, gpu: GpuSpec, gpus_per_node: int, params_on_rank: int) -> float:
    """Predicted seconds per optimizer step (module docstring: the formula and its sources)."""
    cfg, b, m, s = model_config, micro_batch_size, num_microbatches, seq_length
    tp, pp, cp, dp = pc.tp, pc.pp, pc.cp, pc.dp
    h, L = cfg.hidden_size, cfg.num_layers
    flops_per_token = executed_flops_per_token(cfg, s, pc.activation_checkpointing)
    t_c = flops_per_token * b * s / (tp * pp * cp) / (EFFICIENCY * gpu.peak_flops)
    t_tp = 8 * (L / pp) * 2 * b * (s / cp) * h * (tp - 1) / tp / gpu.intra_node_bandwidth
    kv = cfg.num_kv_heads * cfg.head_dim // tp
    b_cp = gpu.intra_node_bandwidth if tp * cp <= gpus_per_node else gpu.inter_node_bandwidth
    t_cp = (L / pp) * 4 * 2 * b * s * kv * (cp - 1) / cp / b_cp
    ticks = m + pp - 1
    b_pp = gpu.intra_node_bandwidth if tp * cp * dp * pp <= gpus_per_node else gpu.inter_node_bandwidth
    t_pp = 2 * ticks * 2 * b * (s / cp) * h / tp / b_pp if pp > 1 else 0.0
    d = dp * cp
    k = {0: 2, 1: 3, 2: 2, 3: 3}[pc.zero_stage]
    b_dp = gpu.intra_node_bandwidth if tp * d <= gpus_per_node else gpu.inter_node_bandwidth
    t_dp = k * 4 * params_on_rank * (d - 1) / d / b_dp if d > 1 else 0.0
    return ticks * (t_c + t_tp + t_cp) + t_pp + t_dp


def _params_on_rank(model_config: Any, pc: ParallelConfig) -> int:
    """Unsharded-over-dp parameter elements of the first stage's rank (for the dp communication volume)."""
    return model_state_bytes(model_config, replace(pc, zero_stage=0), "32-true").parameters // 4


def plan(model_config: Any, num_gpus: int, gpus_per_node: int, gpu: GpuSpec, seq_length: int,
         global_batch_size: int, *, precision: str = "bf16-mixed", budget: float = 0.8, formula: str = "lightning_4d",
         micro_batch_size: Optional[int] = None, top: Optional[int] = 20,
         include_unfit: bool = False, estimate_kw: Optional[dict[str, Any]] = None) -> list[Candidate]:
    """The layouts of a job that fit ``budget · gpu.memory``, fastest predicted first.

    Args:
        model_config: a :class:`~lightning_4d.models.LlamaConfig`.
        num_gpus, gpus_per_node: the job's GPUs.
        gpu: the GPU kind (:data:`~lightning_4d.memory.hardware.GPU_PRESETS` or a custom :class:`GpuSpec`).
        seq_length: tokens per sample; global_batch_size: samples per optimizer step.
        precision: the training precision; budget: the fraction of ``gpu.memory`` a layout may use.
        formula: ``"lightning_4d"`` (:func:`~lightning_4d.memory.model.estimate_memory`) or ``"fujii2024"`` (the
            paper's estimator: ZeRO stage 1 is its distributed optimizer, stage 0 without it; stages 2-3 and
            checkpointing are not modelled by it, so those layouts are skipped).
        micro_batch_size: see :func:`enumerate_layouts`.
        top: how many to return (None: all).
        include_unfit: keep layouts that do not fit (ranked after those that do).
        estimate_kw: more keyword arguments of :func:`~lightning_4d.memory.model.estimate_memory` (``device_type``,
            ``overhead``, ``gpu_name``).

    Raises:
        ValueError: non-positive sizes, ``num_gpus`` not a multiple of ``gpus_per_node`` (when above it), an unknown
            formula, no valid layout at all (the message says why).
    """
    _check_positive_int("num_gpus", num_gpus)
    _check_positive_int("gpus_per_node", gpus_per_node)
    _check_positive_int("seq_length", seq_length)
    _check_positive_int("global_batch_size", global_batch_size)
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of gpus_per_node={gpus_per_node}.")
    if formula not in ("lightning_4d", "fujii2024"):
        raise ValueError(f"formula={formula!r} is not valid: expected 'lightning_4d' or 'fujii2024'.")
    limit = budget * gpu.memory
    out: list[Candidate] = []
    model_flops_per_token = model_config.flops_per_token(seq_length)
    for pc, b, m in enumerate_layouts(model_config, num_gpus, gpus_per_node, seq_length, global_batch_size,
                                      micro_batch_size=micro_batch_size):
        if formula == "fujii2024":
            if pc.zero_stage > 1 or pc.activation_checkpointing != "none":
                continue
            memory = fujii2024_from_config(model_config, tp=pc.tp, pp=pc.pp, dp=pc.dp, cp=pc.cp,
                                           seq_length=seq_length, micro_batch_size=b, num_microbatches=m,
                                           distributed_optimizer=pc.zero_stage == 1).total
        else:
            kw = {"gpu_name": gpu.name, **(estimate_kw or {})}
            memory = estimate_memory(model_config, pc, b, seq_length, precision, num_microbatches=m, **kw).total
        fits = memory <= limit
        if not fits and not include_unfit:
            continue
        step = predict_step_time(model_config, pc, b, m, seq_length, gpu, gpus_per_node, _params_on_rank(model_config, pc))
        tokens = global_batch_size * seq_length / step
        mfu = model_flops_per_token * tokens / (num_gpus * gpu.peak_flops)
        out.append(Candidate(pc.tp, pc.pp, pc.cp, pc.dp, b, m, pc.zero_stage, pc.activation_checkpointing,
                             int(memory), memory / gpu.memory, fits, step, tokens, mfu))
    out = _drop_dominated(out)
    out.sort(key=lambda c: (not c.fits, c.step_time, _RECOMPUTATION[c.activation_checkpointing], c.memory))
    return out[:top] if top else out


def _drop_dominated(candidates: list[Candidate]) -> list[Candidate]:
    """Drop a candidate when the same layout with less recomputation is predicted no slower and needs no more
    memory (e.g. selective checkpointing under tp keeps the matmuls' partial sums and can need more than none)."""
    by_layout: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        key = (c.tp, c.pp, c.cp, c.dp, c.micro_batch_size, c.num_microbatches, c.zero_stage)
        by_layout.setdefault(key, []).append(c)

    def dominated(c: Candidate, peers: list[Candidate]) -> bool:
        rank = _RECOMPUTATION[c.activation_checkpointing]
        return any(_RECOMPUTATION[o.activation_checkpointing] < rank and o.step_time <= c.step_time
                   and o.memory <= c.memory and (o.fits or not c.fits) for o in peers)

    return [c for peers in by_layout.values() for c in peers if not dominated(c, peers)]


def suggest_layouts(model_config: Any, world_size: int, micro_batch_size: int, seq_length: int, precision: str,
                    device_memory: int, budget: float, gpus_per_node: Optional[int] = None, count: int = 3,
                    **estimate_kw: Any) -> list[tuple[ParallelConfig, MemoryEstimate]]:
    """Up to ``count`` layouts of ``world_size`` GPUs that fit, with the same
    micro-batch size and sequence length, fastest predicted first (for :class:`MemoryBudgetExceeded`)."""
    from lightning_4d.memory.hardware import gpu_spec

    gpu = gpu_spec(device_memory)
    per_node = gpus_per_node or min(world_size, 8)
    found = []
    for cand in plan(model_config, world_size, per_node, gpu, seq_length, micro_batch_size * world_size,
                     precision=precision, budget=budget, micro_batch_size=micro_batch_size,
                     top=None, estimate_kw=estimate_kw):
        pc = cand.parallel_config()
        found.append((pc, estimate_memory(model_config, pc, micro_batch_size, seq_length, precision, **estimate_kw)))
        if len(found) == count:
            break
    return found
