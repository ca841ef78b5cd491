"""Activations and activation checkpointing: what one micro-batch's forward saves for backward on one pp rank
(:func:`saved_bytes`, the formulas of :mod:`lightning_4d.planning.model`'s docstring, **Activations**), per layer
(:func:`layer_saved_parts`), under selective checkpointing (:func:`layer_selective_parts`,
:func:`layer_selective_recompute`) and the first backward ops of a recomputed layer (:func:`recompute_backward`).
An MoE layer's feed-forward: :func:`lightning_4d.features.moe.costs.saved_bytes`; context parallelism's gathered K/V:
:mod:`lightning_4d.features.context_parallel.costs`.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_4d.config import ParallelConfig
from lightning_4d.features.context_parallel import costs as cp_costs
from lightning_4d.features.moe import costs as moe_costs
from lightning_4d.planning.float8_costs import float8_tensor_parallel_saved
from lightning_4d.planning.params import as_held, rank_layers, rank_layout, weighted_params
from lightning_4d.planning.tensors import Dtypes

__all__ = [
    "layer_input_grad_only",
    "layer_saved",
    "layer_saved_parts",
    "layer_selective_parts",
    "layer_selective_recompute",
    "norm_input_saved",
    "recompute_backward",
    "saved_bytes",
    "saved_per_layer",
]


def norm_input_saved(r: int, b: int, s_sp: int, h: int) -> int:
    """Bytes an RMSNorm saves for backward: its input ``[b, s', h]`` as given (``r`` bytes per element, the residual
    stream's dtype) and the float32 reciprocal RMS ``[b, s', 1]`` (``models/llama.py``'s ``_RMSNormFunction``)."""
    return r * b * s_sp * h + 4 * b * s_sp


def layer_saved_parts(
    cfg: Any,
    dt: Dtypes,
    b: int,
    s: int,
    tp: int,
    sp: bool,
    moe: Optional[tuple[int, float]] = None,
) -> dict[str, int]:
    """Bytes one transformer layer saves for backward, per micro-batch (``s`` = this rank's sequence length), by
    part: ``norms`` (both norms' inputs and float32 reciprocal RMS), ``attn_in`` / ``ffn_in`` (the projections'
    inputs: the normalized tensor once, shared by wq/wk/wv and by w1/w3; under sp only this rank's sequence shard,
    gathered again in backward; without sp under ``16-mixed`` autocast's casts, one per linear), ``sdpa`` (q, k, v,
    output, float32 log-sum-exp) and ``swiglu`` (an MoE layer, ``moe`` = (ep, load imbalance): the MoE
    feed-forward's, :func:`lightning_4d.features.moe.costs.saved_bytes` over ep ranks at that load)."""
    moe_layer = moe is not None
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    s_sp = s // tp if sp else s
    c = dt.compute
    # an MoE layer under tp runs whole on the rank's s/t tokens (features/tensor_parallel/runtime.py's TokenParallel):
    # its input is the sequence shard (under sp as given, else a contiguous copy of it: the replicated input is not
    # kept)
    s_moe = s // tp
    return {
        "norms": 2 * norm_input_saved(dt.residual, b, s_sp, h),
        # under sp the projections save the sequence shard and gather it again in backward
        # (features/tensor_parallel/runtime.py)
        "attn_in": c * b * s_sp * h if sp else c * b * s * h * (3 if dt.autocast else 1),
        "ffn_in": c * b * (s_moe if moe_layer else s_sp) * h
        if sp or (moe_layer and tp > 1)
        else c * b * s * h * (2 if dt.autocast else 1),
        "sdpa": 2 * c * b * s * a * d + 2 * c * b * s * (a if dt.kv_repeated else k) * d + 4 * b * a * s,
        # an MoE layer (moe given): its feed-forward's saved set instead (moe_costs.saved_bytes)
        "swiglu": moe_costs.saved_bytes(cfg, dt, b, s_moe, *moe) if moe_layer else 4 * c * b * s * (f // tp),
    }


def layer_saved(*args: Any) -> int:
    """Bytes one transformer layer saves for backward, per micro-batch (the sum of :func:`layer_saved_parts`, whose
    positional arguments it takes)."""
    return sum(layer_saved_parts(*args).values())


def layer_input_grad_only(cfg: Any, dt: Dtypes, b: int, s: int, tp: int, sp: bool) -> int:
    """Bytes of one layer's saved set that only the input gradient uses (not the weight gradients): attention's q,
    k, v, output and float32 log-sum-exp (see :func:`lightning_4d.features.pipeline.costs.zbv_peak`; the RMSNorms' saved
    input and reciprocal RMS serve their weight gradient too, so the weight pass frees them)."""
    return layer_saved_parts(cfg, dt, b, s, tp, sp)["sdpa"]


def layer_selective_parts(
    cfg: Any, dt: Dtypes, b: int, s: int, tp: int, sp: bool, attention_tokens: int
) -> dict[str, int]:
    """Bytes one transformer layer keeps for backward under selective activation checkpointing, per micro-batch
    (``s`` = this rank's sequence length), by part: ``input`` (the layer's input, kept by the checkpoint),
    ``matmuls`` (the outputs of the matmuls: ``wq``/``wk``/``wv`` and ``w1``/``w3`` on their tp-local columns, and at
    tp = 1 ``wo``'s on all ``h``; under tp its partial sum is recomputed instead, and ``w2`` keeps nothing:
    :mod:`lightning_4d.parallel.activation_checkpoint`), ``attention`` (each attention
    kernel call's output and float32 log-sum-exp, for ``attention_tokens`` query tokens over all calls: ``s``
    without cp) and ``reductions`` (the reduced output of ``wo`` under tp: all-reduce, or reduce-scatter to ``s/t``
    tokens under sp)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    a, k = cfg.num_heads // tp, cfg.num_kv_heads // tp
    s_sp = s // tp if sp else s
    c = dt.compute
    return {
        "input": dt.residual * b * s_sp * h,
        # wo: its output at tp = 1; under tp its reduction instead (its partial sum recomputed); w2: nothing
        "matmuls": c * b * s * ((a + 2 * k) * d + 2 * (f // tp) + (h if tp == 1 else 0)),
        "attention": (c * a * d + 4 * a) * b * attention_tokens,
        "reductions": c * b * s_sp * h if tp > 1 else 0,
    }


def layer_selective_recompute(cfg: Any, dt: Dtypes, b: int, s: int, tp: int, sp: bool) -> int:
    """Bytes one layer's backward adds, transiently, to what the layers keep under selective activation
    checkpointing: its saved set without checkpointing (:func:`layer_saved_parts`) less what is taken from the kept
    outputs (v, the attention output and log-sum-exp, ``w1 x`` and ``w3 x``) and less the attention norm's input (the
    layer's input, kept by the checkpoint), i.e. the ffn norm's input, both norms' rsqrt, the matmul inputs
    (sequence-parallel all-gathers and autocast casts included), the rotated q and k, ``silu(w1 x)`` and the
    SwiGLU product; net of the kept outputs the recomputation consumes and frees (PyTorch's selective checkpoint
    pops each kept output when the recomputation takes it): ``wq``'s and ``wk``'s ``c·b·s·(a + k)·d/t`` (the graph
    saves their rotated copies) and ``wo``'s output ``c·b·s·h`` (tp = 1) or reduction ``c·b·s'·h`` (tp > 1), read only
    by the residual sum. Measured on CPU (``lightning-4d measure`` with ``LiveTensorBytes`` at the last layer's
    ``w2`` and SwiGLU backward, tiny-test b=4 s=256 ``32-true`` tp1 and tp2, b=2 ``bf16-mixed`` dp2): exactly these
    tensors alive; the ``recompute`` phase within 216 B of the measured moment (tp1: 9,384,960 B estimated, 9,385,172
    measured, the step's peak)."""
    parts = layer_saved_parts(cfg, dt, b, s, tp, sp)
    s_sp = s // tp if sp else s
    rotated_qk = dt.compute * b * s * (cfg.num_heads + cfg.num_kv_heads) // tp * cfg.head_dim
    recomputed = parts["norms"] + parts["attn_in"] + parts["ffn_in"] + rotated_qk + parts["swiglu"] // 2
    # the attention norm's input is the layer's input, kept by the checkpoint (counted there, not made again)
    recomputed -= dt.residual * b * s_sp * cfg.hidden_size
    # kept outputs the recomputation consumes and frees: wq's and wk's (the graph saves their rotated copies
    # instead) and wo's output (tp = 1) or reduction (tp > 1), read only by the residual sum
    kept = layer_selective_parts(cfg, dt, b, s, tp, sp, s)
    consumed_qk = dt.compute * b * s * (cfg.num_heads + cfg.num_kv_heads) // tp * cfg.head_dim
    consumed_wo = kept["reductions"] if tp > 1 else dt.compute * b * s * cfg.hidden_size
    return recomputed - consumed_qk - consumed_wo


def saved_per_layer(saved: dict[str, int], n_layers: int) -> float:
    """One decoder layer's saved bytes for one micro-batch on a pp rank holding ``n_layers`` layers (``saved``:
    :func:`saved_bytes`'s parts): its layers' saved tensors and the K/V beyond the local ones, averaged over them (what
    activation offload copies per layer, and the pipeline's per-stage sizes)."""
    return (saved["layers"] + saved["context_parallel_kv"]) / max(1, n_layers)


def saved_bytes(
    cfg: Any,
    pc: ParallelConfig,
    dt: Dtypes,
    b: int,
    seq_length: int,
    pp_rank: int,
    imbalance: float,
    document_masking: bool = False,
) -> dict[str, int]:
    """:func:`lightning_4d.planning.model.saved_activation_bytes` on a validated layout ``pc`` (its pipeline options
    applied) and the dtypes ``dt``: the bytes one micro-batch's forward saves on pp rank ``pp_rank``, by part; an
    MoE layer's feed-forward at load ``imbalance`` (:func:`lightning_4d.features.moe.costs.saved_bytes`); with
    ``document_masking`` its shared inputs in ``rope`` (:func:`document_masking_inputs`)."""
    tp, sp = pc.tp, pc.sp
    s = seq_length // pc.cp
    s_sp = s // tp if sp else s
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    cfg = as_held(cfg, pc)
    n_layers, first, last = rank_layout(cfg.num_layers, pc, pp_rank)
    indices = rank_layers(cfg.num_layers, pc, pp_rank)
    n_moe = moe_costs.count_moe_layers(cfg, indices)
    # float8 under tp: the projections' inputs saved as Float8Linear saves them (planning/float8_costs.py; not under
    # selective checkpointing's kept parts: not measured)
    dense_layer = layer_saved(cfg, dt, b, s, tp, sp) + float8_tensor_parallel_saved(cfg, pc, dt.compute, b, s)
    moe_layer = layer_saved(cfg, dt, b, s, tp, sp, (pc.ep, imbalance)) if n_moe else 0
    per_layer = max(dense_layer if n_layers > n_moe else 0, moe_layer)  # the largest layer's (one recompute)
    all_layers = (n_layers - n_moe) * dense_layer + n_moe * moe_layer
    full_ac = pc.activation_checkpointing == "full"
    out = {
        "layers": n_layers * dt.residual * b * s_sp * h if full_ac else all_layers,
        "embedding": 8 * b * s if first else 0,
        "rope": document_masking_inputs(cfg, pc, dt, b, s) if document_masking else 2 * 4 * s * (cfg.head_dim // 2),
        # the head's input: under sp only the sequence shard (gathered again in backward,
        # features/tensor_parallel/runtime.py)
        "head": (norm_input_saved(dt.residual, b, s_sp, h) + dt.compute * b * s_sp * h) if last else 0,
        "loss": (dt.compute * b * s * (vocab // tp) + 4 * b * s + 8 * b * s) if last else 0,
        "compute_weights": 0,
        "context_parallel_kv": 0,
        # a layer's whole saved set (its attention norm's input, the layer's input kept by the checkpoint, counted
        # again: r·b·s'·h of margin, which keeps ZeRO 3's recompute phase, short of the root's unsharded
        # gradients, within 3% under; measured: tests/test_memory_model.py)
        "recompute": per_layer if full_ac and n_layers else 0,
    }
    if pc.activation_checkpointing == "selective" and n_layers:
        kept = layer_selective_parts(cfg, dt, b, s, tp, sp, cp_costs.selective_attention_tokens(pc, s, seq_length))
        # MoE layers (not measured under selective checkpointing): counted as saving everything, an upper bound
        out["layers"] = (n_layers - n_moe) * sum(kept.values()) + n_moe * moe_layer
        out["recompute"] = layer_selective_recompute(cfg, dt, b, s, tp, sp)
    if dt.autocast:
        _add_autocast_copies(out, cfg, pc, indices, first, last)
    _add_context_parallel_kv(out, cp_costs.extra_saved_bytes(cfg, pc, dt, b, seq_length), pc, n_layers)
    return out


def _add_context_parallel_kv(out: dict[str, int], kv: int, pc: ParallelConfig, n_layers: int) -> None:
    """Add to ``out`` (:func:`saved_bytes`) ``kv``, what a layer saves under cp beyond the ring's local tensors (0 for
    the ring and without cp): allgather's gathered K/V of all s tokens in place of the local K/V, and a copy of
    the attention output (:func:`~lightning_4d.features.context_parallel.costs.gathered_kv_bytes`, measured with
    saved_tensors_hooks: exactly this much more than the ring), alltoall's second output copy and replicated kv
    heads; under checkpointing made again in a layer's recompute and dropped after its backward."""
    if not kv:
        return
    if pc.activation_checkpointing != "none":
        out["recompute"] += kv if n_layers else 0
    else:
        out["context_parallel_kv"] = n_layers * kv


def document_masking_inputs(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int) -> int:
    """Bytes every layer of a micro-batch shares with document masking (``s`` = this rank's sequence length): the
    float32 cos/sin of each sample's own positions ``[b, s, d/2]`` (they restart per document), and without cp the
    additive mask ``[b, 1, s, s]`` in the compute dtype that every layer's attention saves (the model builds it once
    per forward, ``LlamaModel.document_inputs``), under cp the document ids of the whole sequence ``[b, s·cp]``
    (int64), which every layer's cp attention saves (it masks block by block, nothing kept)."""
    rope = 2 * 4 * b * s * (cfg.head_dim // 2)
    return rope + (dt.compute * b * s * s if pc.cp == 1 else 8 * b * s * pc.cp)


def _add_autocast_copies(
    out: dict[str, int], cfg: Any, pc: ParallelConfig, indices: list[int], first: bool, last: bool
) -> None:
    """Add to ``out`` (:func:`saved_bytes`) autocast's bfloat16 weight copies (``16-mixed``): every local matrix but
    the embedding, 2 bytes per element; a checkpointed layer's are made again (and dropped) in its recompute."""
    tp, h, vocab = pc.tp, cfg.hidden_size, cfg.padded_vocab_size
    n_layers = len(indices)
    recomputed = pc.activation_checkpointing != "none"
    cast = [
        (p, n) for p, n in weighted_params(cfg, tp, indices, first, last, pc.ep) if p.matrix and p.role != "embedding"
    ]
    in_layers = sum(p.numel * n for p, n in cast if p.unit != "root")
    out["compute_weights"] = 2 * (sum(p.numel * n for p, n in cast) - (in_layers if recomputed else 0))
    if last and cfg.tie_word_embeddings and first:  # the tied head is cast too
        out["compute_weights"] += 2 * (vocab // tp) * h
    if recomputed and n_layers:
        out["recompute"] += 2 * in_layers // n_layers


def kept_layer_backward(cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int) -> int:
    """Bytes the first backward ops of a layer whose saved set is on the device make beside it (``T = b·s/cp``
    tokens): the gradient of the layer's output (residual dtype, ``[T, h]``, ``/t`` under sp) and ``w2``'s input
    gradient (``c·T·f/t``); the saved tensors each later op reads are freed as it runs. Measured on CPU
    (``lightning-4d measure``, tiny-test b=2 s=256 ``32-true``, 1 of 2 layers offloaded: the peak at the kept
    layer's ``w2`` backward, with the offloaded layer prefetched beside it): 1,836 B under this."""
    tokens = b * (s // pc.cp)
    output_grad = dt.residual * tokens * cfg.hidden_size // (pc.tp if pc.sp else 1)
    return output_grad + dt.compute * tokens * cfg.intermediate_size // pc.tp


def recompute_backward(
    cfg: Any, pc: ParallelConfig, dt: Dtypes, b: int, s: int, offloaded: bool = False, gradients_kept: bool = False
) -> int:
    """Bytes the first backward ops of a checkpointed layer make beside its recomputed set
    (:class:`lightning_4d.planning.buffers.Buffers`'s ``recompute_backward``), and of an offloaded layer
    (``offloaded``: a stage offloaded whole) beside the saved tensors it brings back. Checkpointed (``T = b·s/cp``
    tokens, ``c`` the
    compute dtype's bytes): the gradient of the layer's output (residual dtype, ``[T, h]``, ``/t`` under sp) and
    ``w2``'s input gradient (``c·T·f/t``), + the larger of the rest of ``w2``'s backward (its weight gradient
    ``c·h·f/t``, and under sp its output gradient all-gathered, ``c·T·h``) and the SwiGLU product's backward after it
    (the product, counted in the recomputed set, freed; its two input gradients made: one ``c·T·f/t`` more). Measured on
    CPU (``lightning-4d measure``, ``LiveTensorBytes``, tiny-test b=4 s=256 ``32-true``): tp2 (sp) full and selective
    peak at the last layer's ``w2`` backward with the output gradient ``[4, 128, 64]``, the gathered one ``[4, 256,
    64]``, the weight gradient ``[64, 64]`` and the input gradient ``[1024, 64]`` alive; tp1 and ``bf16-mixed`` dp2 at
    the SwiGLU product's. ``gradients_kept``: no gradient bucket takes ``w2``'s weight gradient in (one rank,
    :func:`lightning_4d.partition.gradient_buckets_needed`): it stays beside the SwiGLU product's backward (measured,
    tiny-test one rank ``32-true``, selective and offloaded whole: the peak there, ``[64, 128]`` more)."""
    if pc.activation_checkpointing == "none" and not offloaded:
        return 0
    tokens = b * (s // pc.cp)
    output_grad = dt.residual * tokens * cfg.hidden_size // (pc.tp if pc.sp else 1)
    if not offloaded:
        ffn = dt.compute * tokens * cfg.intermediate_size // pc.tp  # one [T, f/t] tensor
        # w2's backward: its output gradient all-gathered under sp ([T, h]) and its weight gradient ([h, f/t]) beside
        # its input gradient; the SwiGLU product's backward after it: the product freed, its two input gradients
        # beside the product's gradient (one [T, f/t] more)
        w2 = (dt.compute * tokens * cfg.hidden_size if pc.sp and pc.tp > 1 else 0) + (
            dt.compute * cfg.hidden_size * cfg.intermediate_size // pc.tp
        )
        weight_grad = dt.param * cfg.hidden_size * cfg.intermediate_size // pc.tp if gradients_kept else 0  # .grad
        return output_grad + ffn + max(w2, ffn + weight_grad)
    # offloaded: the SwiGLU product's backward, the product's gradient and the two it makes (``[T, f/t]`` each); under
    # sp the w1/w3 backward after it also holds the input gathered again and the sum of the two partial input
    # gradients (``[T, h]`` each; measured: tiny-test tp2 b=2 s=256 bf16-mixed, both layers offloaded, the peak at
    # ``features/tensor_parallel/runtime.py``'s ``sum(g @ w)``)
    gathered = 2 * dt.compute * tokens * cfg.hidden_size if pc.sp else 0
    weight_grad = dt.param * cfg.hidden_size * cfg.intermediate_size // pc.tp if gradients_kept else 0  # w2's .grad
    return output_grad + 3 * dt.compute * tokens * cfg.intermediate_size // pc.tp + gathered + weight_grad
