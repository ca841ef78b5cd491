"""One rank of any layout, measured in one process: ``lightning-4d measure``.

torch's fake process group (:func:`lightning_4d.parallel._compat.fake.init_fake_process_group`: every collective and
send/recv returns at once and moves no data, any rank of any world size; Megatron-LM's ``--fake-process-group``)
lets one process build and run exactly the tensors rank ``r`` of a layout allocates: the same ``Trainer.fit``
through :class:`~lightning_4d.FourDStrategy` (mesh, split, tp/sp, cp, activation checkpointing, FSDP2 or the ZeRO 0/1
buckets, the optimizer, the pipeline schedule, the step) that a real run takes, on synthetic tokens. Losses are
meaningless (the collectives carry no data); memory is real.

What differs from a real run, and why it does not change the bytes:

- :class:`MeasureStrategy` answers ``broadcast`` with the object itself (every rank computes the same object; the
  fake group cannot carry a pickled one);
- under pp the stages learn their neighbours' tensor metadata from the layout instead of from a receive
  (:func:`~lightning_4d.parallel._compat.fake.answer_pipeline_metadata`): the hidden state ``[b, s/(cp·tp_sp), h]``;
- under expert parallelism the dispatch's count exchange (``features/moe/expert.py``: how many rows each source sends to
  each local expert) is answered with a stated load instead of the other ranks' routing
  (:func:`~lightning_4d.parallel._compat.fake.answer_count_exchange`): the rank's experts receive
  :func:`received_rows` rows per MoE layer, ``expert_load_imbalance`` times the balanced figure, the load the
  estimate assumes; the all-to-all of the rows then allocates exactly that many (their values are whatever the fake
  group left: memory is real, outputs meaningless).

Measured peak:

- CUDA: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of PyTorch's caching allocator (reserved −
  allocated is the fragmentation the overhead allowance covers);
- CPU: :class:`LiveTensorBytes`, the largest sum of bytes of the CPU storages alive at once (each storage once,
  FSDP2's storage resizes followed), seen by a ``TorchDispatchMode`` around the whole fit.

The model states (parameters, gradients at the optimizer step, optimizer states) are counted on the real tensors
as ``tests/test_memory_model.py`` counts them (:func:`model_state_tensors`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_4d.config import ParallelConfig
from lightning_4d.contract import layout_strategy
from lightning_4d.features.moe import runtime as moe
from lightning_4d.features.moe.costs import check_expert_load_imbalance
from lightning_4d.features.moe.runtime import received_rows, spread_counts  # noqa: F401 - spread_counts importable from here too
from lightning_4d.layout import config_kwargs, reported_layout
from lightning_4d.parallel._compat.compile import compiled_graph_count
from lightning_4d.parallel._compat.dispatch import (
    TorchDispatchMode,
    inner_tensors,
    is_traceable_wrapper_subclass,
    tree_flatten,
)
from lightning_4d.parallel._compat.dtensor import local_tensor as _local
from lightning_4d.planning.commands import command_parser, layout_from_args, load_model_config, workload_from_args
from lightning_4d.planning.hardware import GIB, OverheadAllowance
from lightning_4d.planning.model import estimate_all_pp_ranks, estimate_memory
from lightning_4d.planning.workload import Workload

if TYPE_CHECKING:
    from lightning_4d.parallel.grad_buffers import GradientBuckets

#: the estimate's fields compared with the measurement, in the order the table prints them
COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers")


def rank_coordinates(pc: ParallelConfig, rank: int) -> dict[str, int]:
    """The ``pp``, ``dp``, ``cp``, ``tp`` coordinates of global ``rank`` on the mesh ``("pp", "dp", "cp", "tp")``
    (tp innermost, ``lightning_4d/mesh.py``), and its index in ``dp_cp`` (``dp·cp + cp``).

    Raises:
        ValueError: ``rank`` is not in ``0 .. world_size - 1``.
    """
    world = pc.world_size
    if not 0 <= rank < world:
        raise ValueError(
            f"--rank {rank} is not valid: the layout tp={pc.tp} pp={pc.pp} cp={pc.cp} dp={pc.dp} has "
            f"{world} ranks (0 .. {world - 1}), or 'worst'."
        )
    tp_i = rank % pc.tp
    cp_i = rank // pc.tp % pc.cp
    dp_i = rank // (pc.tp * pc.cp) % pc.dp
    pp_i = rank // (pc.tp * pc.cp * pc.dp)
    return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "dp_cp": dp_i * pc.cp + cp_i}


def worst_rank(workload: Workload, pc: ParallelConfig, device_type: str = "cuda") -> int:
    """The global rank (dp, cp and tp coordinates 0: rank 0 of ``dp_cp`` holds the largest ZeRO shard) of the pp
    rank whose estimated peak is the largest for ``workload``
    (:func:`~lightning_4d.planning.model.estimate_all_pp_ranks`; its ``expert_load_imbalance`` as :func:`measure_rank`
    takes it)."""
    estimates = estimate_all_pp_ranks(workload, pc, device_type=device_type)
    pp_rank = max(range(pc.pp), key=lambda r: estimates[r].total)
    return pp_rank * pc.dp * pc.cp * pc.tp


# ---------------------------------------------------------------------------------------------------- CPU tracker
def _storages(t: torch.Tensor) -> list:
    """The storages behind ``t``: a wrapper subclass (DTensor, ...) has none of its own; its inner tensors do."""
    if is_traceable_wrapper_subclass(t):
        return [st for x in inner_tensors(t) if torch.is_tensor(x) for st in _storages(x)]
    return [t.untyped_storage()]


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the storages on ``device_type`` alive at once, and their peak, while the mode is entered.

    Every ATen op's outputs are seen (a storage counted once, from its first appearance until Python frees it:
    ``weakref.finalize``); ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its unsharded parameters that
    way, outside any op) is followed while the mode is entered. Storages alive before the mode are not counted:
    enter it before anything of the run is allocated.

    ``torch.compile`` runs under it: the mode ignores compile internals (``ignore_compile_internals``: Dynamo skips
    every frame while a mode without it is entered, so compiled layers would run eagerly), it is off while Dynamo
    traces and on while the compiled graphs run, seeing the ops they dispatch (``mm.out``, the collectives), and the
    buffers inductor's CPU code allocates without any op are counted from their allocation
    (:func:`~lightning_4d.parallel._compat.compile.inductor_cpu_buffers`). A compiled layer's peak is then its own
    (fused kernels keep fewer intermediates than eager ops), not the eager peak the estimate models.

    Host and device on one CPU (``optimizer_offload``): a storage made inside
    :func:`lightning_4d.parallel.optimizer_offload.host_allocations`, or named by :meth:`mark_host` at any time of
    its life, is host memory; :meth:`split_peaks` replays every change to give the device's peak without them and
    the host's peak of them alone.

    Attributes:
        current: bytes alive now.
        peak: the largest ``current`` seen (bytes), host storages included.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._sizes: Any = WeakIdKeyDictionary()  # storage -> [bytes, key]
        self._resize: Any = None
        self._events: list[tuple[int, int]] = []  # (key of the storage, change of its bytes), in order
        self._host: set[int] = set()  # keys of the host storages
        self._buffers: Any = None  # inductor_cpu_buffers while entered

    def _add(self, delta: int, key: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)
        self._events.append((key, delta))

    def _release(self, holder: list) -> None:
        self.current -= holder[0]
        self._events.append((holder[1], -holder[0]))

    def track(self, st: Any) -> None:
        """Count storage ``st`` (once) until it is freed."""
        from lightning_4d.parallel.optimizer_offload import allocating_on_host

        if st.device.type != self.device_type or st in self._sizes:
            return
        holder = [st.nbytes(), len(self._events)]  # the key: one event per storage tracked, so unique
        self._sizes[st] = holder
        if allocating_on_host():
            self._host.add(holder[1])
        weakref.finalize(st, self._release, holder)
        self._add(holder[0], holder[1])

    def mark_host(self, tensors: Iterable[Optional[Tensor]]) -> None:
        """The storages of ``tensors`` (their local shards) are host memory for their whole life."""
        for t in _wrapped_leaves(tensors):
            holder = self._sizes.get(t.untyped_storage())
            if holder is not None:
                self._host.add(holder[1])

    def split_peaks(self) -> tuple[int, int]:
        """``(device peak, host peak)``: the largest bytes alive at once of the storages that are not host memory,
        and of those that are (each replayed from the start)."""
        device = host = device_peak = host_peak = 0
        for key, delta in self._events:
            if key in self._host:
                host += delta
                host_peak = max(host_peak, host)
            else:
                device += delta
                device_peak = max(device_peak, device)
        return device_peak, host_peak

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """``True``: Dynamo compiles while the mode is entered (class docstring)."""
        return True

    def __enter__(self) -> "LiveTensorBytes":
        from lightning_4d.parallel._compat.compile import inductor_cpu_buffers

        self._buffers = inductor_cpu_buffers(lambda t: self.track(t.untyped_storage()))
        self._buffers.__enter__()
        resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: Any, size: int) -> Any:
            out = resize(st, size)
            holder = tracker._sizes.get(st)
            if holder is None:
                tracker.track(st)
            else:
                tracker._add(size - holder[0], holder[1])
                holder[0] = size
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        self._buffers.__exit__(None, None, None)
        return super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t):
                for st in _storages(t):
                    self.track(st)
        return out


# ---------------------------------------------------------------------------------------------------- the run
def _strategy_class() -> type:
    from lightning_4d.features.pipeline.runtime import PIPELINE_COMM_TORCH_DTYPES
    from lightning_4d.strategy import FourDStrategy

    class MeasureStrategy(FourDStrategy):
        """FourDStrategy for one rank on a fake process group (module docstring: what differs and why)."""

        micro_batch_size: int = 1
        seq_length: int = 1
        expert_rows: int = 0  # rows this rank's experts receive per MoE layer (received_rows)
        dispatches: tuple = ()  # the expert dispatches of the rank's model (ExpertDispatch), read after the fit
        _answered: Any = None

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return obj  # every rank computes the same object; the fake group carries none

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            self._answered = [self._answer_pipeline(), self._answer_experts()]
            for ctx in self._answered:
                ctx.__enter__()

        def _answer_pipeline(self) -> Any:
            """The stages' neighbour metadata, from the layout (module docstring)."""
            from lightning_4d.parallel._compat.fake import answer_pipeline_metadata

            if self.pipeline is None:
                return contextlib.nullcontext()
            pc = self.parallel_config
            chunk = self.pipeline.stages[0].submod
            comm = pc.pipeline_comm_dtype
            if comm == "float8":
                raise ValueError("measure does not model the float8 pipeline wire (pipeline_comm_dtype='float8').")
            dtype = PIPELINE_COMM_TORCH_DTYPES[comm] if comm else (self.compute_dtype or torch.float32)
            boundary = torch.empty(
                self.micro_batch_size,
                self.seq_length // pc.cp // chunk.sequence_shards,
                chunk.hidden_size,
                dtype=dtype,
                device="meta",
            )
            return answer_pipeline_metadata(self.pipeline.stages, boundary)

        def _answer_experts(self) -> Any:
            """The expert dispatch's count exchange answered with ``expert_rows`` received rows (module docstring)."""
            context, self.dispatches = moe.answer_count_exchange(self.model, self.expert_rows)
            return context

        def teardown(self) -> None:
            for ctx in reversed(self._answered or []):
                ctx.__exit__(None, None, None)
            self._answered = None
            super().teardown()

    return MeasureStrategy


