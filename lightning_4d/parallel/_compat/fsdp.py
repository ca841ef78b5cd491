"""FSDP2 and activation checkpointing: ``fully_shard``'s ``shard_placement_fn``, torch's checkpoint wrapper and the
private ops selective activation checkpointing saves."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401  (re-exported)
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)


def checkpointed_module(layer: nn.Module) -> nn.Module:
    """The module a :func:`checkpoint_wrapper` wraps (``CheckpointWrapper._checkpoint_wrapped_module``), or ``layer``
    itself when it is not wrapped."""
    return layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer


def _fully_shard_takes(name: str) -> bool:
    import inspect

    from torch.distributed.fsdp import fully_shard

    return name in inspect.signature(fully_shard).parameters


#: whether FSDP2's ``fully_shard`` takes ``shard_placement_fn`` (a public argument; ZeRO 2/3 shard MoE's stacked weights
#: on dim 1 through it, ``parallel/fsdp.py``): torch 2.6 added it, ``tests/test_compat.py`` checks it on the installed
#: torch
FULLY_SHARD_PLACEMENT_FN = _fully_shard_takes("shard_placement_fn")


#: the private ops whose outputs selective activation checkpointing saves (``parallel/activation_checkpoint.py``), by
#: qualified name without the overload (``OpOverload.name()`` up to the first dot): ATen's fused attention kernels
#: (those ``scaled_dot_product_attention`` dispatches to on CPU and CUDA, and the flash kernels context parallelism
#: calls), the MoE layers' grouped GEMM on CUDA (``torch._grouped_mm``, saved as the MoE loop's ``aten::mm``
#: is on CPU, so that the memory model's selective set holds on both), flash-attn 2's forward (a torch custom op
#: since flash-attn 2.7) and the functional collectives with which DTensor tensor parallelism reduces a row-parallel
#: matmul's partial sums (``all_reduce``; ``reduce_scatter_tensor`` under sequence parallelism).
#: ``tests/test_compat.py`` checks that each resolves to an op (flash-attn's when flash-attn is installed).
SAC_SAVED_PRIVATE_OPS = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_grouped_mm",
    "flash_attn::_flash_attn_forward",
    "_c10d_functional::all_reduce",
    "_c10d_functional::reduce_scatter_tensor",
)
