"""Pipeline parallelism for every model family (:mod:`lightning_4d.families`): all of it lives in this file.

**Layout** (pure facts, in :class:`~lightning_4d.config.ParallelConfig`, shared with the memory model): a model of
``L`` decoder layers is cut into ``p·v`` stages (``p`` = pipeline_parallel_size, ``v`` = stages per pp rank);
stage ``k`` holds the layers :meth:`~lightning_4d.config.ParallelConfig.stage_layer_ranges` gives (equal, or
``pipeline_layer_split``), the first stage also the token embedding, the last also the final norm and the LM head;
pp rank ``r`` holds the stages of :meth:`~lightning_4d.config.ParallelConfig.stage_indices` (looped ``r, r+p, ...``
or V-shaped ``r, 2p-1-r``).

**Split** (:func:`split_model`, one splitter for every family, torchtitan's shape): on each rank the LightningModule
keeps ONE model (the *union*), pruned to the layers of the rank's stages, so parameter names stay those of the unsplit
model (``layers.17.attention.wq.weight``) and distributed checkpoints keep one naming on every layout. The family says
where the embedding, layers, norm and head are (:meth:`~lightning_4d.families.base.ModelFamily.pipeline_layout`). Each
stage is a :class:`StageChunk` holding the union's own modules (shared, not copied) and asking the family how to run
them; FSDP2 and ``torch.distributed.pipelining.PipelineStage`` work on chunks, and the union's ``to`` / ``to_empty``
go through them.

**Micro-batches** (:func:`resolve_num_microbatches`): m is ``num_microbatches``, else the DataModule's
``global_batch_size / (micro_batch_size · dp)`` (read once by the strategy:
:class:`~lightning_4d.contract.TrainingInputs`), else the schedule's default; checked before the process group
exists. The DataLoader batch of a dp rank holds ``micro_batch_size · m`` sequences (``LMDataModule`` asks the
strategy's ``num_microbatches``, :class:`~lightning_4d.contract.MicroBatchingStrategy`); the schedule splits it.

**Step** (:class:`PipelineRunner`): schedules come from ``torch.distributed.pipelining`` (GPipe, 1F1B,
Interleaved1F1B, ZBVZeroBubble, DualPipeV) and run inside ``training_step``; the loss of each micro-batch is divided by
``m`` inside the loss function (``scale_grads=False``), so the accumulated gradients are those of the mean loss over
the ``m`` micro-batches, exactly as one process computing the mean over the whole batch (all micro-batches have the
same number of tokens). Lightning zeroes gradients between ``training_step`` and ``backward``, so the schedule's
gradients are stashed and restored by the strategy's ``backward`` (:meth:`PipelineRunner.restore_gradients`).

**Tied embeddings** (:class:`TiedEmbedding`, Megatron-Core's embedding group): the last stage holds its own copy of
a tied embedding as the LM head's weight (on a V schedule's rank 0 under ZeRO 2/3 too, :func:`split_model`; at ZeRO
0/1 that rank keeps the one tied weight), initialized equal; the two copies' gradients are summed after the
schedule, before clipping, which counts the weight once.

**Clipping** under pp: the one :func:`lightning_4d.parallel.clipping.clip_grad_norm_`, given the pp group (the
strategy's precision plugin, :class:`lightning_4d.precision.FourDPrecision`): the global norm over all shards and all
stages.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_4d.config import ParallelConfig
from lightning_4d.contract import TrainingInputs
from lightning_4d.features.pipeline import SINGLE_STAGE_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from lightning_4d.module_tree import find_submodel, layer_items, own_weight, set_submodel
from lightning_4d.parallel._compat.dtensor import local_tensor
from lightning_4d.parallel._compat.pipeline import reset_schedule_metadata
from lightning_4d.parallel.compression import ReceiveFloat8, SendFloat8


# ---------------------------------------------------------------------------------------------------- split
class _PipelineUnion:
    """Mixed into the class of a pipeline-split model (the *union*; the way FSDP2's ``fully_shard`` swaps a module's
    class): ``nn.Module._apply`` (behind ``to``, ``to_empty``, ``float``, ``cpu``, ...) goes through the stage chunks,
    which are the FSDP2 roots that must see the conversion (they re-point their sharded parameters after it), then
    through the union's modules no chunk holds (a rotary-embedding module, placeholders).

    Why a class swap: the chunks are FSDP2 roots (``PipelineStage`` runs them and manages their gradient sync), yet
    the LightningModule holds the union, and Lightning moves and converts it through ``nn.Module._apply`` on the
    root (``materialize_distributed_module``, ``model_to_device``, the precision plugin's ``convert_module``,
    ``teardown``'s ``cpu()``); torch offers no per-module hook on ``_apply``. Registering the chunks as submodules
    instead would rename every parameter (checkpoints keep the unsplit names)."""

    _pipeline_chunks: list[tuple[int, nn.Module]]

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - signature of nn.Module._apply
        if not recurse:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        shared = _shared_parameters(self)
        for _, chunk in self._pipeline_chunks:
            chunk._apply(fn, recurse)
        owned = {id(m) for _, chunk in self._pipeline_chunks for m in chunk.modules()}
        _apply_outside(self, fn, owned)
        for places in shared:  # moving a plain parameter off the meta device makes one new Parameter per place
            module, name = places[0]
            for other, other_name in places[1:]:
                other._parameters[other_name] = module._parameters[name]
        return self


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The places ``(module, parameter name)`` of every parameter that two modules of ``model`` share (tied
    embeddings on a V schedule's rank 0, whose first and last stage chunks hold the embedding and the head)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def _apply_outside(module: nn.Module, fn: Any, owned: set[int]) -> None:
    """``fn`` on the parameters and buffers of ``module`` and its submodules that are not in ``owned``."""
    nn.Module._apply(module, fn, recurse=False)
    for child in module.children():
        if id(child) in owned:
            continue
        if any(id(m) in owned for m in child.modules()):
            _apply_outside(child, fn, owned)
        else:
            child._apply(fn)


_UNION_CLASSES: dict[type, type] = {}


def _as_union(model: nn.Module, chunks: list[tuple[int, nn.Module]]) -> None:
    cls = type(model)
    if cls not in _UNION_CLASSES:
        _UNION_CLASSES[cls] = type(f"Pipelined{cls.__name__}", (_PipelineUnion, cls), {})
    model.__class__ = _UNION_CLASSES[cls]
    model._pipeline_chunks = chunks  # a second setup (validate after fit) reuses them: see pipeline_chunks()


def pipeline_chunks(model: nn.Module) -> Optional[list[tuple[int, nn.Module]]]:
    """The ``[(stage index, chunk), ...]`` of a model :func:`split_model` has split, else ``None``."""
    return model._pipeline_chunks if isinstance(model, _PipelineUnion) else None


class PrunedLayer(nn.Module):
    """The place of a decoder layer another pipeline rank holds in an ``nn.ModuleList`` (no parameters; keeps the
    indices, so parameter names stay the unsplit model's)."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class StageEnds(NamedTuple):
    """The modules of a pipeline stage beside its decoder layers: the token embedding (the first stage), the final
    norm and the LM head (the last stage); ``None`` where the stage holds none."""

    embedding: Optional[nn.Module]
    norm: Optional[nn.Module]
    head: Optional[nn.Module]


class StageChunk(nn.Module):
    """One pipeline stage of any family's model: its token embedding (first stage), decoder layers, final norm and
    LM head (last stage), the union model's own modules (shared, not copied).

    ``forward(x)``: token ids ``[b, s]`` on the first stage, else the previous stage's hidden states
    ``[b, s / sequence_shards, h]`` (this tp rank's sequence shard under sequence parallelism; this cp rank's zigzag
    shard under cp); returns hidden states, or the head's logits ``[b, s, V]`` on the last stage. The chunk computes
    the positions of its ``s`` tokens itself (``torch.distributed.pipelining`` passes activations only) and asks the
    family (:class:`~lightning_4d.families.base.ModelFamily`) for them (the cp shard's zigzag positions:
    :meth:`~lightning_4d.families.base.ModelFamily.positions`), the rotary embedding, each layer's call and the head.
    """

    #: how the hidden states are sent to the next stage and received from the previous one, with their gradients
    #: (``ParallelConfig.pipeline_comm_dtype``): ``None`` (the model's dtype), ``"bfloat16"`` (cast; autograd casts
    #: the gradient alike) or ``"float8"`` (e4m3 and a per-tensor scale: ``parallel/compression.py``)
    comm_dtype: Optional[str] = None

    def __init__(
        self,
        family: Any,
        model: nn.Module,
        layers: dict[str, nn.Module],
        ends: StageEnds,
        sequence_shards: int,
        cp: tuple[int, int],
        hidden_size: int,
    ) -> None:
        super().__init__()
        self.family = family
        object.__setattr__(self, "union", model)  # not a submodule: the union's parameters keep their own names
        self.embedding = ends.embedding
        self.layers = nn.ModuleDict(layers)
        self.norm = ends.norm
        self.head = ends.head
        self.sequence_shards, self.cp, self.hidden_size = sequence_shards, cp, hidden_size
        #: document masking of the micro-batch being run: ``(positions [b, s_local], document ids [b, s])``, set by
        #: the stage around each micro-batch's forward (:meth:`PipelineRunner.documents_of`), else ``None``
        self.documents: Optional[tuple[Tensor, Tensor]] = None

    def forward(self, x: Tensor) -> Tensor:
        """See the class docstring."""
        if self.embedding is not None:
            s, h = x.shape[1], self.embedding(x)
        else:
            own = next(next(iter(self.layers.values())).parameters()).dtype
            if self.comm_dtype == "float8":  # the float8 wire (parallel/compression.py), decoded
                x = ReceiveFloat8.apply(x, self.hidden_size, own)
            elif self.comm_dtype is not None:  # received in the wire dtype: back to the stage's own
                x = x.to(own)
            s, h = x.shape[1] * self.sequence_shards, x
        documents = None
        if self.documents is not None:  # the micro-batch's own positions and masks (document masking)
            positions, document_ids = self.documents
            documents = self.family.document_inputs(self.union, h, document_ids)
        else:
            positions = self.family.positions(self.union, s, self.cp, x.device)
        rotary = self.family.rotary(self.union, h, positions)
        for layer in self.layers.values():
            h = self.family.run_layer(self.union, layer, h, rotary, positions, documents)
        if self.head is not None:
            return self.family.run_head(self.union, self.head, self.norm(h))
        if self.comm_dtype == "float8":
            return SendFloat8.apply(h)
        if self.comm_dtype is not None:
            return h.to(PIPELINE_COMM_TORCH_DTYPES[self.comm_dtype])  # its gradient comes back in this dtype too
        return h


#: ``ParallelConfig.pipeline_comm_dtype`` -> the torch dtype of the stage-to-stage sends
PIPELINE_COMM_TORCH_DTYPES = {"bfloat16": torch.bfloat16}


def split_model(
    family: Any, model: nn.Module, config: ParallelConfig, pp_rank: int, cp: tuple[int, int] = (0, 1)
) -> list[tuple[int, StageChunk]]:
    """Prune ``model`` (any family's, usually on the meta device) to pp rank ``pp_rank``'s stages, the one splitter
    (torchtitan's ``pipeline_parallel.py`` shape).

    The family says where the parts are (:meth:`~lightning_4d.families.base.ModelFamily.pipeline_layout`). Layers of
    other stages are deleted from an ``nn.ModuleDict`` or replaced by a :class:`PrunedLayer` in an ``nn.ModuleList``
    (either way the kept layers keep their names); the embedding is set to ``None`` unless the rank holds stage 0,
    the final norm and the head unless it holds stage ``p·v - 1``. ``model`` becomes the union of the returned
    chunks (:func:`pipeline_chunks` returns them); ``cp`` is ``(cp rank, cp size)``.

    Returns:
        ``[(stage_index, chunk), ...]`` in the order of :meth:`ParallelConfig.stage_indices`.

    Raises:
        ValueError: the layers cannot be split as configured (see :meth:`ParallelConfig.layer_split`).
    """
    where = family.pipeline_layout(model)
    container = find_submodel(model, where.layers)
    items = layer_items(container)
    mine = config.rank_stages(len(items), pp_rank)
    _prune_layers(container, items, {i for _, layers in mine for i in layers})
    last_stage = config.num_stages - 1
    first, last = any(s == 0 for s, _ in mine), any(s == last_stage for s, _ in mine)
    parts = {
        "embedding": find_submodel(model, where.embedding),
        "norm": find_submodel(model, where.norm),
        "head": find_submodel(model, where.head),
    }
    shards = config.tp if config.sp else 1
    hidden = family.model_config(model).hidden_size
    chunks = [
        (
            s,
            StageChunk(
                family,
                model,
                {items[i][0]: items[i][1] for i in layers},
                _stage_ends(parts, s, last_stage),
                shards,
                cp,
                hidden,
            ),
        )
        for s, layers in mine
    ]
    for _, chunk in chunks:
        chunk.comm_dtype = config.pipeline_comm_dtype
    _prune_ends(model, where, parts, first, last, untie=first and last and config.zero_stage >= 2)
    _as_union(model, chunks)
    return chunks


def _stage_ends(parts: dict[str, Optional[nn.Module]], stage: int, last_stage: int) -> StageEnds:
    """The ends of stage ``stage``: the embedding of ``parts`` on stage 0, the final norm and the head on stage
    ``last_stage``, ``None`` elsewhere."""
    last = stage == last_stage
    return StageEnds(
        parts["embedding"] if stage == 0 else None, parts["norm"] if last else None, parts["head"] if last else None
    )


def _prune_ends(
    model: nn.Module, where: Any, parts: dict[str, Optional[nn.Module]], first: bool, last: bool, untie: bool
) -> None:
    """Set ``model``'s embedding to ``None`` unless this rank holds the ``first`` stage, its final norm and head
    unless it holds the ``last`` one (``where``: the family's pipeline layout; ``parts``: the three modules); with
    ``untie`` (both ends on this rank under ZeRO 2/3) the head gets its own copy of a tied weight
    (:func:`_untie_head`)."""
    if untie:
        _untie_head(parts["embedding"], parts["head"])
    if not first:
        set_submodel(model, where.embedding, None)
    if not last:
        set_submodel(model, where.norm, None)
        set_submodel(model, where.head, None)


def _prune_layers(container: nn.Module, items: list, keep: set[int]) -> None:
    """Drop the decoder layers of ``container`` (``items``: :func:`~lightning_4d.module_tree.layer_items`) not in
    ``keep``: deleted from an ``nn.ModuleDict``, replaced by a :class:`PrunedLayer` in an ``nn.ModuleList`` (the kept
    layers keep their names)."""
    for i, (key, _) in enumerate(items):
        if i in keep:
            continue
        if isinstance(container, nn.ModuleDict):
            del container[key]
        else:
            container[i] = PrunedLayer()


def _untie_head(embedding: Optional[nn.Module], head: Optional[nn.Module]) -> None:
    """Tied embeddings on a V schedule's rank 0 (first and last stage) under ZeRO 2/3: each stage chunk is its own
    FSDP2 root, and two roots cannot share a parameter, so the head gets its own copy, as on any last stage
    (:class:`TiedEmbedding`: initialized equal, gradients summed in place). At ZeRO 0/1 the weight stays truly tied
    (not called)."""
    if own_weight(head) is not None and own_weight(head) is own_weight(embedding):
        head.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=embedding.weight.requires_grad)


class TiedEmbedding:
    """Tied embeddings under pp > 1 (Megatron-Core's *embedding group*): the first stage holds the ``[V, h]`` matrix
    as the embedding's weight, the last stage its own copy as the LM head's weight. Both start equal (the model family
    initializes a tied head under the embedding's name: ``LlamaModel.init_weights``) and stay equal: after backward,
    before clipping and the optimizer step, :meth:`reduce_gradients` sums the two copies' gradients over ``group``
    (the pp ranks holding a copy, at this rank's dp/cp/tp coordinates: :func:`lightning_4d.mesh.embedding_group`),
    so both copies take the same optimizer step on the gradient of the one logical weight. On a V schedule (zbv,
    dualpipev) pp rank 0 holds the first and the last stage (``group`` ``None``): at ZeRO 0/1 the weight stays truly
    tied there (one parameter, whose gradient autograd already sums: nothing to do), at ZeRO 2/3 the rank holds both
    copies (each stage chunk is its own FSDP2 root, and roots cannot share a parameter) and sums their gradients in
    place. Global-norm clipping counts the weight once: a head's copy is left out of the norm (:meth:`norm_excluded`)
    and scaled by the same coefficient.

    The gradients are summed before they are averaged over dp·cp (linear, so the result is the same): the ZeRO 0/1
    buckets hold each rank's un-reduced gradient until the pipeline's single reduction after the schedule
    (``GradientBuckets.synchronize``); FSDP2 (ZeRO 2/3) has reduce-scattered them within the schedule, and the two
    copies' shards are alike (same shape and placements), so the shards are summed.

    Args:
        embedding: returns the embedding's weight on this rank (a first stage), else ``None``.
        head: returns the LM head's weight on this rank (a last stage), else ``None``; the embedding's own weight
            where the two are truly tied (a V schedule's rank 0 at ZeRO 0/1).
        group: the embedding group (``None`` when this rank holds both stages, or neither).

    The parameters are looked up at each use (callables, not tensors): casting and checkpoint loading may replace a
    module's parameter object.
    """

    def __init__(
        self,
        embedding: Callable[[], Optional[Tensor]],
        head: Callable[[], Optional[Tensor]],
        group: Optional[dist.ProcessGroup],
    ) -> None:
        self._embedding, self._head, self.group = embedding, head, group

    @classmethod
    def of(cls, family: Any, model: nn.Module, group: Optional[dist.ProcessGroup]) -> Optional["TiedEmbedding"]:
        """The tied embedding of a pipeline-split ``model`` (:func:`split_model`) whose config ties the embedding and
        the head (``tie_word_embeddings``), holding a copy on this rank; else ``None``."""
        if pipeline_chunks(model) is None or not family.model_config(model).tie_word_embeddings:
            return None
        where = family.pipeline_layout(model)

        def weight(path: str) -> Callable[[], Optional[Tensor]]:
            return lambda: own_weight(find_submodel(model, path))

        tied = cls(weight(where.embedding), weight(where.head), group)
        return tied if tied._embedding() is not None or tied._head() is not None else None

    def norm_excluded(self) -> list[Tensor]:
        """The parameters a global gradient norm leaves out: the head's copy (counted once, as the embedding); none
        where the head's weight is the embedding's (truly tied on a V schedule's rank 0)."""
        head = self._head()
        return [head] if head is not None and head is not self._embedding() else []

    @torch.no_grad()
    def reduce_gradients(self, buckets: Any = None) -> None:
        """Sum the gradients of the copies over the embedding group (or locally), in place.

        Args:
            buckets: the ZeRO 0/1 :class:`~lightning_4d.parallel.grad_buffers.GradientBuckets` holding the gradients
                (called before their ``synchronize``), else ``None`` (the parameters' ``.grad``: a plain tensor or
                the local shard of a DTensor).
        """
        embedding, head = self._embedding(), self._head()
        if embedding is head:  # truly tied on a V schedule's rank 0: autograd summed both uses already
            return
        grads = [self._grad(p, buckets) for p in (embedding, head) if p is not None]
        if self.group is None:  # both copies here (a V schedule's rank 0 under ZeRO 2/3)
            if len(grads) == 2:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
            return
        for g in grads:
            dist.all_reduce(g, group=self.group)

    @staticmethod
    def _grad(p: Tensor, buckets: Any) -> Tensor:
        """``p``'s gradient to sum in place: its slice of the ZeRO 0/1 buckets (zeros when it got none), else its
        ``.grad``'s local tensor (made zeros when it got none)."""
        if buckets is not None:
            return buckets.take_in(p)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return local_tensor(p.grad)


def sync_chunk_layers(model: nn.Module, family: Any) -> None:
    """Point each stage chunk's layers at the union's again, after a step that replaced layers in the union's
    container (activation checkpointing wraps them)."""
    chunks = pipeline_chunks(model)
    if chunks is None:
        return
    current = dict(layer_items(find_submodel(model, family.pipeline_layout(model).layers)))
    for _, chunk in chunks:
        for key in list(chunk.layers.keys()):
            chunk.layers[key] = current[key]


def reshard_after_forward(config: ParallelConfig) -> Optional[bool]:
    """FSDP2's ``reshard_after_forward`` for the stage chunks (``None``: the ZeRO stage's default). Zero-bubble
    schedules run a micro-batch's weight gradients (W) after later forwards: parameters resharded by those forwards
    lose the W pass's unsharded gradients (measured: wrong losses with zbv + ZeRO-3), so their stage-3 parameters stay
    gathered from the first forward to the step's end."""
    return False if config.pp > 1 and config.pipeline_schedule in ZERO_BUBBLE_SCHEDULES else None


# ---------------------------------------------------------------------------------------------------- micro-batches
def resolve_num_microbatches(config: ParallelConfig, inputs: TrainingInputs) -> int:
    """m, the micro-batches per optimizer step when pp > 1, checked before the process group exists; changes nothing
    (the strategy writes m into its resolved config once, in ``setup_environment``).

    m is ``config.num_microbatches`` when given; else ``inputs.global_batch_size / (inputs.micro_batch_size · dp)``
    when the DataModule has both (:class:`~lightning_4d.contract.TrainingInputs`); else
    :attr:`ParallelConfig.default_num_microbatches`.

    Raises:
        ValueError: ``accumulate_grad_batches`` > 1 (the schedule accumulates over its micro-batches), a global
            batch that is not a multiple of ``micro_batch_size · dp``, or an m the schedule cannot run
            (:meth:`ParallelConfig.validate_microbatches`).
    """
    accumulate = inputs.accumulate_grad_batches
    if accumulate != 1:
        raise ValueError(
            f"accumulate_grad_batches={accumulate} is not supported with pipeline_parallel_size={config.pp}: the "
            "pipeline schedule accumulates gradients over its micro-batches. Set accumulate_grad_batches=1 and "
            f"num_microbatches={accumulate * config.microbatches} (or let it follow the DataModule's "
            "global_batch_size)."
        )
    m = config.num_microbatches
    global_batch, micro = inputs.global_batch_size, inputs.micro_batch_size
    per_replica = micro * config.dp if micro is not None else None
    if m is None and global_batch is not None and per_replica:
        if global_batch % per_replica != 0:
            raise ValueError(
                f"global_batch_size={global_batch} is not a multiple of micro_batch_size x dp = {micro} x "
                f"{config.dp} = {per_replica}, so num_microbatches cannot be derived; change the batch sizes or "
                "set num_microbatches."
            )
        m = global_batch // per_replica
    m = config.default_num_microbatches if m is None else m
    config.validate_microbatches(m)
    return m


# ---------------------------------------------------------------------------------------------------- schedules
def _schedule_class(name: str) -> type:
    from torch.distributed import pipelining as pl

    return {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
        "zbv": pl.ScheduleZBVZeroBubble,
        "dualpipev": pl.ScheduleDualPipeV,
    }[name]


def _full(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (``full_tensor()``: a collective over its mesh), or ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _as_plain(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (differentiable), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _nothing() -> None:
    return None


def _ignore(flag: bool) -> None:
    return None


@functools.lru_cache(maxsize=1)
def _stage_class() -> type:
    """:class:`torch.distributed.pipelining.PipelineStage` with a hook before its micro-batch forwards (a subclass:
    the schedule gives no such hook; its metadata inference does not go through ``forward_one_chunk``)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def __init__(self, runner: "PipelineRunner", *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.runner = runner

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self.runner._pending:  # the step's first micro-batch forward on this rank
                self.runner._pending = False
                self.runner.metadata_inference(False)
                self.runner.before_microbatches()
            self.submod.documents = self.runner.documents_of(fwd_chunk_id)
            try:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            finally:
                self.submod.documents = None

    return Stage


#: what a collective raises when the process on the other side is gone or silent: gloo's ``pair.cc`` ("Connection
#: closed by peer", "Connection reset by peer", "Read error", "Socket closed", a write's "Broken pipe"), a timed-out
#: wait (gloo's "Timed out waiting", "Read timeout", "Write timeout", "Application timeout caused pair closure"; NCCL's
#: watchdog: "ran for N milliseconds before timing out"), NCCL's "remote process exited" / aborted communicator.
#: Counted only in an error of ``torch.distributed`` (:class:`torch.distributed.DistError`) or one whose message names
#: gloo or NCCL (:data:`COMMUNICATION_LIBRARIES`), so a user's own "timed out" is not taken for a lost peer.
PEER_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Socket closed",
    "Broken pipe",
    "Timed out",
    "Read timeout",
    "Write timeout",
    "pair closure",
    "before timing out",
    "remote process exited",
    "communicator was aborted",
)

#: the names that mark a message as a communication library's (gloo's messages carry their source path)
COMMUNICATION_LIBRARIES = ("gloo", "NCCL", "nccl", "c10d")


class PipelineStepError(RuntimeError):
    """A pipeline schedule step failed on this rank and ``torch.distributed.pipelining`` gave the error a message whose
    first line is blank (it re-raises a stage's forward or backward error as ``RuntimeError("\\n  [Stage 1] failed to
    run forward: ...")``, so a log showed ``RuntimeError:`` and nothing else). The first line names the rank, its
    stages and the first error of the chain, and says when that was a collective that lost its peer (the rank that
    failed first holds the cause). The original error stays chained (``__cause__``)."""


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (``raise ... from``), outermost first; a cycle ends it."""
    links = [error]
    while links[-1].__cause__ is not None and all(links[-1].__cause__ is not e for e in links):
        links.append(links[-1].__cause__)
    return links


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def _starts_with_its_cause(error: BaseException) -> bool:
    """``error``'s message does not start with a blank line (pipelining's wrapper does)."""
    return bool(str(error).split("\n", 1)[0].strip())


def _lost_peer(error: BaseException) -> bool:
    """``error`` is a collective's that lost its peer (:data:`PEER_FAILURES` in an error of torch.distributed or of
    a communication library)."""
    text = str(error)
    ours = isinstance(error, dist.DistError) or any(name in text for name in COMMUNICATION_LIBRARIES)
    return ours and any(mark in text for mark in PEER_FAILURES)


def describe_step_failure(error: BaseException, where: str) -> Optional[str]:
    """One line that says where a schedule step failed and why, or ``None`` when ``error`` needs none.

    ``where``: the rank and stages (``"pipeline rank 1 of 2 (global rank 7, stages [1, 3])"``). The line names the
    first error of ``error``'s ``__cause__`` chain (the deepest) and, when an error of the chain is
    a collective that lost its peer (:func:`_lost_peer`), adds that another rank most likely failed first. ``None``
    when no error of the chain lost a peer and ``error``'s own first line is not blank (it says what it is).
    Never raises."""
    links = _chain(error)
    lost_peer = any(_lost_peer(e) for e in links)
    if _starts_with_its_cause(error) and not lost_peer:
        return None
    first = links[-1]
    line = f"{where} failed in its schedule step: {type(first).__name__}: {_first_line(first) or '(no message)'}"
    if lost_peer:
        line += (
            " -- a collective lost its peer: another rank most likely failed or stalled first, and that rank's own "
            "error is the cause (the launcher names the first rank to fail)"
        )
    return line


class PipelineRunner:
    """Runs a pipeline schedule over this rank's stages: the training step, the forward-only evaluation step and
    the forward for prediction.

    Args:
        chunks: ``[(stage_index, chunk module), ...]`` of :func:`split_model` / :func:`pipeline_chunks` (already
            tp/FSDP-parallelized and materialized on ``device``).
        config: the resolved layout (``pp``, ``v``, ``pipeline_schedule``, ``num_microbatches``).
        num_microbatches: m.
        pp_group: the pp process group (size p).
        device: the stages' device.
        loss_fn: ``loss_fn(output, target) -> scalar`` mean loss of one micro-batch; ``output`` is the last stage's
            output (logits ``[b/m, s, V]``, a vocabulary-sharded DTensor under tp), ``target`` the labels
            ``[b/m, s]``.

    Raises:
        ValueError: ``num_microbatches`` does not suit the schedule (see :meth:`ParallelConfig.validate_microbatches`).
    """

    def __init__(
        self,
        chunks: list[tuple[int, nn.Module]],
        config: ParallelConfig,
        num_microbatches: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        loss_fn: Callable[[Any, Tensor], Tensor],
    ) -> None:
        config.validate_microbatches(num_microbatches)
        self.config = config
        self.num_microbatches = num_microbatches
        self.pp_group = pp_group
        self.loss_fn = loss_fn
        self.stages = [
            _stage_class()(self, chunk, index, config.num_stages, device, group=pp_group) for index, chunk in chunks
        ]
        #: this rank in words, for the errors of a failed step (:meth:`_named_failure`)
        self.where = (
            f"pipeline rank {dist.get_rank(pp_group)} of {dist.get_world_size(pp_group)} (global rank "
            f"{dist.get_rank()}, stages {[index for index, _ in chunks]})"
        )
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        m = num_microbatches

        def scaled_loss(output: Any, target: Tensor) -> Tensor:
            loss = loss_fn(output, target) / m
            # a replicated DTensor loss (a pipeline_loss on DTensor logits) becomes a plain tensor: the schedule
            # seeds its backward with plain tensors (to_local's backward turns the seed back into a DTensor)
            return loss.to_local() if isinstance(loss, DTensor) else loss

        self._train = self._make(scaled_loss)
        self._predict: Optional[Any] = None
        self._current: Any = self._train
        self._stashed: list[tuple[Tensor, Optional[Tensor]]] = []
        #: called once per :meth:`train_step`, just before the first micro-batch's forward on this rank (after the
        #: schedule's metadata inference, which at the first step runs a forward of every stage, with gradients, on
        #: placeholder activations): where a forward's side records are cleared (``CausalLMModule`` starts the
        #: MoE layers' mean load-balancing loss there)
        self.before_microbatches: Callable[[], None] = _nothing
        #: called with True when a schedule step begins and with False just before its first micro-batch forward
        #: on this rank: between the two, the schedule's metadata inference (at a schedule's first step) runs each
        #: stage's forward on placeholder activations. ``CausalLMModule`` makes its MoE layers pass their input
        #: through there: their collectives across pipelines (the ep all-to-alls, the routing counts' all-reduce
        #: over dp·cp) would otherwise meet the peer pipeline at another point of its inference (a deadlock at the
        #: first step, measured under pp2 x dp2 x ep2), and the values computed there are never used
        self.metadata_inference: Callable[[bool], None] = _ignore
        self._pending = False
        #: document masking of the step being run: per micro-batch ``(positions, document ids)`` (:meth:`documents_of`)
        self._documents: Optional[list[tuple[Tensor, Tensor]]] = None
        #: a context a backward whose gradients are discarded runs in (the strategy sets the ZeRO 0/1 buckets'
        #: ``suspended``, so that an evaluation run's gradients never reach them)
        self.gradient_guard: Callable[[], Any] = nullcontext

    def _make(self, loss_fn: Optional[Callable]) -> Any:
        cls = _schedule_class(self.config.pipeline_schedule)
        stages: Any = self.stages[0] if self.config.pipeline_schedule in SINGLE_STAGE_SCHEDULES else self.stages
        return cls(stages, n_microbatches=self.num_microbatches, loss_fn=loss_fn, scale_grads=False)

    def _use(self, schedule: Any) -> Any:
        if schedule is not self._current:
            reset_schedule_metadata(schedule)  # another schedule's receive buffers are in the stages
            self._current = schedule
        return schedule

    def _set_documents(self, documents: Optional[tuple[Tensor, Tensor]]) -> None:
        """Keep the step's document masking, ``(positions [b, s_local], document ids [b, s])`` of the whole batch
        (``None``: none), split into the schedule's micro-batches as it splits ``input_ids`` (dim 0, in order)."""
        if documents is None:
            self._documents = None
            return
        m = self.num_microbatches
        self._documents = list(zip(documents[0].tensor_split(m), documents[1].tensor_split(m)))

    def documents_of(self, microbatch: int) -> Optional[tuple[Tensor, Tensor]]:
        """Micro-batch ``microbatch``'s ``(positions, document ids)``, or ``None`` without document masking: every
        stage computes its masks from them (the ids do not travel between stages: each rank holds the batch)."""
        return None if self._documents is None else self._documents[microbatch]

    def _check_batch(self, input_ids: Tensor) -> None:
        if input_ids.shape[0] % self.num_microbatches != 0:
            raise ValueError(
                f"a batch of {input_ids.shape[0]} sequences cannot be split into num_microbatches="
                f"{self.num_microbatches} equal micro-batches; the DataLoader's batch size per data-parallel rank must "
                f"be a multiple of {self.num_microbatches} (micro_batch_size x num_microbatches)."
            )

    def _reduce_loss(self, losses: list[Tensor], device: torch.device) -> Tensor:
        """Sum the last stage's scaled micro-batch losses and share the result with every pp rank."""
        if self.is_last:
            total = torch.stack([_full(x).detach().float().reshape(()) for x in losses]).sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank contributes
        return total

    def train_step(
        self, input_ids: Tensor, labels: Tensor, documents: Optional[tuple[Tensor, Tensor]] = None
    ) -> Tensor:
        """Forward and backward of all ``m`` micro-batches of ``input_ids`` / ``labels`` (``[b, s]``, b = m x
        micro-batch size); ``documents``: document masking's ``(positions [b, s_local], document ids [b, s])``.
        The gradients (of the mean loss; not yet averaged over dp) are held aside until
        :meth:`restore_gradients`, because Lightning zeroes gradients between ``training_step`` and ``backward``.
        Returns the mean loss over the batch (float32 scalar, detached, the same on every
        pp rank).

        Raises:
            ValueError: the batch does not split into ``num_microbatches`` equal micro-batches.
            PipelineStepError: a stage's forward or backward failed (the first line names this rank, its stages and
                the error; :meth:`_named_failure`); an error of a lost peer that already says what it is keeps its
                type, with that line added as a note."""
        self._check_batch(input_ids)
        self._set_documents(documents)
        schedule = self._use(self._train)
        losses: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        # Lightning's automatic optimization zeroes gradients between training_step and backward, so the schedule
        # must leave them as it found them: its own gradients are kept aside until the strategy's backward puts them
        # back (restore_gradients), as if the backward had run there
        params = self._parameters()
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._begin()
        with self._named_failure():
            schedule.step(*args, target=labels if self.is_last else None, losses=losses, return_outputs=False)
        self._stashed = [(p, p.grad) for p in params]
        for p, grad in zip(params, before):
            p.grad = grad
        return self._reduce_loss(losses, input_ids.device)

    def _parameters(self) -> list[Tensor]:
        return list({id(p): p for stage in self.stages for p in stage.submod.parameters()}.values())

    def restore_gradients(self) -> None:
        """Put back the gradients that :meth:`train_step` computed (called by the strategy's ``backward``); added
        to any gradient present (none under Lightning's default ``zero_grad(set_to_none=True)``)."""
        for p, grad in self._stashed:
            if grad is None:
                continue
            p.grad = grad if p.grad is None else p.grad + grad
        self._stashed = []

    @property
    def _forward_only_works(self) -> bool:
        # measured with torch 2.13: ZBV's and DualPipeV's action lists still hand backward inputs between their two
        # local stages in eval mode ("can't steal_bwd_input if this stage doesn't have backward")
        return self.config.pipeline_schedule not in ZERO_BUBBLE_SCHEDULES

    @contextmanager
    def _gradients_untouched(self) -> Iterator[None]:
        """Run a schedule with backward (grad mode on, outside inference mode) and leave every ``.grad`` as found."""
        params = self._parameters()
        before = [p.grad for p in params]
        try:
            with torch.inference_mode(False), torch.enable_grad(), self.gradient_guard():
                yield
        finally:
            for p, grad in zip(params, before):
                p.grad = grad

    @contextmanager
    def _named_failure(self) -> Iterator[None]:
        """Name a failed schedule step (:func:`describe_step_failure`): an error whose first line is blank (a stage's
        error as pipelining re-raises it) becomes :class:`PipelineStepError` with that line; any other error whose
        chain lost a peer keeps its type (a ``torch.distributed.DistError`` stays one) and gets the line as a note
        (printed under its message); any other error passes as it is."""
        try:
            yield
        except Exception as error:
            line = describe_step_failure(error, self.where)
            if line is None:
                raise
            if _starts_with_its_cause(error):
                error.add_note(line)
                raise
            raise PipelineStepError(line) from error

    def _begin(self) -> None:
        """A schedule step begins: :attr:`metadata_inference` until this rank's first micro-batch forward."""
        self._pending = True
        self.metadata_inference(True)

    def eval_step(self, input_ids: Tensor, labels: Tensor, documents: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """Forward only through the pipeline; returns the mean loss over the batch (the same on every pp rank);
        ``documents`` as in :meth:`train_step`.

        ZBV and DualPipeV cannot run forward-only in this PyTorch: their full schedule runs (the backward's
        gradients are discarded), three times the compute of a forward.

        Raises:
            ValueError, PipelineStepError: as :meth:`train_step`."""
        self._check_batch(input_ids)
        self._set_documents(documents)
        losses: list[Tensor] = []
        args = (input_ids,) if self.is_first else ()
        target = labels if self.is_last else None
        self._begin()
        if self._forward_only_works:
            with self._named_failure():
                self._use(self._train).eval(*args, target=target, losses=losses)
        else:
            with self._gradients_untouched(), self._named_failure():
                args = tuple(a.clone() for a in args)  # not inference tensors: autograd saves them
                target = target.clone() if target is not None else None
                self._use(self._train).step(*args, target=target, losses=losses, return_outputs=False)
        return self._reduce_loss(losses, input_ids.device)

    def forward(self, input_ids: Tensor) -> Optional[Any]:
        """Forward only; returns the last stage's output (logits ``[b, s, V]``) on the rank that holds the last
        stage and ``None`` on the others (causal attention over the whole window).

        Raises:
            ValueError, PipelineStepError: as :meth:`train_step`."""
        self._check_batch(input_ids)
        self._set_documents(None)
        args = (input_ids,) if self.is_first else ()
        self._begin()
        if self._forward_only_works:
            if self._predict is None:
                self._predict = self._make(None)
            with torch.no_grad(), self._named_failure():
                return self._use(self._predict).step(*args)
        if self._predict is None:  # a zero loss: the full schedule runs, its gradients are discarded
            self._predict = self._make(lambda output, target: _as_plain(output).float().sum() * 0.0)
        target = torch.zeros(input_ids.shape[0], dtype=torch.float32, device=input_ids.device)
        with self._gradients_untouched(), self._named_failure():
            args = tuple(a.clone() for a in args)
            output = self._use(self._predict).step(*args, target=target if self.is_last else None, losses=[])
        return output.detach() if isinstance(output, Tensor) else output