def _environment(world_size: int, rank: int) -> Any:
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class OneRank(ClusterEnvironment):
        """Rank ``rank`` of ``world_size``, in this process (the process group exists before the Trainer)."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "localhost"

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return True

        def world_size(self) -> int:
            return world_size

        def set_world_size(self, size: int) -> None:
            pass

        def global_rank(self) -> int:
            return rank

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return 0

        def node_rank(self) -> int:
            return 0

    return OneRank()


def fit_and_measure(
    workload: Workload,
    pc: ParallelConfig,
    steps: int = 2,
    device: str = "cpu",
    strategy: Any = None,
    trainer_kwargs: Any = None,
    callbacks: Optional[list] = None,
    compile: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of :class:`~lightning_4d.tasks.CausalLMModule` on synthetic tokens of
    ``workload``'s shape (its model, micro-batch size, sequence length and precision) under ``strategy`` (default: a
    :class:`~lightning_4d.FourDStrategy` of ``pc``) and return the bytes this rank held.

    The process group must exist (a fake one, or a real one under ``torchrun``) unless the layout has one rank.
    ``trainer_kwargs`` override the Trainer's arguments (default ``devices=1, num_nodes=world_size``: one process
    per rank; under ``torchrun --nproc-per-node N`` pass ``devices=N, num_nodes=1``); ``callbacks`` are added to
    the Trainer's (the smoke matrix's checks, :mod:`lightning_4d.support`); ``compile``: the default strategy's
    ``compile``.

    Returns:
        ``{"peak_allocated": bytes, "peak_reserved": bytes (CUDA; None on CPU), "parameters", "gradients",
        "optimizer_states", "master_weights", "host", "host_peak", "host_offloaded"}`` (bytes; with
        ``optimizer_offload`` the model-state kinds are the device's, ``host`` the host's model states and
        ``host_peak`` the most host memory the run held at once (on CPU: :meth:`LiveTensorBytes.split_peaks`, the
        peak is then the device storages'; on CUDA the host model states); the optimizer states include the master
        weights and PowerSGD's state, as :class:`~lightning_4d.planning.model.ModelStates` counts them;
        ``host_offloaded``: the most host memory ``activation_offload_layers`` held at once during the run;
        ``cuda_library``: on CUDA, the bytes allocated before the fit once CUDA's libraries have run
        (:func:`cuda_library_bytes`: their workspaces; alive through the fit, so inside the peak; 0 on CPU);
        ``compiled_graphs``: the graphs Dynamo compiled during the fit
        (:func:`~lightning_4d.parallel._compat.compile.compiled_graph_count`; 0 when nothing ran compiled)).
    """
    from lightning_4d.strategy import FourDStrategy

    states: dict[str, int] = {}
    if strategy is None:
        strategy = FourDStrategy(**strategy_kwargs(pc, compile), memory_check=False)
    cuda = device == "cuda"
    tracker = LiveTensorBytes("cpu") if not cuda else contextlib.nullcontext()
    library = 0
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        library = cuda_library_bytes()
        torch.cuda.reset_peak_memory_stats()
    graphs = compiled_graph_count()
    with tracker:
        offload = pc.optimizer_offload
        callbacks = [_state_bytes_callback(states, tracker if not cuda else None, offload), *(callbacks or [])]
        _fit(workload, pc, steps, device, {"strategy": strategy, "callbacks": callbacks, **(trainer_kwargs or {})})
    out = _peaks(None if cuda else tracker, pc.optimizer_offload)
    out.update(states)
    out.setdefault("host_peak", out.get("host", 0))  # CUDA: the host model states' bytes
    layout = layout_strategy(strategy)
    out["host_offloaded"] = layout.offload_stats.peak if layout is not None else 0
    out["cuda_library"] = library
    out["compiled_graphs"] = compiled_graph_count() - graphs
    gc.collect()
    return out


