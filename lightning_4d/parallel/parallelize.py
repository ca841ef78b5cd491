"""The order of parallelization of a ``lightning_4d`` Llama model, one short step per line (torchtitan's
``parallelize_llama`` shape): pipeline split, tensor + sequence parallel plans, context-parallel attention,
activation checkpointing, ``torch.compile`` per layer, ZeRO 2/3 (FSDP2). Materialization and the layout-independent
initialization follow in the strategy's ``setup``; ZeRO 0/1 act on gradients and the optimizer, not on the model
(:mod:`lightning_4d.parallel.zero`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_4d.config import ParallelConfig
from lightning_4d.mesh import ParallelMesh
from lightning_4d.parallel._compat import attached_trainer
from lightning_4d.parallel.checkpointing import apply_activation_checkpointing
from lightning_4d.parallel.context import apply_context_parallel
from lightning_4d.parallel.pipeline import reshard_after_forward, resolve_num_microbatches, split_llama
from lightning_4d.parallel.tensor import apply_tensor_parallel
from lightning_4d.parallel.zero import apply_fsdp


def validate_against_module(config: ParallelConfig, module: Optional[nn.Module]) -> None:
    """Check a resolved layout against the LightningModule's ``model_config`` (a ``LlamaConfig``), its Trainer's
    DataModule (``seq_length``; the module's own ``validate_datamodule``) and Trainer (pp: the micro-batch count,
    :func:`~lightning_4d.parallel.pipeline.resolve_num_microbatches`). Pure Python: it runs in the strategy's
    ``setup_environment`` before any process group exists.

    Raises:
        ValueError: see :meth:`ParallelConfig.validate_model`, :meth:`ParallelConfig.validate_sequence` and
            :func:`~lightning_4d.parallel.pipeline.resolve_num_microbatches`.
    """
    from lightning_4d.models.config import LlamaConfig

    model_config = getattr(module, "model_config", None)
    if isinstance(model_config, LlamaConfig):
        config.validate_model(model_config)
    trainer = attached_trainer(module)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    if datamodule is not None and hasattr(module, "validate_datamodule"):
        module.validate_datamodule(datamodule)
    seq_length = getattr(datamodule, "seq_length", None)
    if isinstance(seq_length, int):
        config.validate_sequence(seq_length)
    if config.pp > 1:
        resolve_num_microbatches(config, trainer, datamodule)


def parallelize_llama(
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    compile: bool = False,
    param_dtype: Optional[torch.dtype] = None,
) -> Optional[list[tuple[int, nn.Module]]]:
    """Apply the pipeline split, tp/sp, context-parallel attention, activation checkpointing, compile and ZeRO 2/3 to
    a meta-device ``LlamaModel``, in that order.

    With pp > 1 the model is pruned to this rank's stages and every step after the split runs on each stage chunk
    (:func:`~lightning_4d.parallel.pipeline.split_llama`); the chunks are returned (``None`` without pp).
    ``param_dtype``: the compute dtype of mixed precision with master weights (ZeRO 2/3: FSDP2's
    ``MixedPrecisionPolicy``, :func:`~lightning_4d.parallel.zero.apply_fsdp`).

    Raises:
        ValueError: the model cannot be split by the layout (see :meth:`ParallelConfig.validate_model`).
    """
    chunks = split_llama(model, config, mesh.pp.get_local_rank()) if config.pp > 1 else None
    for part in [c for _, c in chunks] if chunks is not None else [model]:
        apply_tensor_parallel(part, mesh.tp, sequence_parallel=config.sp)
        apply_context_parallel(part, mesh.cp, config.context_parallel_method)
        apply_activation_checkpointing(part, config.activation_checkpointing)
        if compile:
            for block in part.layers.values():
                block.compile()
        if config.zero_stage >= 2:
            apply_fsdp(part, mesh.dp_cp, config.zero_stage, reshard_after_forward=reshard_after_forward(config),
                       param_dtype=param_dtype,
                       reduce_dtype=torch.bfloat16 if config.gradient_compression == "bf16" else None)
        if part is not model:
            for name, block in part.layers.items():  # the union holds the same (wrapped) blocks as its chunks
                model.layers[name] = block
    if chunks is not None:
        model.context_parallel = chunks[0][1].context_parallel
    model._lightning_4d_parallelized = True  # type: ignore[assignment]
    return chunks


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` was already parallelized (by :func:`parallelize_llama`, or by plans the user applied:
    FSDP2 modules or DTensor parameters inside it)."""
    from torch.distributed.fsdp import FSDPModule

    if getattr(module, "_lightning_4d_parallelized", False):
        return True
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def prepare_llamas(
    module: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    device: torch.device,
    compile: bool = False,
    param_dtype: Optional[torch.dtype] = None,
) -> list[nn.Module]:
    """Parallelize (:func:`parallelize_llama`, unless already done), materialize on ``device`` and initialize
    (``LlamaModel.init_weights``, layout-independent, in float32) every ``lightning_4d`` Llama model inside ``module``
    (a LightningModule); returns them. ``param_dtype``: see :func:`parallelize_llama` (the parameters stay float32
    here: :func:`cast_to_compute_dtype` follows once the optimizer's master weights exist).

    Raises:
        TypeError: ``module`` holds no ``LlamaModel`` and does not override ``configure_model`` (nothing the strategy
            could lay out), or pp > 1 and it does not hold exactly one ``LlamaModel``.
    """
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_4d.models.llama import LlamaModel

    llamas = [m for m in module.modules() if isinstance(m, LlamaModel)]
    if not llamas and not is_overridden("configure_model", module):
        raise TypeError(
            "FourDStrategy parallelizes lightning_4d Llama models automatically; for another model, "
            "override `configure_model()` in your LightningModule and apply plans there with `self.device_mesh`."
        )
    if config.pp > 1 and len(llamas) != 1:
        raise TypeError(
            f"pipeline_parallel_size={config.pp} needs exactly one lightning_4d LlamaModel in the "
            f"LightningModule (found {len(llamas)})."
        )
    for llama in llamas:
        if not is_parallelized(llama):
            parallelize_llama(llama, mesh, config, compile=compile, param_dtype=param_dtype)
        if any(p.is_meta for p in llama.parameters()):
            llama.to_empty(device=device)
            with torch.no_grad():
                llama.init_weights()
    return llamas


def cast_to_compute_dtype(llamas: list[nn.Module], dtype: Optional[torch.dtype]) -> None:
    """Cast the parameters FSDP2 does not own (ZeRO 0/1) of ``llamas`` to ``dtype`` in place (the same ``Parameter``
    objects, so optimizers keep them: ``Module.to`` sets ``.data`` of a plain parameter and swaps a DTensor one's
    tensor with ``torch.utils.swap_tensors``, which loses gradient hooks registered before); FSDP2 units (ZeRO 2/3)
    cast per unit at all-gather instead. ``None``: no-op.

    Args:
        llamas: the ``LlamaModel`` instances of the LightningModule (:func:`prepare_llamas`).
        dtype: the compute dtype (``torch.bfloat16`` under ``bf16-mixed``) or ``None``.

    Mixed precision with master weights (:mod:`lightning_4d.parallel.zero`): called after the optimizers' master
    weights were copied from the float32 parameters.
    """
    from torch.distributed.fsdp import FSDPModule

    if dtype is None:
        return
    for llama in llamas:
        if not any(isinstance(m, FSDPModule) for m in llama.modules()):
            llama.to(dtype)
