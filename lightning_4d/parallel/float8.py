"""float8 training (``FourDStrategy(float8="tensorwise" | "rowwise")``) through torchao's ``Float8Linear``
(``torchao.float8``, the extra ``lightning-4d[float8]``; torchtitan's ``components/quantization/float8.py`` does the
same for its Llama).

What is converted: every ``nn.Linear`` of the decoder layers (the family's ``pipeline_layout(model).layers``): the
attention projections ``wq``/``wk``/``wv``/``wo`` and the SwiGLU ``w1``/``w3``/``w2``. Each forward casts its input
and weight to float8 e4m3 and multiplies them with ``torch._scaled_mm``; backward casts the output gradient to e5m2
and runs the two gradient matmuls in float8 too (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv
2209.05433). Left in the compute dtype, as torchtitan leaves them: the LM head (torchtitan skips ``output``: the
logits feed the loss directly, and under tp our vocabulary-parallel head multiplies its weight outside
``nn.Linear.forward``) and the embedding (a lookup, no matmul). Mixture-of-Experts models are refused for now (their
grouped MoE matmuls are not ``nn.Linear``: torchao's MoE float8 training is a separate API; their routers' few
outputs decide the routing), as are the transformers families (:attr:`ModelFamily.float8
<lightning_4d.families.base.ModelFamily.float8>`: untested).

Every dimension of a converted linear must be a multiple of 16 (``torch._scaled_mm``), each tp rank's shard of it
too, and so must the tokens each rank's linears take per micro-batch (the weight gradient's inner dimension): checked
before any process group (:meth:`lightning_4d.config.ParallelConfig.validate_model`,
:meth:`~lightning_4d.config.ParallelConfig.validate_float8_tokens`), as is a CUDA card without float8 tensor cores
(:func:`check_float8_device`).

Order (:func:`lightning_4d.parallel.parallelize.parallelize_model`): after the pipeline split, before tp,
activation checkpointing, ``torch.compile`` and FSDP2, as torchao documents for FSDP2 (``convert_to_float8_training``
then ``fully_shard``) and torchtitan does for tp (its model converters run before ``parallelize_llama``).

Under tp (:func:`lightning_4d.features.tensor_parallel.runtime.apply_tensor_parallel` with ``float8``) the tp plan
shards the converted linears with :func:`tensor_parallel_styles` (torchtitan's ``apply_tp`` choice: torchao's float8
styles for ``"tensorwise"``, DTensor's own for ``"rowwise"``) and every linear runs through ``Float8Linear.forward`` on
DTensors, whose tensorwise scales are those of the whole tensor (DTensor all-reduces the absolute maximum over tp),
as on one process. Under sequence parallelism the fused projection that saves only the sequence shard is not used
(it multiplies the weights outside ``Float8Linear``): the attention's and feed-forward's input is all-gathered
before their linears, in float8 with ``"tensorwise"`` (which gloo cannot carry: :data:`NO_FLOAT8_COLLECTIVES`), and
saved whole (``lightning_4d/planning/float8_costs.py``). The tp ring overlap's rings multiply the weights
outside ``Float8Linear`` too: refused with float8 (:func:`lightning_4d.features.tensor_parallel.check`).

At ZeRO 2/3 with ``"tensorwise"`` the converted weights are all-gathered in float8
(``Float8LinearConfig.enable_fsdp_float8_all_gather``: one byte per element instead of two) and their scales are
computed for the next step's all-gather right after each optimizer step, in one all-reduce of every weight's absolute
maximum (:func:`precompute_scales`, torchao's ``precompute_float8_dynamic_scale_for_fsdp``);
``"rowwise"`` scales per row, which FSDP2's float8 all-gather does not take (torchao refuses it), so its weights are
all-gathered in the compute dtype and cast after.

Saved for backward: torchao's ``Float8Linear`` saves its input and weight in their high precision and casts them
again in backward (measured on torch 2.13, torchao 0.18: the same saved bytes as ``nn.Linear``), so without tp
float8 leaves the saved activations of the memory model unchanged (``lightning_4d/planning/``, ``float8`` terms; under
tp see above).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from typing import Any, Optional

import torch.nn as nn

from lightning_4d.config import ParallelConfig

#: the lowest torchao this module is tested with (its ``Float8LinearConfig.from_recipe_name``,
#: ``convert_to_float8_training``, ``precompute_float8_dynamic_scale_for_fsdp``)
TORCHAO_MINIMUM = (0, 18)
#: Lightning precisions float8 trains under (Lightning's ModelParallelStrategy, our base, takes 32-true, bf16-mixed,
#: bf16-true and 16-true). Measured on torch 2.13 CPU, torchao 0.18, tiny-test b8 s64, 20 AdamW steps, tensorwise,
#: largest loss difference against plain Lightning's bf16-mixed run: 32-true 6.4e-4, bf16-mixed 4.6e-4, bf16-true
#: 1.8e-3 (bf16-true without float8: 2.0e-3); 16-true 0.41 (final loss 5.12 against 4.60; 16-true without float8:
#: 0.082, 4.88): float16's 5 exponent bits under float8's scaled casts lose the run, so 16-true is refused.
FLOAT8_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
#: process group backends that cannot move float8 tensors: measured on torch 2.13, gloo's all-gather (and
#: broadcast) of a ``float8_e4m3fn`` tensor raises "Invalid scalar type" (the same bytes viewed as ``uint8`` pass;
#: nccl moves float8 as bytes, FSDP2's float8 all-gather sends ``uint8`` on every backend). torchao's float8
#: tensor-parallel styles all-gather ``Float8TrainingTensor`` data as is under sequence parallelism
#: (:func:`tensor_parallel_styles`), so ``"tensorwise"`` with tp and sp is refused on these.
NO_FLOAT8_COLLECTIVES = ("gloo",)


def _torchao_version() -> Optional[tuple[int, ...]]:
    if importlib.util.find_spec("torchao") is None:
        return None
    version = importlib.metadata.version("torchao")
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def validate_float8(
    float8: Optional[str],
    precision: Optional[str] = None,
    config: Optional[ParallelConfig] = None,
    backend: Optional[str] = None,
) -> None:
    """Refuse ``float8`` when torchao >= 0.18 is not installed, under a precision it does not train with
    (``precision``: Lightning's flag; ``None``: not known yet), or ``"tensorwise"`` under tp with sequence parallelism
    (``config``) on a process group ``backend`` without float8 collectives (:data:`NO_FLOAT8_COLLECTIVES`; ``None``:
    not known yet), before any process group.

    Raises:
        ValueError: torchao missing or older, ``precision`` not in :data:`FLOAT8_PRECISIONS`, or the tensorwise
            float8 all-gather of sequence parallelism on gloo.
    """
    if float8 is None:
        return
    version = _torchao_version()
    if version is None or version < TORCHAO_MINIMUM:
        found = "not installed" if version is None else f"torchao {importlib.metadata.version('torchao')} installed"
        raise ValueError(
            f"float8={float8!r} needs torchao >= {'.'.join(map(str, TORCHAO_MINIMUM))} ({found}): "
            "pip install 'lightning-4d[float8]', or use float8=None."
        )
    if precision is not None and precision not in FLOAT8_PRECISIONS:
        raise ValueError(
            f"float8={float8!r} is not supported with precision={precision!r}: use one of "
            f"{list(FLOAT8_PRECISIONS)}, or float8=None."
        )
    sequence_parallel = config is not None and config.tp > 1 and config.sp
    if float8 == "tensorwise" and sequence_parallel and backend in NO_FLOAT8_COLLECTIVES:
        raise ValueError(
            f"float8='tensorwise' with tensor_parallel_size={config.tp} and sequence parallelism all-gathers the "
            f"sequence in float8, which the {backend!r} process group backend cannot move (it has no float8 dtype): "
            "use process_group_backend='nccl' (CUDA), or sequence_parallel=False, or float8='rowwise' (the "
            "sequence all-gathered in the compute dtype)."
        )


#: the lowest CUDA compute capability with float8 tensor cores (``torch._scaled_mm`` on CUDA: Ada, sm_89, and Hopper)
FLOAT8_MIN_CAPABILITY = (8, 9)


def check_float8_device(float8: Optional[str], device: Any) -> None:
    """Refuse ``float8`` on a CUDA ``device`` (a ``torch.device``) of compute capability below
    :data:`FLOAT8_MIN_CAPABILITY` (``torch.cuda.get_device_capability``), before any process group; a no-op
    without float8 or off CUDA (the CPU runs ``torch._scaled_mm`` emulated).

    Raises:
        ValueError: the card has no float8 tensor cores."""
    if float8 is None or getattr(device, "type", device) != "cuda":
        return
    import torch

    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < FLOAT8_MIN_CAPABILITY:
        raise ValueError(
            f"float8={float8!r} needs a CUDA device of compute capability >= "
            f"{'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} (float8 tensor cores: Ada, Hopper or newer); "
            f"{torch.cuda.get_device_name(device)} is {'.'.join(map(str, capability))}: use float8=None."
        )


def float8_config(config: ParallelConfig) -> Any:
    """torchao's ``Float8LinearConfig`` of ``config.float8``: the recipe's, with FSDP2's float8 all-gather at ZeRO
    2/3 for ``"tensorwise"`` (module docstring)."""
    from torchao.float8 import Float8LinearConfig

    recipe = Float8LinearConfig.from_recipe_name(config.float8)
    gather = config.float8 == "tensorwise" and config.zero_stage >= 2
    return dataclasses.replace(recipe, enable_fsdp_float8_all_gather=gather)


def converted_linears(layers: nn.Module) -> list[str]:
    """The names (relative to ``layers``, the decoder layers' container) of the ``nn.Linear`` modules
    :func:`apply_float8` converts: every one of them (module docstring)."""
    return [name for name, m in layers.named_modules() if isinstance(m, nn.Linear)]


def apply_float8(layers: nn.Module, config: ParallelConfig) -> int:
    """Swap the linears of :func:`converted_linears` in ``layers`` (the decoder layers' container) for torchao's
    ``Float8Linear`` (same parameters, same names) with :func:`float8_config`, in place; returns how many. A
    meta-device model works (the weights are reused)."""
    from torchao.float8 import convert_to_float8_training

    chosen = set(converted_linears(layers))
    convert_to_float8_training(layers, module_filter_fn=lambda _, fqn: fqn in chosen, config=float8_config(config))
    return len(chosen)


def tensor_parallel_styles(recipe: Optional[str]) -> tuple[type, type, type]:
    """The DTensor parallel styles ``(colwise, rowwise, prepare_input)`` of the tp plan's decoder-layer linears
    (:func:`lightning_4d.features.tensor_parallel.runtime.apply_tensor_parallel`) for the float8 ``recipe``, as
    torchtitan's ``apply_tp`` picks them: ``"tensorwise"``: torchao's ``Float8ColwiseParallel``,
    ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` (``torchao.float8.float8_tensor_parallel``: each input
    cast to float8 with one scale for the whole tensor, an all-reduce of its absolute maximum over tp, before it is
    redistributed, so the sequence-parallel all-gather moves one byte per element; the output gradient cast in backward
    the same way); ``"rowwise"`` and ``None``: DTensor's ``ColwiseParallel``, ``RowwiseParallel`` and
    ``PrepareModuleInput`` (torchao's styles assume one scale per tensor; the rowwise recipe all-gathers in the compute
    dtype and ``Float8Linear`` casts after, per row)."""
    if recipe == "tensorwise":
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def precompute_scales(models: list[nn.Module], config: ParallelConfig) -> None:
    """After an optimizer step at ZeRO 2/3 with ``"tensorwise"``: the float8 scales of every converted weight for the
    next all-gather, one all-reduce of their absolute maxima over the shards (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); without it each FSDP2 unit computes its own in the all-gather. A
    no-op in any other layout."""
    if config.float8 != "tensorwise" or config.zero_stage < 2:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in models:
        precompute_float8_dynamic_scale_for_fsdp(model)
