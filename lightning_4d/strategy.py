"""``FourDStrategy``: a Lightning strategy that lays a model out on a ``("pp", "dp", "cp", "tp")`` mesh.

Lightning hooks only, each delegating: what the task, the data and the Trainer declare (read once) to
:mod:`lightning_4d.contract`, the layout and its checks to :mod:`lightning_4d.config`, the mesh to
:mod:`lightning_4d.mesh`, the models a module holds to :mod:`lightning_4d.families.registry`, the order of
parallelization to :mod:`lightning_4d.parallel.parallelize`, pipelining to
:mod:`lightning_4d.features.pipeline.runtime`, ZeRO 0/1 to :mod:`lightning_4d.parallel.sharded_optimizer`, optimizer
steps and clipping to :mod:`lightning_4d.precision`, cp batch sharding to
:mod:`lightning_4d.features.context_parallel.runtime`, checkpoint I/O to :mod:`lightning_4d.checkpoint`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_4d.checkpoint as _checkpoint
from lightning_4d.config import ParallelConfig
from lightning_4d.contract import LayoutStrategy, TrainingInputs
from lightning_4d.families.registry import load_initial_weights
from lightning_4d.features.context_parallel.runtime import gather_sequence, shard_batch
from lightning_4d.features.moe import runtime as moe
from lightning_4d.features.pipeline.runtime import (
    PipelineRunner,
    TiedEmbedding,
    pipeline_chunks,
    resolve_num_microbatches,
)
from lightning_4d.layout import layout_of, layout_signature, saved_layout
from lightning_4d.memory_check import add_memory_check
from lightning_4d.mesh import ParallelMesh, build_mesh, embedding_group
from lightning_4d.parallel._compat.lightning import (
    PATH,
    attached_trainer,
    materialize_distributed_module,
    optimizers_to_device,
    record_sigterm_without_collective,
    set_module_device_mesh,
)
from lightning_4d.parallel._compat.process import restarted_worker_store
from lightning_4d.parallel.float8 import check_float8_device, precompute_scales, validate_float8
from lightning_4d.parallel.grad_buffers import GradientBuckets, GradientReduction
from lightning_4d.parallel.loss import causal_lm_loss
from lightning_4d.parallel.offload import OffloadStats
from lightning_4d.parallel.parallelize import (
    cast_to_compute_dtype,
    prepare_models,
    validate_against_module,
    validate_compile,
)
from lightning_4d.parallel.sharded_optimizer import (
    MasterWeights,
    mixed_precision_dtype,
    setup_zero,
    unwrap_optimizer,
    validate_precision,
    zero_parameters,
)
from lightning_4d.precision import four_d_precision

#: ``powersgd_comm_dtype`` (``lightning_4d.layout.POWERSGD_COMM_DTYPES``) -> the dtype PowerSGD's factors travel in
_COMM_DTYPES: dict[Optional[str], Optional[torch.dtype]] = {None: None, "bfloat16": torch.bfloat16}


@layout_signature
class FourDStrategy(ModelParallelStrategy, LayoutStrategy):
    """4D parallelism for PyTorch Lightning: dp with ZeRO 0-3, tp with sequence parallelism, pp with GPipe / 1F1B /
    interleaved 1F1B / zero-bubble schedules, cp with ring or all-gather attention.

    ``lightning_4d`` Llama models (``CausalLMModule``) are parallelized automatically; a LightningModule of your own
    can apply plans itself in ``configure_model`` with ``self.device_mesh`` (dims ``("pp", "dp", "cp", "tp")``), as
    with Lightning's ``ModelParallelStrategy``; the strategy then still averages gradients over ``dp_cp`` and shards
    optimizer states for ZeRO stages 0 and 1.

    Args:
        <the layout fields>
        fsdp_blocks: for a LightningModule that is not a ``lightning_4d`` Llama (any module: data parallel only)
            at ZeRO 2/3, the classes whose instances become their own FSDP2 units, as dotted class paths
            (``["torch.nn.TransformerEncoderLayer"]``) or bare class names; ``None`` = the children of every
            ``nn.ModuleList`` / ``nn.ModuleDict`` (:func:`lightning_4d.parallel.parallelize.fsdp_block_modules`).
            Lightning's ``FSDPStrategy(auto_wrap_policy=...)`` for FSDP2, on CPU too.
        save_distributed_checkpoint: save sharded DCP checkpoints (a folder) instead of one full file on rank 0.
        process_group_backend: ``"nccl"``, ``"gloo"``, ... (default: nccl on CUDA, gloo on CPU).
        timeout: the limit of each operation on every process group the strategy makes: the default group, its
            mesh's groups (:func:`lightning_4d.mesh.build_mesh`), the tied embedding group, the checkpoint writes'
            group (a mismatched collective fails after this instead of hanging).
        memory_check: on CUDA, add a :class:`~lightning_4d.memory_check.MemoryEstimatorCallback` (budget 0.8 of
            the device's memory) unless the Trainer already has one: a layout whose estimated peak would not fit
            raises ``MemoryBudgetExceeded`` before the model is allocated; a batch shape it cannot find (see the
            callback) raises ``ValueError``. ``False`` turns it off.

    Raises:
        ValueError: at construction for a bad value (ZeRO stage outside 0-3, a non-positive size, an unknown
            pipeline schedule, a ``virtual_pipeline_stages`` the schedule cannot run, ...); when the Trainer is built
            for a world size that is not pp·dp·cp·tp; at ``setup_environment`` (before the process group exists)
            for a model the layout cannot split (tp, pp or cp > 1 for a module that holds neither a ``lightning_4d``
            Llama nor a transformers ``LlamaForCausalLM`` and applies no plans of its own in ``configure_model``;
            heads, kv heads or vocabulary not divisible by tp, layers not divisible into pp·v stages, a
            ``pipeline_layer_split`` that does not sum to the layers), a
            ``num_microbatches`` the schedule cannot run (m < pp for 1f1b, m not a multiple of pp for interleaved)
            or ``accumulate_grad_batches`` > 1 with pp > 1 (the schedule accumulates over its micro-batches).
            A sequence length not divisible by 2·cp (·tp under sp) fails there too when the DataModule has a
            ``seq_length``, else when the batch is sharded.
        ValueError: compile=True with activation_checkpointing='selective'.
        ValueError: ``float8`` without torchao >= 0.18 installed, with the tp ring overlap, or (at
            ``setup_environment``) ``"tensorwise"`` under tp with sp on gloo, a model whose linears have a dimension
            not divisible by 16, a Mixture-of-Experts model, a module holding no ``lightning_4d`` Llama, or a
            precision other than ``32-true`` / ``bf16-mixed`` / ``bf16-true``.
    """

    strategy_name = "fourd"
    #: ``CausalLMModule`` builds its ``LlamaModel`` inside ``tensor_init_context(empty_init=True)`` (the meta device,
    #: as Lightning's ``ModelParallelStrategy`` gives it) when this is true: ``setup`` then parallelizes, materializes
    #: and initializes it (``parallel/parallelize.py``)
    initializes_llama_models = True

    def __init__(
        self,
        *,
        fsdp_blocks: Optional[list[str]] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(seconds=1800),
        memory_check: bool = True,
        **layout: Any,
    ) -> None:
        # the layout arguments: lightning_4d/layout.py's fields, in the signature below (what LightningCLI reads)
        self.parallel_config = ParallelConfig(**layout_of(layout, type(self).__name__))
        self.memory_check = memory_check
        super().__init__(
            data_parallel_size=self.parallel_config.data_parallel_size,
            tensor_parallel_size=self.parallel_config.tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        _checkpoint.validate_format(self.parallel_config, save_distributed_checkpoint)
        validate_compile(self.parallel_config.compile, self.parallel_config.activation_checkpointing)
        validate_float8(self.parallel_config.float8)
        self._requested_backend = process_group_backend
        self.compile = self.parallel_config.compile
        self.fsdp_blocks = list(fsdp_blocks) if fsdp_blocks is not None else None
        self._mesh: Optional[ParallelMesh] = None
        self._dp_cp_group: Optional[torch.distributed.ProcessGroup] = None  # the mesh's, looked up once
        self._buckets: Optional[GradientBuckets] = None
        #: the ZeRO 0/1 parameters whose gradients stay in ``.grad`` when ``setup_zero`` made no buckets (one rank:
        #: :func:`lightning_4d.partition.gradient_buckets_needed`), dropped after each optimizer step as the buckets are
        self._unbucketed: list[torch.nn.Parameter] = []
        self._models: list[tuple[Any, torch.nn.Module]] = []  # (family, model) of lightning_4d.families.registry
        #: what the LightningModule, its DataModule and the Trainer declare (micro-batch sizes, sequence length,
        #: ``pipeline_loss``, ``init_from``: :mod:`lightning_4d.contract`), read once in ``setup_environment``
        self.training_inputs = TrainingInputs()
        #: the pipeline schedule's runner (pp > 1, after ``setup``); ``CausalLMModule`` runs its steps through it
        self.pipeline: Optional[PipelineRunner] = None
        #: tied embeddings under pp: the copies on this rank and their embedding group
        #: (``features/pipeline/runtime.py``)
        self._tied: Optional[TiedEmbedding] = None
        self._tied_made = False  # whether _tied_embedding ran (its group is made once per strategy)
        #: host bytes held by ``activation_offload_layers`` (``lightning_4d.parallel.offload.OffloadStats``)
        self.offload_stats = OffloadStats()
        #: the background writes of ``async_checkpoint=True`` (:class:`lightning_4d.checkpoint.AsyncSaves`)
        self.async_saves: Optional[_checkpoint.AsyncSaves] = (
            _checkpoint.AsyncSaves(timeout) if self.parallel_config.async_checkpoint else None
        )

    # ------------------------------------------------------------------ layout
    # the members of lightning_4d.contract.LayoutStrategy: what the task, the callbacks and the meters read
    @property
    def mesh(self) -> ParallelMesh:
        """All process groups by name (``mesh.tp``, ``mesh.dp``, ``mesh.dp_cp``, ...); exists after
        setup_environment."""
        if self._mesh is None:
            raise RuntimeError("The mesh exists only after the strategy's setup_environment().")
        return self._mesh

    @property
    def dp_cp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The process group the loss and gradients are averaged over (``None`` before setup)."""
        return self._dp_cp_group

    @property
    def context_parallel_size(self) -> int:
        """cp, the ranks that split every sequence (1 without cp)."""
        return self.parallel_config.cp

    @property
    def context_parallel_rank(self) -> int:
        """This rank's index in its cp group, 0..cp-1 (0 before setup_environment): which zigzag shard of every
        sequence it holds (:func:`lightning_4d.features.context_parallel.runtime.shard_sequence`)."""
        return self._mesh.cp.get_local_rank() if self._mesh is not None else 0

    @property
    def gradient_buckets(self) -> Optional[GradientBuckets]:
        """The ZeRO 0-2 gradient buckets (after ``setup_optimizers``), or ``None`` (ZeRO 3, one rank without
        buckets, before ``setup_optimizers``)."""
        return self._buckets

    @property
    def num_microbatches(self) -> int:
        """m, the micro-batches the pipeline schedule runs per training step (1 without pp)."""
        return self.parallel_config.microbatches

    @override
    def _configure_launcher(self) -> None:
        # runs when the Trainer is built: a bad world size fails before any process is started
        self.parallel_config = self.parallel_config.resolve(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _backend(self) -> str:
        """The process group backend the run uses: the default group's when one exists, else the one asked for,
        else Lightning's default for the device (nccl on CUDA, gloo otherwise)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_backend()
        return self._requested_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    def _resolve_inputs(self) -> None:
        """Read what the task, the data and the Trainer declare, once (:class:`~lightning_4d.contract.TrainingInputs`),
        check the layout against it and resolve the layout with it (world size, m), before the process group exists;
        neither changes later.

        Raises:
            ValueError: see :func:`~lightning_4d.parallel.parallelize.validate_against_module`.
        """
        config = self.parallel_config.resolve(self.num_nodes * self.num_processes)
        self.training_inputs = TrainingInputs.of(self.lightning_module, attached_trainer(self.lightning_module))
        validate_against_module(config, self.lightning_module, self.training_inputs)
        if config.pp > 1:
            config = replace(config, num_microbatches=resolve_num_microbatches(config, self.training_inputs))
        self.parallel_config = config

    @override
    def setup_environment(self) -> None:
        self._resolve_inputs()
        validate_precision(
            self._precision,
            self.parallel_config.zero_stage,
            full_file_checkpoints=not self._save_distributed_checkpoint,
        )
        validate_float8(self.parallel_config.float8, self._precision, self.parallel_config, self._backend())
        check_float8_device(self.parallel_config.float8, self.root_device)
        if self.memory_check and self.root_device.type == "cuda":  # runs in Callback.setup, before configure_model
            add_memory_check(attached_trainer(self.lightning_module))
        self._setup_distributed()
        if self._mesh is None:  # every process group once per strategy, on every rank: a later fit/validate reuses it
            self._mesh = build_mesh(self.parallel_config, self.root_device.type, self._timeout)
        self._dp_cp_group = self._mesh.dp_cp.get_group()  # read every step (the logged loss' mean)
        self._device_mesh = self._mesh.world
        self._data_parallel_size = self.parallel_config.dp
        self._tensor_parallel_size = self.parallel_config.tp
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self._device_mesh)

    @override
    def _setup_distributed(self) -> None:
        # a worker torchrun restarted (--max-restarts) joins the process group through keys of its own attempt
        # (_compat.process.restarted_worker_store: torch 2.13's torchrun keeps its store across restarts); Lightning's
        # own setup then finds the group made
        store = restarted_worker_store(self._timeout)
        if store is not None and not torch.distributed.is_initialized():
            import os

            device = {"device_id": self.root_device} if self.root_device.type != "cpu" else {}
            torch.distributed.init_process_group(
                self._backend(),
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=self._timeout,
                **device,
            )
        super()._setup_distributed()

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then (cp > 1) keep this cp rank's zigzag shard of every sequence: ``input_ids``,
        ``labels`` (and ``positions``) ``[b, s] -> [b, s/cp]``
        (:func:`~lightning_4d.features.context_parallel.runtime.shard_batch`).

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
        assert self.model is not None and self.accelerator is not None
        record_sigterm_without_collective(trainer)  # before the Trainer registers its signal handlers
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self._models = prepare_models(
            module,
            self.mesh,
            self.parallel_config,
            self.root_device,
            compile=self.compile,
            param_dtype=mixed_precision_dtype(self._precision),
            fsdp_blocks=self.fsdp_blocks,
            offload_stats=self.offload_stats,
        )
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        chunks = next((c for _, m in self._models if (c := pipeline_chunks(m)) is not None), None)
        if chunks is not None and self.pipeline is None:
            loss_fn = self.training_inputs.pipeline_loss or causal_lm_loss
            self.pipeline = PipelineRunner(
                chunks,
                self.parallel_config,
                self.num_microbatches,
                self.mesh.pp.get_group(),
                self.root_device,
                loss_fn=loss_fn,
            )
        if self.pipeline is not None and not self._tied_made:  # its group once, on every rank (a rank holding no
            self._tied, self._tied_made = self._tied_embedding(), True  # copy gets None: asked again, it would hang)
        init_from = self.training_inputs.init_from
        if init_from is not None and not trainer.ckpt_path:  # each rank reads its slices, before masters exist
            load_initial_weights(module, init_from)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # the master weights are copied from the float32 parameters here
        cast_to_compute_dtype(self._models, self.compute_dtype)
        if self._buckets is not None:
            if self._buckets.grad_dtype is not None:  # master weights: hooks deferred until after the cast
                self._buckets.register_hooks()  # (which swaps DTensor parameters' tensors)
            if self.pipeline is not None:  # evaluation runs of the schedule leave the buckets alone
                self.pipeline.gradient_guard = self._buckets.suspended
        self.setup_precision_plugin()
        # ShardedOptimizer steps and global-norm clipping: Lightning's plugin with our overrides
        # (lightning_4d.precision)
        self.precision_plugin = four_d_precision(
            self.precision_plugin, self.mesh.pp.get_group() if self.pipeline is not None else None
        )
        if self._tied is not None:  # the head's copy is counted once, as the embedding
            self.precision_plugin.norm_excluded = self._tied.norm_excluded
        if trainer.state.fn == TrainerFn.FITTING and not self.parallel_config.optimizer_offload:
            optimizers_to_device(self.optimizers, self.root_device)  # offloaded: the states stay on the host

    def _tied_embedding(self) -> Optional[TiedEmbedding]:
        """The tied embedding of a pipeline-split model whose config ties it (``None`` otherwise); makes the embedding
        group (collective: every rank holds the same kind of model)."""
        tied = [(f, m) for f, m in self._models if f.model_config(m).tie_word_embeddings]
        if not tied:
            return None
        group = embedding_group(self.mesh, self.parallel_config, self._timeout)
        family, model = tied[0]
        return TiedEmbedding.of(family, model, group)

    @override
    def setup_optimizers(self, trainer: "L.Trainer") -> None:  # noqa: F821
        super().setup_optimizers(trainer)
        if self._buckets is not None:
            self._buckets.close()
        optimizers = [unwrap_optimizer(opt) for opt in self.optimizers]
        # FSDP2's MixedPrecisionPolicy keeps the masters of what it owns (ZeRO 2/3); the rest is never cast
        master = torch.float32 if self.compute_dtype is not None and self.parallel_config.zero_stage <= 1 else None
        pc = self.parallel_config
        self._buckets = setup_zero(
            self.model,
            optimizers,
            self.mesh.zero_shard.get_group(),
            pc.zero_stage,
            MasterWeights(master, self.mesh.tp.get_local_rank(), pc.optimizer_offload),
            reduction=GradientReduction(
                pc.gradient_compression,
                pc.powersgd_rank,
                pc.powersgd_start_step,
                _COMM_DTYPES[pc.powersgd_comm_dtype],
                moe.gradient_groups(self.model, self.mesh),
                replicas=None if self.mesh.zero_replicate is None else self.mesh.zero_replicate.get_group(),
            ),
            pipelined=self.pipeline is not None,
        )
        self._unbucketed = zero_parameters(self.model) if self._buckets is None else []

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """bfloat16 under ``bf16-mixed`` with a model whose family keeps fp32 master weights (our Llama:
        :mod:`lightning_4d.parallel.sharded_optimizer`); ``None`` when the parameters are their own masters (other
        precisions, or no such model: Lightning's autocast)."""
        return mixed_precision_dtype(self._precision) if any(f.master_weights for f, _ in self._models) else None

    @property
    def _precision(self) -> Optional[str]:
        """Lightning's precision flag (``"bf16-mixed"``, ...), from the precision plugin."""
        return self.precision_plugin.precision

    # ------------------------------------------------------------------ training step
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any):
        if self.pipeline is not None:
            # the schedule already ran forward and backward of every micro-batch inside training_step
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self.pipeline.restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        if self._buckets is not None or self._tied is not None:
            inner, sync, tied = closure, self._buckets, self._tied
            pipelined = self.pipeline is not None
            trainer = attached_trainer(self.lightning_module)
            step = trainer.global_step if trainer is not None else 0

            def closure() -> Any:  # forward + backward (gradients averaged over dp_cp while backward runs)
                # a pipeline accumulates over its m micro-batches: reduce once, after the schedule
                with nullcontext() if pipelined or sync is None else sync.overlap_with_backward(step):
                    out = inner()
                if tied is not None:  # the two copies of tied embeddings: one gradient (before clipping)
                    tied.reduce_gradients(sync)
                if sync is not None:
                    sync.synchronize(step)
                return out

        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._buckets is not None:
            self._buckets.start_accumulation()  # the next backward's gradients overwrite the buckets
        for p in self._unbucketed:  # no gradient exists in the next forward (the memory model's rule)
            p.grad = None
        precompute_scales([m for _, m in self._models], self.parallel_config)  # float8 all-gather's next scales
        return result

    # ------------------------------------------------------------------ checkpoints (lightning_4d.checkpoint)
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict for a save: Lightning's (copied to the CPU), or under ``async_checkpoint`` left
        where it is (:class:`~lightning_4d.checkpoint.AsyncSaves` stages it into pinned host memory itself)."""
        if self.async_saves is None or not self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = _checkpoint.optimizer_state(
            self.model, optimizer, self._save_distributed_checkpoint, offload=self.async_saves is None
        )
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Save a sharded folder atomically (:func:`lightning_4d.checkpoint.save_sharded`), or one full file
        (``save_distributed_checkpoint=False``, Lightning's ``ModelParallelStrategy``). With ``async_checkpoint``
        it returns once the states are in host memory; the folder appears when the background write completes
        (:meth:`wait_for_checkpoint`).

        Raises:
            RuntimeError: ``async_checkpoint`` and the previous save's background write failed.
        """
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        if self.async_saves is not None:
            self.async_saves.pin_memory = self.root_device.type == "cuda"
        _checkpoint.save_sharded(
            checkpoint,
            Path(self.broadcast(str(filepath))),
            self.global_rank,
            self.barrier,
            self.parallel_config,
            self.model,
            self._buckets,
            self.async_saves,
        )

    def wait_for_checkpoint(self) -> None:
        """Block until the background write of the last save (``async_checkpoint=True``) is complete and renamed into
        place on this rank; nothing to do otherwise.

        Raises:
            RuntimeError: that write failed (the previous checkpoint at its path is kept).
        """
        if self.async_saves is not None:
            self.async_saves.wait()

    @override
    def remove_checkpoint(self, filepath: PATH) -> None:
        # ModelCheckpoint removes a checkpoint it no longer keeps: never one still being written
        if self.async_saves is not None and self.async_saves.pending == Path(filepath):
            self.async_saves.wait()
        super().remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        """Wait for a checkpoint still being written (``async_checkpoint``: the end of ``fit``) and free its
        staging buffers, then Lightning's teardown.

        Raises:
            RuntimeError: that write failed (after Lightning's teardown ran).
        """
        try:
            if self.async_saves is not None:
                self.async_saves.close()
        finally:
            super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a sharded folder (:func:`lightning_4d.checkpoint.load_sharded`) or a full file
        (:func:`lightning_4d.checkpoint.load_full`), always weights only (:mod:`lightning_4d.safe_load`): a file that
        holds more than tensors, plain data and our config types is refused unread, whatever ``weights_only`` says
        (Lightning passes ``fit``/``validate``/``test``/``predict``'s argument; ``False`` is not honoured).

        Raises:
            ValueError: ``checkpoint_path`` does not exist, or a file in it holds more than plain data (an
                ``UnsafeFileError`` naming the file, what it holds and what to do).
        """
        path = _checkpoint.resolve(Path(self.broadcast(str(checkpoint_path))))
        assert self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        if not path.is_dir():
            return _checkpoint.load_full(path, self.model, self.optimizers, strict)
        return _checkpoint.load_sharded(
            path,
            self.model,
            self.optimizers,
            strict,
            self.global_rank,
            self._buckets,
            saved_layout(self.parallel_config),
        )
