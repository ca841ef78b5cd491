"""The order of parallelization of a ``lightning_4d`` Llama model, one short step per line (torchtitan's
``parallelize_llama`` shape): pipeline split, tensor + sequence parallel plans, context-parallel attention,
activation checkpointing, ``torch.compile`` per layer, ZeRO 2/3 (FSDP2). Materialization and the layout-independent
initialization follow in the strategy's ``setup``; ZeRO 0/1 act on gradients and the optimizer, not on the model
(:mod:`lightning_4d.parallel.zero`).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_4d.config import ParallelConfig
from lightning_4d.mesh import ParallelMesh
from lightning_4d.parallel._compat import attached_trainer
from lightning_4d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.parallel.context import apply_context_parallel
from lightning_4d.parallel.pipeline import reshard_after_forward, resolve_num_microbatches, split_llama
from lightning_4d.parallel.tensor import apply_tensor_parallel
from lightning_4d.parallel.zero import apply_fsdp, fsdp_reduce_dtype


def validate_against_module(config: ParallelConfig, module: Optional[nn.Module]) -> None:
    """Check a resolved layout against the LightningModule's ``model_config`` (a ``LlamaConfig``), its Trainer's
    DataModule (``seq_length``; the module's own ``validate_datamodule``) and Trainer (pp: the micro-batch count,
    :func:`~lightning_4d.parallel.pipeline.resolve_num_microbatches`). Pure Python: it runs in the strategy's
    ``setup_environment`` before any process group exists.

    Raises:
        ValueError: see :meth:`ParallelConfig.validate_model`, :meth:`ParallelConfig.validate_sequence` and
            :func:`~lightning_4d.parallel.pipeline.resolve_num_microbatches`.
    """
    from lightning_4d.adapters.hf_llama import find_hf_llamas, validate
    from lightning_4d.models.config import LlamaConfig

    model_config = getattr(module, "model_config", None)
    if isinstance(model_config, LlamaConfig):
        config.validate_model(model_config)
    elif module is not None and find_hf_llamas(module):
        for hf in find_hf_llamas(module):
            validate(hf, config)
    elif module is not None and max(config.tp, config.pp, config.cp) > 1 and not _splittable(module):
        raise ValueError(_cannot_split(config, module))
    trainer = attached_trainer(module)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    if datamodule is not None and hasattr(module, "validate_datamodule"):
        module.validate_datamodule(datamodule)
    seq_length = getattr(datamodule, "seq_length", None)
    if isinstance(seq_length, int):
        config.validate_sequence(seq_length)
    if config.pp > 1:
        resolve_num_microbatches(config, trainer, datamodule)


def _splittable(module: nn.Module) -> bool:
    """Whether tp / pp / cp can apply to ``module``: it holds (or will build: a ``model_config`` LlamaConfig) a
    ``lightning_4d`` Llama, or it overrides ``configure_model`` (where it may apply its own plans)."""
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_4d.adapters.hf_llama import find_hf_llamas
    from lightning_4d.models.llama import LlamaModel

    return any(isinstance(m, LlamaModel) for m in module.modules()) or bool(find_hf_llamas(module)) or (
        isinstance(module, L.LightningModule) and is_overridden("configure_model", module))


def _cannot_split(config: ParallelConfig, module: nn.Module) -> str:
    return (
        f"tensor_parallel_size={config.tp}, pipeline_parallel_size={config.pp}, context_parallel_size={config.cp}: "
        f"FourDStrategy cannot split {type(module).__name__}. tp, pp and cp apply to lightning_4d Llama models "
        "(CausalLMModule, or a LightningModule holding a lightning_4d.models.LlamaModel), to a Hugging Face "
        "transformers LlamaForCausalLM held by the LightningModule, and to modules that apply their own plans in "
        "configure_model() with self.device_mesh; any other module trains with data parallelism "
        "and ZeRO stages 0-3: set tensor_parallel_size=1, pipeline_parallel_size=1, context_parallel_size=1."
    )


def fsdp_block_modules(module: nn.Module, fsdp_blocks: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The submodules of ``module`` that become their own FSDP2 units at ZeRO 2/3, innermost first (FSDP2 wants
    children sharded before their parents): the instances of the classes named in ``fsdp_blocks`` (dotted paths
    such as ``"torch.nn.TransformerEncoderLayer"``, or bare class names matched against every submodule's class),
    else the children of every ``nn.ModuleList`` / ``nn.ModuleDict`` that hold parameters (the repeated blocks;
    Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` and torchtitan's per-layer units).

    Raises:
        ValueError: a dotted path that does not import, or classes no submodule is an instance of.
    """
    import importlib

    named = [(n, m) for n, m in module.named_modules() if n]
    if fsdp_blocks:
        classes, bare = [], set()
        for path in fsdp_blocks:
            if "." not in path:
                bare.add(path)
                continue
            mod, _, name = path.rpartition(".")
            try:
                classes.append(getattr(importlib.import_module(mod), name))
            except (ImportError, AttributeError) as e:
                raise ValueError(f"fsdp_blocks: {path!r} is not an importable class ({e}); give dotted class paths "
                                 "such as 'torch.nn.TransformerEncoderLayer' or bare class names") from e
        chosen = [(n, m) for n, m in named if isinstance(m, tuple(classes)) or type(m).__name__ in bare]
        if not chosen:
            found = sorted({type(m).__name__ for _, m in named})
            raise ValueError(f"fsdp_blocks={list(fsdp_blocks)}: no submodule of {type(module).__name__} is one of "
                             f"them; its submodule classes are {found}")
    else:
        stacks = {n for n, m in named if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
        chosen = [(n, m) for n, m in named if n.rpartition(".")[0] in stacks and any(True for _ in m.parameters())]
    chosen.sort(key=lambda nm: -nm[0].count("."))
    return [m for _, m in chosen]


def shard_any_module(module: nn.Module, mesh: ParallelMesh, config: ParallelConfig,
                     fsdp_blocks: Optional[Sequence[str]] = None) -> None:
    """ZeRO 2/3 for a LightningModule that is not a ``lightning_4d`` Llama and applied no plans itself: FSDP2 over
    ``dp_cp``, one unit per block (:func:`fsdp_block_modules`), then one root unit per top-level child that holds
    parameters outside the blocks (the children of a top-level ``nn.ModuleList`` / ``nn.ModuleDict``, which have no
    forward of their own, count as top-level). Parameters held by the LightningModule itself stay replicated, their gradients
    averaged in ZeRO-0 buckets (:func:`lightning_4d.parallel.zero.setup_zero`). Each unit's forward must run
    through the module's ``__call__`` (FSDP2 gathers its parameters in a forward pre-hook)."""
    blocks = fsdp_block_modules(module, fsdp_blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}

    def roots(parent: nn.Module) -> Iterator[nn.Module]:  # FSDP2 cannot shard a container that has no forward
        for child in parent.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                yield from roots(child)
            else:
                yield child

    for child in roots(module):
        below = {id(m) for m in child.modules()}
        inner = [b for b in blocks if b is not child and id(b) in below]
        if child in blocks or any(id(p) not in in_blocks for p in child.parameters()):
            apply_fsdp(child, mesh.dp_cp, config.zero_stage, blocks=inner,
                       reduce_dtype=fsdp_reduce_dtype(config.gradient_compression))


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
                       reduce_dtype=fsdp_reduce_dtype(config.gradient_compression))
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
    fsdp_blocks: Optional[Sequence[str]] = None,
) -> list[nn.Module]:
    """Parallelize (:func:`parallelize_llama`, unless already done), materialize on ``device`` and initialize
    (``LlamaModel.init_weights``, layout-independent, in float32) every ``lightning_4d`` Llama model inside ``module``
    (a LightningModule); returns them. ``param_dtype``: see :func:`parallelize_llama` (the parameters stay float32
    here: :func:`cast_to_compute_dtype` follows once the optimizer's master weights exist).

    Any other module (no ``LlamaModel`` inside, no plans of its own) gets data parallelism: nothing here at ZeRO 0/1
    (the strategy's gradient buckets and sharded optimizer act on it), FSDP2 units at ZeRO 2/3
    (:func:`shard_any_module`, blocks from ``fsdp_blocks``).

    Raises:
        ValueError: tp / pp / cp > 1 for a module that holds no ``LlamaModel`` and applied no plans.
        TypeError: pp > 1 and the module does not hold exactly one ``LlamaModel``.
    """
    from lightning_4d.adapters.hf_llama import find_hf_llamas, parallelize_hf_llama
    from lightning_4d.models.llama import LlamaModel

    llamas = [m for m in module.modules() if isinstance(m, LlamaModel)]
    if not llamas:
        hf_llamas = find_hf_llamas(module)
        for hf in hf_llamas:  # a Hugging Face transformers Llama (lightning_4d/adapters/hf_llama.py), once
            if not getattr(hf, "_lightning_4d_parallelized", False):
                parallelize_hf_llama(hf, mesh, config)
        if hf_llamas or is_parallelized(module):  # or the user's own plans (configure_model)
            return []
        if max(config.tp, config.pp, config.cp) > 1:
            raise ValueError(_cannot_split(config, module))
        if config.zero_stage >= 2:
            shard_any_module(module, mesh, config, fsdp_blocks)
        return []
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
