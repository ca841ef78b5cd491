"""float8 training's terms in the memory model and the step-time model (``FourDStrategy(float8=...)``,
``lightning_4d/parallel/float8.py``: torchao's ``Float8Linear`` for the decoder layers' dense linears).

Memory: torchao's ``Float8Linear`` saves its input and weight in their high precision (measured on torch 2.13 CPU,
torchao 0.18, one ``small`` decoder layer at b=2 s=256 under bf16 autocast: 4,444,160 saved bytes with and without
float8), so the saved activations do not change. What float8 adds is a transient in each converted linear's backward:
the float8 copies of the output gradient, the input and the weight, their transposes and the float32 scale
arithmetic of the casts (:func:`float8_backward_transient`). The FSDP2 float8 all-gather at ZeRO 2/3 (tensorwise)
gathers the converted weights in one byte instead of two; the model still counts them in the compute dtype (an
over-estimate of one byte per converted weight element of the gathered units).

Step time: the converted linears' matmuls at :data:`FLOAT8_MATMUL_SPEEDUP` times their bf16 rate
(:func:`float8_matmul_factor`).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_4d.config import ParallelConfig

__all__ = ["FLOAT8_BACKWARD_BYTES_PER_ELEMENT", "FLOAT8_MATMUL_SPEEDUP", "FLOAT8_RUNS", "float8_backward_transient"]

#: The published float8 runs the speedup is derived from: torchtitan commit 7a04053 (pytorch/torchtitan, Jan 2025,
#: "example of float8 with rowwise scaling"): Llama 3 8B on 8 H100, FSDP 8, s = 8192, local batch 1, selective
#: activation checkpointing (torchtitan's llama3_8b.toml), torch.compile, tokens/s per GPU: bf16 5,760; rowwise
#: 6,424; tensorwise with the float8 all-gather and precomputed scales 7,186. (recipe, tokens/s bf16, tokens/s float8)
FLOAT8_RUNS = (("tensorwise", 5760, 7186), ("rowwise", 5760, 6424))
#: The decoder layers' matmul seconds divided by this under each recipe (the float8 GEMM at up to twice the bf16
#: rate, H100 datasheet: 1,979 against 989 TFLOP/s dense, less the casts and scale reductions): the factor that
#: turns :mod:`lightning_4d.memory.step_time`'s compiled prediction of the bf16 run of :data:`FLOAT8_RUNS`
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
    out)`` with ``T = b·s/cp`` tokens and (in, out) each linear's of the decoder layer (``h`` to ``a·d``, ``k·d``,
    ``f``, and back); 0 without ``float8`` (a dense model: float8 refuses Mixture-of-Experts models)."""
    if pc.float8 is None:
        return 0
    dims = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size]
    tokens = b * (s // pc.cp)
    return int(FLOAT8_BACKWARD_BYTES_PER_ELEMENT * tokens * max(dims))
