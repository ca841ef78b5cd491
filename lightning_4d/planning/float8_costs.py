"""float8 training's terms in the memory model and the step-time model (``FourDStrategy(float8=...)``,
``lightning_4d/parallel/float8.py``: torchao's ``Float8Linear`` for the decoder layers' dense linears).

Memory: torchao's ``Float8Linear`` saves its input and weight in their high precision (measured on torch 2.13 CPU,
torchao 0.18, one ``small`` decoder layer at b=2 s=256 under bf16 autocast: 4,444,160 saved bytes with and without
float8), so the saved activations do not change without tp; under tp they do (:func:`float8_tensor_parallel_saved`:
the sequence-parallel inputs saved whole, torchao's float8 tensor-parallel styles casting before the linears). What
float8 adds is a transient in each converted linear's backward: the float8 copies of the output gradient, the input
and the weight, their transposes and the float32 scale arithmetic of the casts (:func:`float8_backward_transient`),
and one in its forward: the float32 arithmetic of the input's and the weight's casts (:func:`float8_forward_transient`),
which makes the peak at ZeRO 2/3, where the previous step's gradient shards are alive through the forward. The FSDP2
float8 all-gather at ZeRO 2/3 (tensorwise) gathers the converted weights in one byte instead of the compute dtype's
(:func:`float8_gathered_saving`: counted in the forward phase; the backward phases still count them in the compute
dtype, an over-estimate of ``c - 1`` bytes per converted weight element of the gathered units; measured at small
dp2 ZeRO 3, the forward phase makes the peak).

torchao's ``Float8Linear.forward`` casts its input to the autocast dtype only when ``torch.is_autocast_enabled()``
(CUDA's autocast) is true, which CPU autocast is not, so the CPU measurements behind these terms ran torchao's other
branch. Under ``FourDStrategy`` that changes no byte: ``bf16-mixed`` keeps bf16 weights (float32 masters in the
optimizer) and a bf16 residual stream, so the cast finds its input already bf16 and returns it; ``32-true`` and
``bf16-true`` run without autocast; ``16-mixed`` is refused. Measured with the CUDA branch emulated on CPU
(``is_autocast_enabled`` patched true: the saved tensors are set by torchao's Python, not by the float8 matmul), one
decoder layer, bf16 weights and input under bf16 autocast: the same saved bytes in both branches on six shapes (b, s, h,
f and the kv heads varied), while with float32 weights (Lightning's autocast over float32 weights, not a layout of ours)
the CUDA branch saves one ``[b, s, h]`` bf16 copy more per layer (``wq``, ``wk`` and ``wv`` each cast the norm's float32
output): ``tests/test_float8.py::test_float8_cuda_autocast_branch_saves_what_the_cpu_branch_saves``.

Step time: the converted linears' matmuls at :data:`FLOAT8_MATMUL_SPEEDUP` times their bf16 rate
(:func:`float8_matmul_factor`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig

__all__ = [
    "FLOAT8_BACKWARD_BYTES_PER_ELEMENT",
    "FLOAT8_CAST_BYTES_PER_ELEMENT",
    "FLOAT8_MATMUL_SPEEDUP",
    "FLOAT8_RUNS",
    "float8_backward_transient",
    "float8_forward_transient",
    "float8_gathered_saving",
    "float8_tensor_parallel_saved",
]

#: The published float8 runs the speedup is derived from: torchtitan commit 7a04053 (pytorch/torchtitan, Jan 2025,
#: "example of float8 with rowwise scaling"): Llama 3 8B on 8 H100, FSDP 8, s = 8192, local batch 1, selective
#: activation checkpointing (torchtitan's llama3_8b.toml), torch.compile, tokens/s per GPU: bf16 5,760; rowwise
#: 6,424; tensorwise with the float8 all-gather and precomputed scales 7,186. (recipe, tokens/s bf16, tokens/s float8)
FLOAT8_RUNS = (("tensorwise", 5760, 7186), ("rowwise", 5760, 6424))
#: The decoder layers' matmul seconds divided by this under each recipe (the float8 GEMM at up to twice the bf16
#: rate, H100 datasheet: 1,979 against 989 TFLOP/s dense, less the casts and scale reductions): the factor that
#: turns :mod:`lightning_4d.planning.step_time`'s compiled prediction of the bf16 run of :data:`FLOAT8_RUNS`
#: (H100-96GB, the layers' pointwise ops at the compiled factor as the runs used torch.compile; matmuls 50.1% of the
#: step) into the published gain (+24.8% tensorwise, +11.5% rowwise); tests/test_float8.py derives it again. Not
#: measured with FourDStrategy on a GPU yet (benchmarks/gpu_step_time.py's float8 rows).
FLOAT8_MATMUL_SPEEDUP = {"tensorwise": 1.66, "rowwise": 1.26}

#: Bytes a converted linear's backward holds beyond ``nn.Linear``'s, per element of its larger activation
#: (``T·max(in, out)``, T tokens): measured with LiveTensorBytes on torch 2.13 CPU, torchao 0.18, eight probes
#: (T, in, out) = (512, 256, 688), (512, 688, 256), (1024, 256, 688), (512, 512, 1376), bf16 and float32, both
#: recipes: 8.5-12.2 bytes per element; the largest, rounded up.
FLOAT8_BACKWARD_BYTES_PER_ELEMENT = 12.25


def float8_backward_transient(cfg: Any, pc: ParallelConfig, b: int, s: int) -> int:
    """Bytes of the largest converted linear's float8 backward transient (module docstring): ``12.25·T·max(in,
    out)`` with ``T = b·s/cp`` tokens (under tp every linear multiplies the whole sequence) and (in, out) each
    linear's on this rank (``h`` to ``a·d/t``, ``k·d/t``, ``f/t``, and back); 0 without ``float8`` (a dense model:
    float8 refuses Mixture-of-Experts models)."""
    if pc.float8 is None:
        return 0
    split = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size]
    tokens = b * (s // pc.cp)
    return int(FLOAT8_BACKWARD_BYTES_PER_ELEMENT * tokens * max(cfg.hidden_size, *(n // pc.tp for n in split)))


#: Bytes a float8 cast holds at once per element of the tensor it casts (torchao 0.18,
#: ``Float8TrainingTensor``'s ``_ToFloat8ConstrDynamic.forward`` and ``float8_utils.to_fp8_saturated``): ``x.to(float32)
#: * scale`` (4 bytes, the float32 copy of a bf16 ``x`` freed once multiplied), ``.clamp(-max, max)`` (4, beside the
#: product) and ``.to(float8)`` (1, beside both). Measured with LiveTensorBytes at the peak of ``lightning-4d measure``
#: (small b=2 s=256 dp2 ZeRO 3 bf16-mixed, torch 2.13 CPU): the last layer's ``w2`` input cast, a 1,409,024 B product,
#: a 1,409,024 B clamp and the 352,256 B float8 copy of ``[512, 688]`` alive at once, 9.0 bytes per element.
FLOAT8_CAST_BYTES_PER_ELEMENT = 9


def _converted_shapes(cfg: Any, pc: ParallelConfig) -> list[tuple[int, int]]:
    """(in, out) of each converted linear of a decoder layer on this rank: ``wq``, ``wk``/``wv``, ``w1``/``w3`` take
    ``h`` to ``a·d/t``, ``k·d/t``, ``f/t``; ``wo`` and ``w2`` take ``a·d/t`` and ``f/t`` back to ``h``."""
    h, t = cfg.hidden_size, pc.tp
    q, kv, f = cfg.num_heads * cfg.head_dim // t, cfg.num_kv_heads * cfg.head_dim // t, cfg.intermediate_size // t
    return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]


def float8_forward_transient(cfg: Any, pc: ParallelConfig, b: int, s: int) -> int:
    """Bytes of the largest converted linear's float8 forward transient, 0 without ``float8``: torchao's
    ``matmul_with_hp_or_float8_args.forward`` casts the input ``[T, in]`` (``T = b·s/cp`` tokens: under tp every
    linear multiplies the whole sequence) and then the weight ``[in, out]`` (this rank's piece) with
    :data:`FLOAT8_CAST_BYTES_PER_ELEMENT` bytes per element held by each cast: the larger of ``9·T·in`` and ``T·in
    + 9·in·out`` (the input's float8 copy beside the weight's cast). With the FSDP2 float8 all-gather (tensorwise at
    ZeRO 2/3, ``parallel/float8.py``) the weight arrives in float8 and is not cast: ``9·T·in``. The input and the
    weight themselves are saved for backward (counted in the activations and the gathered parameters)."""
    if pc.float8 is None:
        return 0
    tokens = b * (s // pc.cp)
    cast, gathered_in_float8 = FLOAT8_CAST_BYTES_PER_ELEMENT, pc.float8 == "tensorwise" and pc.zero_stage >= 2
    return max(
        max(cast * tokens * n_in, 0 if gathered_in_float8 else tokens * n_in + cast * n_in * n_out)
        for n_in, n_out in _converted_shapes(cfg, pc)
    )


def float8_gathered_saving(cfg: Any, pc: ParallelConfig, gather_bytes: int) -> int:
    """Bytes fewer one gathered decoder-layer unit holds with FSDP2's float8 all-gather (``"tensorwise"`` at ZeRO
    2/3: ``Float8LinearConfig.enable_fsdp_float8_all_gather``; torchao's
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` sends the converted weights as ``uint8`` and the
    unsharded weights are float8): ``gather_bytes - 1`` per converted weight element on this rank
    (:func:`_converted_shapes`), ``gather_bytes`` the bytes per element FSDP2 gathers otherwise (the compute dtype
    under mixed precision); 0 in any other layout. Measured at the
    peak of small dp2 ZeRO 3 bf16-mixed (LiveTensorBytes): the layer's all-gather output 726,016 B (its 724,992
    converted elements in one byte, the norms in two) instead of 1,451,008 B, its unsharded ``w1``/``w3``/``w2``
    176,128 B each instead of 352,256 B."""
    if pc.float8 != "tensorwise" or pc.zero_stage < 2:
        return 0
    return (gather_bytes - 1) * sum(n_in * n_out for n_in, n_out in _converted_shapes(cfg, pc))


def float8_tensor_parallel_saved(cfg: Any, pc: ParallelConfig, compute: int, b: int, s: int) -> int:
    """The bytes a decoder layer saves for backward under tp with float8 beyond the same layer without it (may be
    negative), per micro-batch of ``b`` sequences of ``s`` tokens on this cp rank, ``compute`` bytes per element of
    the compute dtype; 0 without tp or float8.

    Under tp the linears of the tp plan run through ``Float8Linear.forward``
    (``lightning_4d/features/tensor_parallel/runtime.py``), not the sequence-parallel projection that saves only the
    sequence shard ``[b, s/t, h]`` (compute dtype): under sp the attention's and the feed-forward's input is
    all-gathered before their linears, which save it whole, ``[b, s, h]``: in float8 (1 byte) with ``"tensorwise"``
    (torchao's ``PrepareFloat8ModuleInput`` casts before the all-gather), in the compute dtype with ``"rowwise"``.
    Without sp, ``"tensorwise"`` saves that input in float8 instead of the compute dtype (one cast shared by the
    projections). And ``"tensorwise"``'s ``Float8RowwiseParallel`` casts the input of ``wo`` and ``w2`` (``[b, s,
    a·d/t]``, ``[b, s, f/t]``) to float8 before the linear, which saves that copy: one byte more per element for ``wo``
    (attention's output stays saved by attention), ``compute - 1`` less for ``w2`` (nothing else saves the SwiGLU
    product). Measured with ``lightning-4d measure``
    (tests/test_float8.py::test_float8_memory_estimate_matches_measure)."""
    if pc.float8 is None or pc.tp == 1:
        return 0
    t, h = pc.tp, cfg.hidden_size
    inputs = 2 * b * s * h  # the attention's and the feed-forward's input, whole
    one_byte = pc.float8 == "tensorwise"
    if pc.sp:
        out = inputs * (1 if one_byte else compute) - inputs // t * compute
    else:
        out = -inputs * (compute - 1) if one_byte else 0
    if one_byte:
        out += b * s * (cfg.num_heads * cfg.head_dim // t) - (compute - 1) * b * s * (cfg.intermediate_size // t)
    return out
