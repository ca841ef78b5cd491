"""The order of parallelization of a model of any registered family (:mod:`lightning_4d.families`), one short step
per line (torchtitan's ``parallelize_llama`` shape): pipeline split, float8 linears
(:mod:`lightning_4d.parallel.float8`; torchtitan converts before parallelizing too), tensor + sequence parallel
plans, context-parallel attention, the MoE component's step (:func:`lightning_4d.features.moe.runtime.apply`),
activation checkpointing, ``torch.compile`` per layer, ZeRO 2/3 (FSDP2).
Materialization (the family's; for our Llama the layout-independent initialization) follows in
:func:`prepare_models`; ZeRO 0/1 act on gradients and the optimizer, not on the model
(:mod:`lightning_4d.parallel.sharded_optimizer`).
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_4d.config import ParallelConfig, check_compile
from lightning_4d.contract import TrainingInputs
from lightning_4d.families.base import ModelFamily, find_submodel, layer_items
from lightning_4d.families.registry import find_models
from lightning_4d.features.moe import runtime as moe
from lightning_4d.features.pipeline.runtime import (
    reshard_after_forward,
    resolve_num_microbatches,
    split_model,
    sync_chunk_layers,
)
from lightning_4d.features.tensor_parallel import runtime as tensor_parallel
from lightning_4d.mesh import ParallelMesh
from lightning_4d.parallel._compat.lightning import attached_trainer
from lightning_4d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.parallel.compile import compile_layers
from lightning_4d.parallel.float8 import apply_float8
from lightning_4d.parallel.fsdp import FSDPPolicy, apply_fsdp, fsdp_reduce_dtype
from lightning_4d.parallel.offload import OffloadStats, apply_activation_offload, offloaded_layers

#: the models :func:`parallelize_model` has laid out (a registry, so that nothing is written onto the user's module;
#: weak, so that it keeps no model alive)
_PARALLELIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def validate_against_module(
    config: ParallelConfig, module: Optional[nn.Module], inputs: Optional[TrainingInputs] = None
) -> None:
    """Check a resolved layout against what the task and the data declare
    (:class:`~lightning_4d.contract.TrainingInputs`: the module's ``model_config``, the DataModule's ``seq_length``,
    the micro-batch count,
    :func:`~lightning_4d.features.pipeline.runtime.resolve_num_microbatches`) and against the models ``module`` holds
    (their families' ``validate``). Pure Python: it runs in the strategy's ``setup_environment`` before any process
    group exists; ``inputs`` defaults to what ``module`` and its Trainer declare (``TrainingInputs.of``). Changes
    nothing.

    Raises:
        ValueError: see :meth:`ParallelConfig.validate_model`, :meth:`ParallelConfig.validate_sequence`,
            :meth:`ParallelConfig.validate_float8_tokens` (with the DataModule's micro-batch size) and
            :func:`~lightning_4d.features.pipeline.runtime.resolve_num_microbatches`; ``float8`` for a family that does
            not take it (:attr:`ModelFamily.float8`) or a module that holds no registered model.
    """
    inputs = TrainingInputs.of(module, attached_trainer(module)) if inputs is None else inputs
    model_config = inputs.model_config
    models = find_models(module) if module is not None else []
    if model_config is not None:
        config.validate_model(model_config)
    for _, family, model in models:
        family.validate(model, config)
        if config.float8 is not None and not family.float8:
            raise ValueError(
                f"float8={config.float8!r} is not supported for a {family.name} yet (tested with lightning_4d Llama "
                "models only): use float8=None."
            )
    if config.float8 is not None and module is not None and not models and model_config is None:
        raise ValueError(
            f"float8={config.float8!r} converts the decoder layers of a lightning_4d Llama model; "
            f"{type(module).__name__} holds none: use float8=None (or torchao's convert_to_float8_training in your "
            "own configure_model)."
        )
    splittable = model_config is not None or inputs.applies_own_plans
    if module is not None and not models and max(config.tp, config.pp, config.cp) > 1 and not splittable:
        raise ValueError(_cannot_split(config, module))
    seq_length = inputs.seq_length
    if seq_length is not None:
        config.validate_sequence(seq_length)
        moe.validate_sequence(config, model_config, seq_length)
        if inputs.micro_batch_size is not None:
            config.validate_float8_tokens(seq_length, inputs.micro_batch_size)
    if config.pp > 1:
        resolve_num_microbatches(config, inputs)


def _cannot_split(config: ParallelConfig, module: nn.Module) -> str:
    return (
        f"tensor_parallel_size={config.tp}, pipeline_parallel_size={config.pp}, context_parallel_size={config.cp}: "
        f"FourDStrategy cannot split {type(module).__name__}. tp, pp and cp apply to lightning_4d Llama models "
        "(CausalLMModule, or a LightningModule holding a lightning_4d.models.LlamaModel), to a Hugging Face "
        "transformers LlamaForCausalLM held by the LightningModule, and to modules that apply their own plans in "
        "configure_model() with self.device_mesh; any other module trains with data parallelism "
        "and ZeRO stages 0-3: set tensor_parallel_size=1, pipeline_parallel_size=1, context_parallel_size=1."
    )


def validate_compile(compile: bool, activation_checkpointing: str = "none") -> None:
    """Refuse ``compile=True`` with selective checkpointing when the strategy is built: the layout's own rule,
    :func:`lightning_4d.config.check_compile` (its docstring says why).

    Raises:
        ValueError: ``compile`` not a bool, or True with ``activation_checkpointing="selective"``.
    """
    check_compile(compile, activation_checkpointing)


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
                raise ValueError(
                    f"fsdp_blocks: {path!r} is not an importable class ({e}); give dotted class paths "
                    "such as 'torch.nn.TransformerEncoderLayer' or bare class names"
                ) from e
        chosen = [(n, m) for n, m in named if isinstance(m, tuple(classes)) or type(m).__name__ in bare]
        if not chosen:
            found = sorted({type(m).__name__ for _, m in named})
            raise ValueError(
                f"fsdp_blocks={list(fsdp_blocks)}: no submodule of {type(module).__name__} is one of "
                f"them; its submodule classes are {found}"
            )
    else:
        stacks = {n for n, m in named if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
        chosen = [(n, m) for n, m in named if n.rpartition(".")[0] in stacks and any(True for _ in m.parameters())]
    chosen.sort(key=lambda nm: -nm[0].count("."))
    return [m for _, m in chosen]


def shard_any_module(
    module: nn.Module, mesh: ParallelMesh, config: ParallelConfig, fsdp_blocks: Optional[Sequence[str]] = None
) -> None:
    """ZeRO 2/3 for a LightningModule that is not a ``lightning_4d`` Llama and applied no plans itself: FSDP2 over
    ``dp_cp``, one unit per block (:func:`fsdp_block_modules`), then one root unit per top-level child that holds
    parameters outside the blocks (the children of a top-level ``nn.ModuleList`` / ``nn.ModuleDict``, which have no
    forward of their own, count as top-level). Parameters held by the LightningModule itself stay replicated, their
    gradients
    averaged in ZeRO-0 buckets (:func:`lightning_4d.parallel.sharded_optimizer.setup_zero`). Each unit's forward must
    run through the module's ``__call__`` (FSDP2 gathers its parameters in a forward pre-hook)."""
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
            apply_fsdp(
                child,
                mesh.zero,
                config.zero_stage,
                blocks=inner,
                policy=FSDPPolicy(
                    reduce_dtype=fsdp_reduce_dtype(config.gradient_compression), offload=config.optimizer_offload
                ),
            )


def parallelize_model(
    family: ModelFamily,
    model: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    compile: bool = False,
    param_dtype: Optional[torch.dtype] = None,
    offload_stats: Optional[OffloadStats] = None,
) -> Optional[list[tuple[int, nn.Module]]]:
    """Apply the pipeline split, float8 linears (``config.float8``), tp/sp, context-parallel attention, the MoE step
    (``moe.apply``), activation checkpointing, compile and ZeRO 2/3 to ``model`` (a meta-device model of
    ``family``; real weights work too, each rank keeping its shards), in that order, the same steps for every family
    (:class:`~lightning_4d.families.base.ModelFamily` says where the parts are and what its plans are).

    With pp > 1 the model is pruned to this rank's stages (:func:`~lightning_4d.features.pipeline.runtime.split_model`),
    tp, cp, checkpointing and compile act on the pruned model, and each stage chunk becomes its own FSDP2 root; the
    chunks are returned (``None`` without pp). ``param_dtype``: the compute dtype of mixed precision with master
    weights (ZeRO 2/3: FSDP2's ``MixedPrecisionPolicy``, :func:`~lightning_4d.parallel.fsdp.apply_fsdp`), for a
    family that keeps them.

    Raises:
        ValueError: the model cannot be split by the layout (:meth:`ModelFamily.validate`), or ``compile`` for a
            family whose layers do not take it.
    """
    family.validate(model, config)
    if compile and not family.compile:
        raise ValueError(f"compile=True is not supported for a {family.name} yet: use compile=False")
    cp = (mesh.cp.get_local_rank(), config.cp) if config.cp > 1 else (0, 1)
    num_layers = len(layer_items(find_submodel(model, family.pipeline_layout(model).layers)))  # before the split
    chunks = split_model(family, model, config, mesh.pp.get_local_rank(), cp) if config.pp > 1 else None
    if max(config.tp, config.cp, config.pp) > 1:
        family.prepare(model, config, mesh)
    layers = find_submodel(model, family.pipeline_layout(model).layers)
    if config.float8 is not None:  # before tp (its float8 styles), checkpointing, compile and FSDP2 (float8.py)
        apply_float8(layers, config)
    tensor_parallel.apply(family, model, mesh, config)
    if config.cp > 1:
        family.apply_context_parallel(model, mesh.cp, config.context_parallel_method)
    moe.apply(family, model, mesh, config)
    # selective keeps nothing of the layer's last projection, and under tp not the others' partial sums
    row_parallel = family.tensor_parallel_plan(model).rowwise if config.activation_checkpointing == "selective" else ()
    apply_activation_checkpointing(layers, config.activation_checkpointing, row_parallel, config.tp)
    if config.activation_offload_layers:
        _offload_activations(layers, num_layers, mesh, config, offload_stats)
    if compile:
        compile_layers([block for _, block in layer_items(layers) if any(True for _ in block.parameters())])
    sync_chunk_layers(model, family)
    if config.zero_stage >= 2:
        _shard_parts(family, model, layers, chunks, mesh, config, param_dtype)
    _PARALLELIZED.add(model)
    return chunks


def _offload_activations(
    layers: nn.Module,
    num_layers: int,
    mesh: ParallelMesh,
    config: ParallelConfig,
    offload_stats: Optional[OffloadStats],
) -> None:
    """The activation-offload step of :func:`parallelize_model`: the layers of ``config.activation_offload_layers``
    among this pp rank's stages (``num_layers``: the model's before the split) keep their saved tensors in host
    memory, counted in ``offload_stats``."""
    stages = config.rank_stages(num_layers, mesh.pp.get_local_rank())
    indices = offloaded_layers(stages, config.activation_offload_layers)
    apply_activation_offload(layers, indices, offload_stats if offload_stats is not None else OffloadStats(), stages)


def _shard_parts(
    family: ModelFamily,
    model: nn.Module,
    layers: nn.Module,
    chunks: Optional[list[tuple[int, nn.Module]]],
    mesh: ParallelMesh,
    config: ParallelConfig,
    param_dtype: Optional[torch.dtype],
) -> None:
    """The ZeRO 2/3 step of :func:`parallelize_model`: FSDP2 over ``dp_cp`` for the model (under pp each stage
    chunk), one unit per decoder layer that holds parameters, then the root."""
    fsdp = dict(
        reshard_after_forward=reshard_after_forward(config),
        policy=FSDPPolicy(
            param_dtype if family.master_weights else None,
            fsdp_reduce_dtype(config.gradient_compression),
            config.optimizer_offload,
        ),
        moe_meshes=moe.fsdp_options(mesh),
    )
    for part in [c for _, c in chunks] if chunks is not None else [model]:
        blocks = [
            b
            for _, b in layer_items(find_submodel(part, "layers") if part is not model else layers)
            if any(True for _ in b.parameters())
        ]
        apply_fsdp(part, mesh.zero, config.zero_stage, blocks=blocks, **fsdp)


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` was already parallelized (by :func:`parallelize_model`, or by plans the user applied:
    FSDP2 modules or DTensor parameters inside it)."""
    from torch.distributed.fsdp import FSDPModule

    if module in _PARALLELIZED:
        return True
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def prepare_models(
    module: nn.Module,
    mesh: ParallelMesh,
    config: ParallelConfig,
    device: torch.device,
    compile: bool = False,
    param_dtype: Optional[torch.dtype] = None,
    fsdp_blocks: Optional[Sequence[str]] = None,
    offload_stats: Optional[OffloadStats] = None,
) -> list[tuple[ModelFamily, nn.Module]]:
    """Parallelize (:func:`parallelize_model`, unless already done) and materialize on ``device``
    (:meth:`ModelFamily.materialize`: our Llama initialized layout-independently, in float32) every model of a
    registered family inside ``module`` (a LightningModule); returns ``[(family, model), ...]``. ``param_dtype``:
    see :func:`parallelize_model` (the parameters stay float32 here: :func:`cast_to_compute_dtype` follows once the
    optimizer's master weights exist). ``offload_stats``: counts the host bytes of ``activation_offload_layers``.

    Any other module (no registered model inside, no plans of its own) gets data parallelism: nothing here at ZeRO
    0/1 (the strategy's gradient buckets and sharded optimizer act on it), FSDP2 units at ZeRO 2/3
    (:func:`shard_any_module`, blocks from ``fsdp_blocks``).

    Raises:
        ValueError: tp / pp / cp > 1 or activation offload for a module that holds no registered model (no
            decoder layers to offload) and applied no plans.
        TypeError: pp > 1 and the module does not hold exactly one model.
    """
    models = [(family, model) for _, family, model in find_models(module)]
    if not models:
        if is_parallelized(module):  # the user's own plans (configure_model)
            return []
        if max(config.tp, config.pp, config.cp) > 1:
            raise ValueError(_cannot_split(config, module))
        if config.activation_offload_layers:
            raise ValueError(
                f"activation_offload_layers={config.activation_offload_layers} needs the decoder layers of a "
                f"lightning_4d Llama or a transformers LlamaForCausalLM / MixtralForCausalLM; {type(module).__name__} "
                "holds none. Use activation_offload_layers=0 (or torch.autograd.graph.save_on_cpu in your own "
                "forward)."
            )
        if config.zero_stage >= 2:
            shard_any_module(module, mesh, config, fsdp_blocks)
        return []
    if config.pp > 1 and len(models) != 1:
        raise TypeError(
            f"pipeline_parallel_size={config.pp} needs exactly one model in the LightningModule (found "
            f"{len(models)}: {', '.join(f.name for f, _ in models)})."
        )
    for family, model in models:
        if not is_parallelized(model):
            parallelize_model(
                family, model, mesh, config, compile=compile, param_dtype=param_dtype, offload_stats=offload_stats
            )
        family.materialize(model, device)
    return models


def cast_to_compute_dtype(models: list[tuple[ModelFamily, nn.Module]], dtype: Optional[torch.dtype]) -> None:
    """Cast the parameters FSDP2 does not own (ZeRO 0/1) of the models whose family keeps master weights to
    ``dtype`` in place (the same ``Parameter`` objects, so optimizers keep them: ``Module.to`` sets ``.data`` of a
    plain parameter and swaps a DTensor one's tensor with ``torch.utils.swap_tensors``, which loses gradient hooks
    registered before); FSDP2 units (ZeRO 2/3) cast per unit at all-gather instead. ``None``: no-op.

    Args:
        models: ``[(family, model), ...]`` of :func:`prepare_models`.
        dtype: the compute dtype (``torch.bfloat16`` under ``bf16-mixed``) or ``None``.

    Mixed precision with master weights (:mod:`lightning_4d.parallel.sharded_optimizer`): called after the optimizers'
    master weights were copied from the float32 parameters.
    """
    from torch.distributed.fsdp import FSDPModule

    if dtype is None:
        return
    for family, model in models:
        if family.master_weights and not any(isinstance(m, FSDPModule) for m in model.modules()):
            model.to(dtype)