def _offloaded_state_tensors(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[Tensor],
    compression: list[Tensor],
    optimizers: Iterable[Any],
) -> dict[str, list[Tensor]]:
    """:func:`model_state_tensors` under ``optimizer_offload``: what lives on the host under ``"host"`` (the
    optimizer's ``states``, a ``ShardedOptimizer``'s host copies and host gradients, the parameters FSDP2 owns with
    their gradients), the other kinds the device's."""
    from lightning_4d.parallel.fsdp import reduced_by_fsdp
    from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, unwrap_optimizer

    hosted = [
        t
        for optimizer in optimizers
        if (so := ShardedOptimizer.of(unwrap_optimizer(optimizer))) is not None
        for t in so.host_tensors()
    ]
    fsdp = [p for p in params if reduced_by_fsdp(p)]
    in_fsdp = {id(p) for p in fsdp}
    return {
        "parameters": [p for p in params if id(p) not in in_fsdp],
        "gradients": [g for g in grads if all(g is not p.grad for p in fsdp)],
        "optimizer_states": compression,
        "master_weights": [],
        "compression": compression,
        "host": states + hosted + fsdp + [p.grad for p in fsdp],
    }


def _peaks(tracker: Optional["LiveTensorBytes"], optimizer_offload: bool) -> dict[str, Any]:
    """The peaks of :func:`fit_and_measure`'s run: CUDA's allocator statistics (``tracker`` ``None``), else the
    CPU tracker's, the host storages apart under ``optimizer_offload`` (host and device are one memory here)."""
    if tracker is None:
        torch.cuda.synchronize()
        return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
    if optimizer_offload:
        device_peak, host_peak = tracker.split_peaks()
        return {"peak_allocated": device_peak, "peak_reserved": None, "host_peak": host_peak}
    return {"peak_allocated": tracker.peak, "peak_reserved": None}


