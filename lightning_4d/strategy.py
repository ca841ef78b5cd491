"""``FourDStrategy``: a Lightning strategy that lays a Llama model out on a ``("pp", "dp", "cp", "tp")`` mesh.

The order of parallelization (inside :meth:`FourDStrategy.setup`, on a model built on the meta device) is the one of
``docs/architecture.md``: pipeline split, tensor + sequence parallel plans, context parallel attention,
activation checkpointing per layer, ``torch.compile`` per layer, ZeRO over ``dp_cp``, then materialization and the
layout-independent initialization. Each step is one short function so the order reads top to bottom in
:func:`parallelize_llama`.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_4d.config import ParallelConfig
from lightning_4d.mesh import ParallelMesh, build_mesh
from lightning_4d.parallel.checkpointing import apply_activation_checkpointing
from lightning_4d.parallel.context import apply_context_parallel, gather_sequence, shard_batch
from lightning_4d.parallel.pipeline import PipelineRunner, clip_grad_norm_, split_llama
from lightning_4d.parallel.tensor import apply_tensor_parallel
from lightning_4d.parallel.zero import GradientSynchronizer, ShardedOptimizer, apply_fsdp

log = logging.getLogger(__name__)
# optimizer state dicts in DCP folders: hyper-parameters stored per parameter name, so ranks that hold different
# parameters (pipeline stages) do not overwrite one another's param_groups
_FLAT_OPTIM = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def parallelize_llama(
    model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, compile: bool = False
) -> Optional[list[tuple[int, nn.Module]]]:
    """Apply the pipeline split, tp/sp, context-parallel attention, activation checkpointing, compile and ZeRO 2/3 to
    a meta-device ``LlamaModel``, in that order.

    With pp > 1 the model is pruned to this rank's stages and every step after the split runs on each stage chunk
    (:func:`~lightning_4d.parallel.pipeline.split_llama`); the chunks are returned (``None`` without pp). ZeRO stages
    0 and 1 change nothing in the model: their gradient averaging and optimizer sharding are set up with the
    optimizer (:class:`~lightning_4d.parallel.zero.GradientSynchronizer`,
    :class:`~lightning_4d.parallel.zero.ShardedOptimizer`).
    """
    chunks: Optional[list[tuple[int, nn.Module]]] = None
    if config.pp > 1:
        model.hidden_sequence_shards = config.tp if config.sp else 1
        chunks = split_llama(model, config, mesh.pp.get_local_rank())
    for part in [c for _, c in chunks] if chunks is not None else [model]:
        apply_tensor_parallel(part, mesh.tp, sequence_parallel=config.sp)
        apply_context_parallel(part, mesh.cp, config.context_parallel_method)
        apply_activation_checkpointing(part, config.activation_checkpointing)
        if compile:
            for block in part.layers.values():
                block.compile()
        if config.zero_stage >= 2:
            # zero-bubble schedules run a micro-batch's weight gradients (W) after later forwards: parameters
            # resharded by those forwards lose the W pass's unsharded gradients (measured: wrong losses with zbv +
            # ZeRO-3), so their stage-3 parameters stay gathered from the first forward to the step's end
            split_backward = config.pp > 1 and config.pipeline_schedule in ("zbv", "dualpipev")
            apply_fsdp(part, mesh.dp_cp, config.zero_stage, reshard_after_forward=False if split_backward else None)
        if part is not model:
            for name, block in part.layers.items():  # the union holds the same (wrapped) blocks as its chunks
                model.layers[name] = block
    if chunks is not None:
        model.context_parallel = chunks[0][1].context_parallel
    model._lightning_4d_parallelized = True  # type: ignore[assignment]
    return chunks


def _is_parallelized(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    if getattr(module, "_lightning_4d_parallelized", False):
        return True
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def _reduced_by_fsdp(p: torch.Tensor) -> bool:
    """Whether FSDP2 (over ``dp_cp``) already averages this parameter's gradient."""
    return isinstance(p, DTensor) and "dp_cp" in (p.device_mesh.mesh_dim_names or ())