def _fit(work: Workload, pc: ParallelConfig, steps: int, device: str, trainer_kwargs: dict[str, Any]) -> None:
    """:func:`fit_and_measure`'s fit: a fresh :class:`~lightning_4d.tasks.CausalLMModule` of ``work.model`` trained
    ``steps`` steps on synthetic tokens by a Trainer of one process per rank (``trainer_kwargs`` override its
    arguments: the strategy and callbacks among them); the module and the Trainer are freed on return."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_4d.tasks import CausalLMModule

    model_config = work.model
    masking = {"document_masking": True, "eos_token_id": 0} if work.document_masking else {}
    module = CausalLMModule(model_config, learning_rate=1e-4, warmup_steps=1, max_steps=steps, **masking)
    kwargs = dict(
        accelerator=device,
        devices=1,
        num_nodes=pc.world_size,
        precision=work.precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer = L.Trainer(**{**kwargs, **trainer_kwargs})
    batch = work.micro_batch_size * (pc.microbatches if pc.pp > 1 else 1)
    tokens = _synthetic_tokens(model_config.vocab_size, batch, work.seq_length, steps, work.document_tokens)
    trainer.fit(module, DataLoader(tokens, batch_size=None))
    del trainer, module


def _synthetic_tokens(vocab: int, batch: int, seq_length: int, steps: int, document_tokens: Optional[int]) -> Any:
    """An iterable dataset of ``steps`` batches ``{"input_ids", "labels"}`` ``[batch, seq_length]`` of random token
    ids below ``vocab`` (seeded), the labels the inputs shifted by one; with ``document_tokens`` the ids from 1 up
    and an EOS (0) ending every ``document_tokens`` tokens (document masking's documents)."""
    from torch.utils.data import IterableDataset

    class Tokens(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(steps):
                ids = torch.randint(0 if document_tokens is None else 1, vocab, (batch, seq_length + 1), generator=g)
                if document_tokens is not None:
                    ids[:, document_tokens - 1 :: document_tokens] = 0
                yield {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    return Tokens()


def _gradient_buckets(trainer: Any) -> Any:
    """The gradient buckets of ``trainer``'s strategy (:attr:`~lightning_4d.contract.LayoutStrategy.gradient_buckets`)
    or ``None`` (none, or not a ``FourDStrategy``)."""
    layout = layout_strategy(trainer.strategy)
    return layout.gradient_buckets if layout is not None else None


def _state_bytes_callback(states: dict[str, int], tracker: Any = None, offload: bool = False) -> Any:
    """A Lightning callback that fills ``states`` with this rank's model-state bytes (:func:`model_state_tensors`,
    :func:`local_bytes`) once: ``parameters`` and ``gradients`` before the first optimizer step,
    ``optimizer_states`` (with the master weights and PowerSGD's state, as the estimate counts them) and
    ``master_weights`` after the first batch. With ``offload`` (``optimizer_offload``) the device's kinds and
    ``host`` (:func:`model_state_tensors`), and the host tensors marked as such in the CPU ``tracker`` (at every
    step: FSDP2 makes new gradient shards each step)."""
    import lightning as L

    class StateBytes(L.Callback):
        @staticmethod
        def tensors(trainer: Any, module: Any) -> dict[str, list[Tensor]]:  # the host storages marked as such
            t = model_state_tensors(module, trainer.optimizers, _gradient_buckets(trainer), offload)
            if tracker is not None and offload:
                tracker.mark_host(t["host"])
            return t

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            t = self.tensors(trainer, module)
            if "parameters" not in states:
                states["parameters"] = local_bytes(t["parameters"])
                states["gradients"] = local_bytes(t["gradients"])

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            t = self.tensors(trainer, module)
            if "optimizer_states" not in states:
                states["optimizer_states"] = local_bytes(t["optimizer_states"])
                states["master_weights"] = local_bytes(t["master_weights"])
                states["host"] = local_bytes(t["host"])

    return StateBytes()


def cuda_library_bytes(dtypes: tuple = (torch.float32, torch.bfloat16)) -> int:
    """The bytes allocated on the CUDA device once CUDA's libraries have run: a matmul with its backward in each of
    ``dtypes`` is run and every tensor of it freed, then ``torch.cuda.memory_allocated()`` is returned. What stays
    is what the libraries keep through PyTorch's caching allocator for the life of the process (cuBLAS / cuBLASLt
    workspaces, one per handle and stream: about 70 MiB above the estimate on the small presets, docs/validation.md),
    plus anything else still allocated in this process (nothing in a fresh one). A peak measured afterwards includes
    these bytes; the estimate does not.
    """
    for dtype in dtypes:
        a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
        del a
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def strategy_kwargs(pc: ParallelConfig, compile: bool = False) -> dict[str, Any]:
    """FourDStrategy's layout arguments for ``pc`` (every field of :data:`lightning_4d.layout.LAYOUT_FIELDS`), dp
    resolved; ``compile`` on when ``pc`` or the caller asks for it."""
    return dict(config_kwargs(vars(pc)), data_parallel_size=pc.dp, compile=pc.compile or compile)


def measure_rank(
    workload: Workload,
    pc: ParallelConfig,
    rank: int,
    steps: int = 2,
    device: str = "cpu",
    compile: bool = False,
    callbacks: Optional[list] = None,
) -> dict[str, Any]:
    """Rank ``rank`` of layout ``pc`` trained for ``steps`` steps in this process on a fake process group, measured
    (:func:`fit_and_measure`) beside :func:`~lightning_4d.planning.model.estimate_memory` of its pp rank and
    ``dp_cp`` rank (without the overhead allowance: the allocator does not see the CUDA context).

    Args:
        workload: the model (a :class:`~lightning_4d.models.LlamaConfig`), b, s (tokens, before cp splits it),
            Lightning's precision flag and ``expert_load_imbalance``: under expert parallelism, the load the rank's
            experts receive, over the balanced figure (>= 1; ``None``: the estimate's default): the fake group's
            count exchange answers it (:func:`received_rows`) and the estimate assumes it. Its
            ``num_microbatches`` is not read (the layout's are run).
        pc: a resolved layout (``dp`` an int), validated against the model and the sequence length.
        rank: the global rank, ``0 .. world_size - 1``.
        steps: optimizer steps (>= 2: the first step allocates the optimizer states).
        device: ``"cpu"`` or ``"cuda"``.
        compile: ``torch.compile`` each decoder layer (``FourDStrategy(compile=True)``).
        callbacks: Lightning callbacks added to the run (:mod:`lightning_4d.support`'s smoke checks).

    Returns:
        ``{"rank", "coordinates", "measured": fit_and_measure's dict + "received_rows" (the most rows an MoE layer's
        experts ran in its last exchange, as ``ExpertDispatch`` counted them), "estimate": MemoryEstimate.to_dict(),
        "expert_rows": the rows stated per MoE layer (:func:`received_rows`; 0 without ep)}``.

    Raises:
        ValueError: a rank outside the world, ``steps`` < 1, an unknown device, CUDA asked for but absent, an
            ``expert_load_imbalance`` below 1; layout errors come from ``ParallelConfig`` before this is called.
        RuntimeError: a process group already exists in this process; compile asked for and Dynamo compiled no
            graph during the fit (Dynamo's caches are cleared first, so a compiled run compiles its graphs anew).
    """
    coords = _check_measure_args(pc, rank, steps, device)
    imbalance = check_expert_load_imbalance(workload.expert_load_imbalance)
    work = replace(workload, num_microbatches=pc.microbatches, expert_load_imbalance=imbalance)
    estimate = _rank_estimate(work, pc, coords, device)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    compiled = compile or pc.compile
    if compiled:
        torch.compiler.reset()  # the graphs of an earlier run in this process would be reused, not counted
    rows = received_rows(work.model, pc, work.micro_batch_size, work.seq_length, imbalance)
    measured, strategy = _fit_on_fake_group(work, pc, rank, steps, device, compile, rows, callbacks)
    if compiled and not measured["compiled_graphs"]:
        raise RuntimeError(
            "compile=True but Dynamo compiled no graph during the fit: the decoder layers ran eagerly (a "
            "TorchDispatchMode without ignore_compile_internals entered around the run disables Dynamo)."
        )
    # the rows the experts ran in the last exchange of each MoE layer, as the dispatch counted them (its split sizes)
    measured["received_rows"] = max((d.received_rows for d in strategy.dispatches), default=0)
    out = {"rank": rank, "coordinates": coords, "measured": measured, "estimate": estimate.to_dict()}
    return {**out, "expert_rows": rows}


def _fit_on_fake_group(
    work: Workload,
    pc: ParallelConfig,
    rank: int,
    steps: int,
    device: str,
    compile: bool,
    rows: int,
    callbacks: Optional[list],
) -> tuple[dict[str, Any], Any]:
    """:func:`fit_and_measure` of rank ``rank`` of layout ``pc`` (``steps``, ``device``, ``compile``) on a fake process
    group made for it and destroyed after, its strategy told the micro-batch, the sequence and the rows its experts
    receive (``rows``, :func:`received_rows`); returns the measured dict and the strategy (its dispatches counted)."""
    import torch.distributed as dist

    from lightning_4d.parallel._compat.fake import init_fake_process_group

    init_fake_process_group(rank, pc.world_size)
    try:
        strategy = _strategy_class()(**strategy_kwargs(pc, compile), memory_check=False, process_group_backend="fake")
        strategy.micro_batch_size, strategy.seq_length = work.micro_batch_size, work.seq_length
        strategy.expert_rows = rows
        env = {"plugins": [_environment(pc.world_size, rank)]}
        measured = fit_and_measure(work, pc, steps, device, strategy=strategy, trainer_kwargs=env, callbacks=callbacks)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return measured, strategy


def _rank_estimate(work: Workload, pc: ParallelConfig, coords: dict, device: str) -> Any:
    """:func:`~lightning_4d.planning.model.estimate_memory` of the rank at ``coords`` (:func:`rank_coordinates`) for
    ``work`` (its expert load given), without the overhead allowance."""
    overhead = OverheadAllowance(0, 0.0, "none")
    return estimate_memory(
        work, pc, pp_rank=coords["pp"], dp_cp_rank=coords["dp_cp"], device_type=device, overhead=overhead
    )


def _check_measure_args(pc: ParallelConfig, rank: int, steps: int, device: str) -> dict[str, int]:
    """:func:`measure_rank`'s checks before anything is allocated; returns :func:`rank_coordinates`."""
    import torch.distributed as dist

    coords = rank_coordinates(pc, rank)
    if steps < 1:
        raise ValueError(f"--steps {steps} is not valid: expected an integer >= 1.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not valid: expected cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu).")
    if dist.is_initialized():
        raise RuntimeError("measure needs a process of its own: a process group is already initialized.")
    return coords


# ---------------------------------------------------------------------------------------------------- the command
#: the layout fields ``measure --json`` reports, by the names of :func:`~lightning_4d.layout.reported_layout` (the
#: resolved values), in its order; then ``compile``
REPORTED_LAYOUT = (
    "tp",
    "pp",
    "cp",
    "dp",
    "zero_stage",
    "data_parallel_replicate_size",
    "sequence_parallel",
    "activation_checkpointing",
    "activation_offload_layers",
    "pipeline_schedule",
    "num_microbatches",
    "virtual_pipeline_stages",
    "expert_parallel_size",
    "optimizer_offload",
)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.formula != "lightning_4d":
        raise ValueError(
            f"--formula {args.formula}: measure compares with this package's estimate (lightning_4d) only."
        )
    cfg = load_model_config(args.model)
    pc, _ = layout_from_args(args, cfg)
    pc.validate_sequence(args.seq_length)
    pc.validate_float8_tokens(args.seq_length, args.micro_batch_size)
    pc.validate_microbatches(pc.microbatches)
    work = workload_from_args(args, cfg)
    rank = args.rank
    if rank == "worst":
        rank = worst_rank(work, pc, device_type=args.device)
    out = measure_rank(work, pc, rank, steps=args.steps, device=args.device, compile=args.compile)
    got, layout = out["measured"], reported_layout(pc)
    rows = _comparison_rows(out["estimate"], got, args.device)
    out.update(
        model=args.model,
        device=args.device,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        precision=args.precision,
        steps=args.steps,
        layout=dict({k: layout[k] for k in REPORTED_LAYOUT}, compile=args.compile),
        rows=[
            {"component": k, "estimated": e, "measured": g, "ratio": (e / g) if g and e is not None else None}
            for k, e, g in rows
        ],
    )
    if args.device == "cuda":
        out["fragmentation"] = got["peak_reserved"] / got["peak_allocated"] - 1
    return out


def _comparison_rows(est: dict[str, Any], got: dict[str, Any], device: str) -> list[tuple]:
    """``(component, estimated bytes, measured bytes)`` rows of ``measure``'s table: the model states, the rest of
    the peak, the peak, and on CUDA the libraries' workspaces (allocated before the fit and inside its peak)."""
    states = {k: got.get(k) for k in ("parameters", "gradients", "optimizer_states")}
    est_rest = est["total"] - est["parameters"] - est["optimizer_states"]
    got_rest = got["peak_allocated"] - states["parameters"] - states["optimizer_states"]
    rows = [(k, est[k], states[k]) for k in states]
    rows += [
        ("peak - parameters - optimizer states", est_rest, got_rest),
        ("total (peak)", est["total"], got["peak_allocated"]),
    ]
    if device == "cuda":  # CUDA's libraries' workspaces, allocated before the fit and inside its peak
        library = got.get("cuda_library", 0)
        rows += [
            ("CUDA library workspaces (measured before the fit; not estimated)", None, library),
            ("total (peak) with the library workspaces", est["total"] + library, got["peak_allocated"]),
        ]
    if est.get("host"):  # optimizer_offload: the host's model states and the host's peak
        rows += [
            ("host: model states", est["details"]["host_model_states"], got.get("host", 0)),
            ("host: peak", est["host"], got.get("host_peak", 0)),
        ]
    return rows


def _print(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    lay, c = out["layout"], out["coordinates"]
    table = Table(
        title=f"{out['model']} rank {out['rank']} (pp {c['pp']}, dp {c['dp']}, cp {c['cp']}, tp {c['tp']}) "
        f"of tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} dp={lay['dp']} ZeRO {lay['zero_stage']} "
        + (f"HSDP={lay['data_parallel_replicate_size']}x " if lay["data_parallel_replicate_size"] > 1 else "")
        + f"b={out['micro_batch_size']} s={out['seq_length']} {out['precision']} "
        f"checkpointing={lay['activation_checkpointing']} on {out['device']}"
    )
    for col in ("component", "estimated GiB", "measured GiB", "estimated / measured"):
        table.add_column(col, justify="right" if col != "component" else "left")
    for r in out["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        est = "-" if r["estimated"] is None else f"{r['estimated'] / GIB:.3f}"
        table.add_row(r["component"], est, f"{r['measured'] / GIB:.3f}", ratio)
    console = Console(width=max(Console().width, 150))
    console.print(table)
    got = out["measured"]
    if out["device"] == "cuda":
        console.print(
            f"CUDA allocator: max allocated {got['peak_allocated'] / GIB:.3f} GiB, max reserved "
            f"{got['peak_reserved'] / GIB:.3f} GiB (fragmentation {100 * out['fragmentation']:.1f}%)."
        )
    else:
        console.print("CPU: the peak of live tensor bytes (lightning_4d.measure.LiveTensorBytes).")
    if out["layout"].get("compile"):
        console.print(
            f"compile: Dynamo compiled {got['compiled_graphs']} graph(s) during the run (the layers ran compiled; "
            "a compiled layer's peak is its fused kernels', the estimate models the eager one)."
        )
    console.print(
        "The collectives of the fake process group carry no data: losses are meaningless, memory is real. "
        "Estimated = estimate without the overhead allowance (CUDA context, fragmentation)."
    )


def main(argv: list[str]) -> int:
    """``lightning-4d measure`` with ``argv`` (options: ``lightning-4d measure --help``); returns the exit code (0
    measured, 2 bad input: the one-line error ``estimate`` gives for the same layout)."""
    args = command_parser("measure").parse_args(argv)
    try:
        out = _run(args)
    except ValueError as err:
        print(f"lightning-4d measure: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        _print(out)
    return 0


# ---------------------------------------------------------------------------------------------------- byte counts
def local_bytes(tensors: Iterable[Optional[Tensor]]) -> int:
    """Bytes held on this rank by ``tensors`` (the local shard of a DTensor; ``None`` counts 0).

    A tensor seen twice (same data pointer and size, e.g. a tied weight) is counted once. A wrapper tensor subclass
    (torchao's float8 weight under FSDP2, ``WeightWithDynamicFloat8CastTensor``: no storage of its own, its data
    pointer 0) counts the tensors it wraps (``__tensor_flatten__``).
    """
    seen: set = set()
    total = 0
    for t in _wrapped_leaves(tensors):
        key = (t.data_ptr(), t.numel()) if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _wrapped_leaves(tensors: Iterable[Optional[Tensor]]) -> Iterable[Tensor]:
    """The tensors of ``tensors`` that hold storage: a DTensor's local shard, a wrapper subclass's inner tensors
    (``__tensor_flatten__``), recursively; ``None`` skipped."""
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) and is_traceable_wrapper_subclass(t):
            yield from _wrapped_leaves(inner_tensors(t))
        else:
            yield t


def model_state_tensors(
    model: nn.Module, optimizers: Iterable[Any], buckets: Optional[GradientBuckets], offload: bool = False
) -> dict[str, list[Tensor]]:
    """The tensors behind one rank's model states, by kind, for byte counts (:func:`local_bytes`) against the memory
    model (``lightning_4d.planning.model.model_state_bytes``).

    Returns ``{"parameters": [...], "gradients": [...], "optimizer_states": [...], "master_weights": [...],
    "compression": [...]}``: the
    parameters (the local
    shards), the gradients (each parameter's slice of its bucket at ZeRO 0/1, padding excluded, for the buckets that
    exist: from the first gradient to the end of the optimizer step; ``.grad`` otherwise)
    and the optimizer states (every tensor state of at least one dimension, e.g. Adam's m and v, plus the master
    weights of :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` and
    PowerSGD's error-feedback and warm-start matrices).

    With ``offload`` (``optimizer_offload``) what lives on the host is under ``"host"`` and nowhere else: the
    optimizer's states, a ``ShardedOptimizer``'s host copies and host gradients (ZeRO 1), and the parameters FSDP2
    owns with their gradients (ZeRO 2/3, ``CPUOffloadPolicy``); the other kinds are then the device's.
    """
    from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, unwrap_optimizer

    params = list(model.parameters())
    in_buckets = set() if buckets is None else {id(p) for p in buckets.params}
    grads = buckets.existing_grads() if buckets is not None else []
    grads += [p.grad for p in params if id(p) not in in_buckets and p.grad is not None]
    states: list[Tensor] = []
    masters: list[Tensor] = []
    for optimizer in optimizers:
        torch_opt = unwrap_optimizer(optimizer)
        states += [v for st in torch_opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.ndim > 0]
        sharded = ShardedOptimizer.of(torch_opt)
        if sharded is not None:
            masters += sharded.master_tensors()
    # PowerSGD's error feedback and warm start: persistent state, counted with the optimizer's
    compression = buckets.powersgd.tensors() if buckets is not None and buckets.powersgd is not None else []
    if offload:
        return _offloaded_state_tensors(params, grads, states, compression, optimizers)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer_states": states + masters + compression,
        "master_weights": masters,
        "compression": compression,
        "host": [],
    }