class FourDStrategy(ModelParallelStrategy):
    """4D parallelism for PyTorch Lightning: dp with ZeRO 0-3, tp with sequence parallelism, pp with GPipe / 1F1B /
    interleaved 1F1B / zero-bubble schedules, cp with ring or all-gather attention.

    ``lightning_4d`` Llama models (``CausalLMModule``) are parallelized automatically; a LightningModule of your own
    can apply plans itself in ``configure_model`` with ``self.device_mesh`` (dims ``("pp", "dp", "cp", "tp")``), as
    with Lightning's ``ModelParallelStrategy``; the strategy then still averages gradients over ``dp_cp`` and shards
    optimizer states for ZeRO stages 0 and 1.

    Args:
        data_parallel_size: dp; ``"auto"`` = world size / (pp·cp·tp).
        tensor_parallel_size: tp (must divide heads, kv heads, FFN size and the padded vocabulary).
        pipeline_parallel_size: pp, the number of pipeline stages' ranks (``lightning_4d`` Llama models only; the
            layers must split into ``pp·v`` stages). With pp > 1 the strategy runs the schedule inside
            ``training_step`` (see ``docs/pipeline.md``).
        pipeline_schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved_1f1b"``, ``"zbv"`` or ``"dualpipev"``.
        virtual_pipeline_stages: v, stages per pp rank (default: 1 for gpipe/1f1b, 2 for the others).
        num_microbatches: m, micro-batches per optimizer step (default: the DataModule's ``global_batch_size /
            (micro_batch_size · dp)``, else pp). The DataLoader batch per dp rank must be a multiple of m;
            ``LMDataModule`` delivers ``micro_batch_size · m`` sequences per batch under pp.
        pipeline_layer_split: decoder layers per stage (``pp·v`` counts summing to ``num_layers``); default equal.
        context_parallel_size: cp, ranks that split every sequence (load-balanced zigzag chunks): the strategy
            shards ``input_ids`` / ``labels`` of each batch over the sequence (:meth:`batch_to_device`) and attention
            exchanges K/V over the cp group; the sequence length must be a multiple of 2·cp (times tp under sp).
        context_parallel_method: ``"ring"`` (default; K/V blocks passed around the cp ring, overlapped with
            compute) or ``"allgather"`` (K/V of the whole sequence all-gathered; cheaper for few kv heads). See
            ``docs/context_parallel.md``.
        zero_stage: 0 (replicated), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters) over dp·cp.
        sequence_parallel: shard norms/residuals over the sequence inside a tp group; ``None`` = on when tp > 1.
        activation_checkpointing: ``"none"`` or ``"full"`` (recompute every transformer layer in backward).
        compile: ``torch.compile`` each transformer layer (dp/ZeRO layouts; not yet with tp > 1).
        save_distributed_checkpoint: save sharded DCP checkpoints (a folder) instead of one full file on rank 0.
        process_group_backend: ``"nccl"``, ``"gloo"``, ... (default: nccl on CUDA, gloo on CPU).
        timeout: process group timeout (a mismatched collective fails after this instead of hanging).
        memory_check: on CUDA, add a :class:`~lightning_4d.memory.callback.MemoryEstimatorCallback` (budget 0.8 of
            the device's memory) unless the Trainer already has one: a layout whose estimated peak would not fit
            raises ``MemoryBudgetExceeded`` before the model is allocated. ``False`` turns it off.

    Raises:
        ValueError: at construction for a bad value (ZeRO stage outside 0-3, a non-positive size, an unknown
            pipeline schedule, a ``virtual_pipeline_stages`` the schedule cannot run, ...); when the Trainer is built
            for a world size that is not pp·dp·cp·tp; at ``setup_environment`` (before the process group exists)
            for a model the layout cannot split (heads, kv heads or vocabulary not divisible by tp, layers not
            divisible into pp·v stages, a ``pipeline_layer_split`` that does not sum to the layers), a
            ``num_microbatches`` the schedule cannot run (m < pp for 1f1b, m not a multiple of pp for interleaved)
            or ``accumulate_grad_batches`` > 1 with pp > 1 (the schedule accumulates over its micro-batches).
            A sequence length not divisible by 2·cp (·tp under sp) fails there too when the DataModule has a
            ``seq_length``, else when the batch is sharded.
        NotImplementedError: compile=True with tensor_parallel_size > 1.
    """

    strategy_name = "fourd"

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        zero_stage: int = 1,
        sequence_parallel: Optional[bool] = None,
        activation_checkpointing: Literal["none", "full"] = "none",
        pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"] = "1f1b",
        virtual_pipeline_stages: Optional[int] = None,
        num_microbatches: Optional[int] = None,
        pipeline_layer_split: Optional[list[int]] = None,
        context_parallel_method: Literal["ring", "allgather"] = "ring",
        compile: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(seconds=1800),
        memory_check: bool = True,
    ) -> None:
        self.memory_check = memory_check
        self.parallel_config = ParallelConfig(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=activation_checkpointing,
            pipeline_schedule=pipeline_schedule,
            virtual_pipeline_stages=virtual_pipeline_stages,
            num_microbatches=num_microbatches,
            pipeline_layer_split=pipeline_layer_split,
            context_parallel_method=context_parallel_method,
        )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if zero_stage == 1 and not save_distributed_checkpoint:
            raise ValueError(
                "save_distributed_checkpoint=False is not supported with zero_stage=1: each rank holds its own chunk of "
                "the optimizer states. Use save_distributed_checkpoint=True (a sharded folder) or zero_stage 0, 2 or 3."
            )
        if pipeline_parallel_size > 1 and not save_distributed_checkpoint:
            raise ValueError(
                "save_distributed_checkpoint=False is not supported with pipeline_parallel_size > 1: no rank holds the "
                "whole model. Use save_distributed_checkpoint=True (a sharded folder that loads into any layout)."
            )
        if compile and tensor_parallel_size > 1:
            # measured with torch 2.13: a compiled block with DTensor tp plans fails in backward inside DTensor's
            # redistribute ("'Tensor' object has no attribute '_local_tensor'"); fail now, not after the queue wait
            raise NotImplementedError(
                f"compile=True with tensor_parallel_size={tensor_parallel_size} is not supported yet (torch.compile of "
                "tensor-parallel layers fails in backward with this PyTorch); use compile=False, or compile=True "
                "with tensor_parallel_size=1 (dp/ZeRO layouts)."
            )
        self.compile = compile
        self._mesh: Optional[ParallelMesh] = None
        self._grad_sync: Optional[GradientSynchronizer] = None
        self.pipeline: Optional[PipelineRunner] = None

    # ------------------------------------------------------------------ layout
    @property
    def mesh(self) -> ParallelMesh:
        """All process groups by name (``mesh.tp``, ``mesh.dp``, ``mesh.dp_cp``, ...); exists after setup_environment."""
        if self._mesh is None:
            raise RuntimeError("The mesh exists only after the strategy's setup_environment().")
        return self._mesh

    @property
    def dp_cp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The process group the loss and gradients are averaged over (``None`` before setup)."""
        return self._mesh.dp_cp.get_group() if self._mesh is not None else None

    def _resolve_layout(self) -> ParallelConfig:
        world_size = self.num_nodes * self.num_processes
        return self.parallel_config.resolve(world_size)

    @override
    def _configure_launcher(self) -> None:
        # runs when the Trainer is built: a bad world size fails before any process is started
        self.parallel_config = self._resolve_layout()
        super()._configure_launcher()

    def _validate_against_module(self) -> None:
        module = self.lightning_module
        model_config = getattr(module, "model_config", None) if module is not None else None
        from lightning_4d.models.config import LlamaConfig

        if isinstance(model_config, LlamaConfig):
            self.parallel_config.validate_model(model_config)
        trainer = getattr(module, "_trainer", None) if module is not None else None
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if datamodule is not None and hasattr(module, "validate_datamodule"):
            module.validate_datamodule(datamodule)
        seq_length = getattr(datamodule, "seq_length", None)
        if isinstance(seq_length, int):
            self.parallel_config.validate_sequence(seq_length)
        if self.parallel_config.pp > 1:
            self._resolve_microbatches(trainer, datamodule)

    def _resolve_microbatches(self, trainer: Any, datamodule: Any) -> None:
        """Fill in and check ``num_microbatches`` (pp > 1) before the process group exists."""
        config = self.parallel_config
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1
        if accumulate != 1:
            raise ValueError(
                f"accumulate_grad_batches={accumulate} is not supported with pipeline_parallel_size={config.pp}: the "
                "pipeline schedule accumulates gradients over its micro-batches. Set accumulate_grad_batches=1 and "
                f"num_microbatches={accumulate * (config.num_microbatches or config.pp)} (or let it follow the "
                "DataModule's global_batch_size)."
            )
        if config.num_microbatches is None:
            global_batch = getattr(datamodule, "global_batch_size", None)
            micro = getattr(datamodule, "micro_batch_size", None)
            per_replica = micro * config.dp if isinstance(micro, int) else None
            if isinstance(global_batch, int) and per_replica and global_batch % per_replica == 0:
                m = global_batch // per_replica
            elif isinstance(global_batch, int) and per_replica:
                raise ValueError(
                    f"global_batch_size={global_batch} is not a multiple of micro_batch_size x dp = {micro} x "
                    f"{config.dp} = {per_replica}, so num_microbatches cannot be derived; change the batch sizes or "
                    "set num_microbatches."
                )
            else:
                m = 2 * config.pp if config.pipeline_schedule == "dualpipev" else config.pp
            config.num_microbatches = m
        config.validate_microbatches(config.num_microbatches)

    @property
    def num_microbatches(self) -> int:
        """m, the micro-batches the pipeline schedule runs per training step (1 without pp)."""
        config = self.parallel_config
        if config.pp == 1:
            return 1
        return config.num_microbatches or (2 * config.pp if config.pipeline_schedule == "dualpipev" else config.pp)

    @override
    def setup_environment(self) -> None:
        self.parallel_config = self._resolve_layout()
        self._validate_against_module()  # before the process group exists
        self._add_memory_check()
        self._setup_distributed()
        self._mesh = build_mesh(self.parallel_config, self.root_device.type)
        self._device_mesh = self._mesh.world
        self._data_parallel_size = self.parallel_config.dp
        self._tensor_parallel_size = self.parallel_config.tp
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _add_memory_check(self) -> None:
        """On CUDA, add the pre-fit memory check (it runs in ``Callback.setup``, before ``configure_model``)."""
        from lightning_4d.memory.callback import MemoryEstimatorCallback

        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if not self.memory_check or trainer is None or self.root_device.type != "cuda":
            return
        if not any(isinstance(cb, MemoryEstimatorCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(MemoryEstimatorCallback())

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then (cp > 1) keep this cp rank's zigzag shard of every sequence: ``input_ids``,
        ``labels`` (and ``positions``) ``[b, s] -> [b, s/cp]`` (:func:`~lightning_4d.parallel.context.shard_batch`).

        Raises:
            ValueError: a sequence length not divisible by 2·cp.
        """
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._mesh is None or self.parallel_config.cp == 1:
            return batch
        return shard_batch(batch, self._mesh.cp.get_local_rank(), self.parallel_config.cp)

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence (natural order) of a per-cp-rank tensor such as the logits ``[b, s/cp, V]`` of
        ``predict_step``; ``x`` itself when cp = 1. Must run on every rank of the cp group."""
        if self._mesh is None or self.parallel_config.cp == 1:
            return x
        return gather_sequence(x, self._mesh.cp.get_group(), dim=dim)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # tp (and cp) peers see the same samples: only the dp coordinate picks the data slice
        return {"num_replicas": self.mesh.dp.size(), "rank": self.mesh.dp_rank}

    # ------------------------------------------------------------------ model
    @override
    def setup(self, trainer: "L.Trainer") -> None:  # noqa: F821
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        from lightning_4d.models.llama import LlamaModel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        llamas = [m for m in module.modules() if isinstance(m, LlamaModel)]
        if not llamas and not is_overridden("configure_model", module):
            raise TypeError(
                f"{type(self).__name__} parallelizes lightning_4d Llama models automatically; for another model, "
                "override `configure_model()` in your LightningModule and apply plans there with `self.device_mesh`."
            )
        if self.parallel_config.pp > 1 and len(llamas) != 1:
            raise TypeError(
                f"pipeline_parallel_size={self.parallel_config.pp} needs exactly one lightning_4d LlamaModel in the "
                f"LightningModule (found {len(llamas)})."
            )
        for llama in llamas:
            if not _is_parallelized(llama):
                parallelize_llama(llama, self.mesh, self.parallel_config, compile=self.compile)
            if any(p.is_meta for p in llama.parameters()):
                llama.to_empty(device=self.root_device)
                with torch.no_grad():
                    llama.init_weights()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        chunks = getattr(llamas[0], "_pipeline_chunks", None) if llamas else None
        if chunks is not None and self.pipeline is None:
            self.pipeline = self._build_pipeline(module, chunks)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.pipeline is not None:
            self._use_pipeline_clipping()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _use_pipeline_clipping(self) -> None:
        """Make ``gradient_clip_val`` (norm) clip by the global norm over all shards AND all pipeline stages."""
        plugin, group = self.precision_plugin, self.mesh.pp.get_group()

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), float(clip_val), pp_group=group)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _build_pipeline(self, module: Any, chunks: list[tuple[int, nn.Module]]) -> PipelineRunner:
        from lightning_4d.tasks.causal_lm import causal_lm_loss

        loss_fn = getattr(module, "pipeline_loss", None) or causal_lm_loss
        return PipelineRunner(
            chunks, self.parallel_config, self.num_microbatches, self.mesh.pp.get_group(), self.root_device,
            loss_fn=loss_fn, vocab_parallel=self.parallel_config.tp > 1,
        )

    @override
    def setup_optimizers(self, trainer: "L.Trainer") -> None:  # noqa: F821
        super().setup_optimizers(trainer)
        group = self.mesh.dp_cp.get_group()
        params = [p for p in self.model.parameters() if p.requires_grad and not _reduced_by_fsdp(p)]
        if self._grad_sync is not None:
            self._grad_sync.close()
        self._grad_sync = GradientSynchronizer(params, group) if params else None
        if self.parallel_config.zero_stage == 1 and self.mesh.dp_cp.size() > 1:
            for opt in self.optimizers:  # each optimizer keeps its ShardedOptimizer (see _zero1_for)
                ShardedOptimizer(_unwrap(opt), group)

    # ------------------------------------------------------------------ training step
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any):
        # vocabulary-parallel cross-entropy needs its backward inside the same context as its forward
        if isinstance(closure_loss, DTensor):
            from lightning_4d.parallel.tensor import vocab_parallel_loss

            ctx = vocab_parallel_loss()
        else:
            ctx = nullcontext()
        if self.pipeline is not None:
            # the schedule already ran forward and backward of every micro-batch inside training_step
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self.pipeline.restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        with ctx:
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        if self._grad_sync is not None:
            inner, sync = closure, self._grad_sync
            pipelined = self.pipeline is not None

            def closure() -> Any:  # forward + backward (gradients averaged over dp_cp while backward runs)
                # a pipeline accumulates over its m micro-batches: reduce once, after the schedule
                with nullcontext() if pipelined else sync.overlap_with_backward():
                    out = inner()
                sync.synchronize()
                return out

        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _zero1_for(self, optimizer: Optimizer) -> Optional[ShardedOptimizer]:
        return getattr(_unwrap(optimizer), "_lightning_4d_zero1", None)

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.model.named_parameters()}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        zero1 = self._zero1_for(optimizer)
        if zero1 is None and self._save_distributed_checkpoint:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, _unwrap(optimizer), options=_FLAT_OPTIM)
        if zero1 is None:
            return super().optimizer_state(optimizer)
        # ZeRO-1: each rank's chunk of the states; saved as one file per rank inside the checkpoint folder
        inner = zero1.optimizer
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        return {"zero1": True, "state": zero1.sharded_state(self._param_names()), "param_groups": groups}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Save atomically: write ``<path>.tmp`` completely, then replace ``<path>`` (a crash never leaves a
        half-written checkpoint in place of a good one)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        from torch.distributed.checkpoint import save as dcp_save

        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier()
        tmp.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            if isinstance(opt_state, dict) and opt_state.get("zero1"):
                torch.save(opt_state, tmp / f"zero1_optimizer_{idx}_rank{self.global_rank}.pt")
            else:
                state[f"optimizer_{idx}"] = opt_state
        dcp_save(state, checkpoint_id=tmp)
        if self.global_rank == 0:
            torch.save(checkpoint, tmp / _METADATA_FILENAME)
        self.barrier()
        if self.global_rank == 0:
            old = path.with_name(path.name + ".old")
            if path.exists():
                if path.is_dir():
                    path.rename(old)
                else:
                    path.unlink()
            tmp.rename(path)
            if old.exists():
                shutil.rmtree(old)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.exists():
            raise ValueError(f"checkpoint {str(path)!r} does not exist: pass a folder or file that ModelCheckpoint wrote")
        if not path.is_dir():
            return self._load_full_checkpoint(path, weights_only)
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp_load(model_state, checkpoint_id=path)
        set_model_state_dict(self.model, model_state["state_dict"], options=StateDictOptions(strict=strict))
        for idx, optimizer in enumerate(self.optimizers):
            zero1 = self._zero1_for(optimizer)
            if zero1 is not None:
                saved = torch.load(path / f"zero1_optimizer_{idx}_rank{self.global_rank}.pt", weights_only=False)
                zero1.load_sharded_state(self._param_names(), saved["state"])
                for group, values in zip(zero1.optimizer.param_groups, saved["param_groups"]):
                    group.update(values)
                continue
            key = f"optimizer_{idx}"
            opt_state = {key: get_optimizer_state_dict(self.model, _unwrap(optimizer), options=_FLAT_OPTIM)}
            dcp_load(opt_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, _unwrap(optimizer), optim_state_dict=opt_state[key],
                                     options=_FLAT_OPTIM)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only if weights_only is not None else False)


    def _load_full_checkpoint(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        """Load a single-file checkpoint (``save_distributed_checkpoint=False``): every rank reads the file and
        keeps its shards of the full state dicts."""
        from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.lightning_module is not None
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for idx, optimizer in enumerate(self.optimizers):
            state = _rekey_optimizer_state_if_needed(checkpoint["optimizer_states"][idx], self.model)
            set_optimizer_state_dict(
                self.model, _unwrap(optimizer), optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
            )
        checkpoint.pop("optimizer_states", None)
        return checkpoint


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
