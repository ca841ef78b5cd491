"""``ParallelConfig``: the 4D layout (pp, dp, cp, tp), the ZeRO stage and the options that go with them.

All validation of a layout lives here and is pure Python: it runs before any process group exists, so a bad layout
fails in a second with a message that names the bad value and what would be valid. The mesh is
``("pp", "dp", "cp", "tp")`` (tp innermost, pp outermost; see ``docs/architecture.md``) and its world size is
``pp * dp * cp * tp``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from lightning_4d.features import FEATURES
from lightning_4d.features.context_parallel import check_heads
from lightning_4d.features.moe import MoESizes, check_float8, check_moe_layout
from lightning_4d.features.pipeline import SCHEDULE_STAGES
from lightning_4d.layout import (  # the choices live with the layout registry; imported from here too
    ACTIVATION_CHECKPOINTING,  # noqa: F401
    CONTEXT_PARALLEL_METHODS,  # noqa: F401
    FLOAT8_RECIPES,  # noqa: F401
    GRADIENT_COMPRESSIONS,  # noqa: F401
    LAYOUT_FIELDS,
    MESH_DIM_NAMES,
    PIPELINE_COMM_DTYPES,  # noqa: F401
    PIPELINE_SCHEDULES,  # noqa: F401
    POWERSGD_COMM_DTYPES,  # noqa: F401
    TRAINING_PRECISIONS,  # noqa: F401
    ZERO_STAGES,  # noqa: F401
    check_positive_int,
    check_training_precision,  # noqa: F401
    layout_dataclass,
)
from lightning_4d.models.llama_config import divisors

if TYPE_CHECKING:  # pragma: no cover
    from lightning_4d.models.llama_config import LlamaConfig


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks of the ``2·cp_size`` equal chunks of a sequence that cp rank ``cp_rank`` holds under the
    load-balanced causal split: ``(cp_rank, 2·cp_size - 1 - cp_rank)`` (the "head-tail" split of Megatron-LM's
    context parallelism; Brandon et al. 2023, "Striped Attention", arXiv 2311.09431, for the balance argument)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


#: :meth:`ParallelConfig.rank_stages` of (pp, v, schedule, layer split, layers, rank), memoized (bounded)
_RANK_STAGES: dict[tuple, tuple[tuple[int, range], ...]] = {}
_RANK_STAGES_MAX = 1 << 16


def check_compile(compile: bool, activation_checkpointing: str = "none") -> None:
    """Refuse ``compile=True`` with selective activation checkpointing: the checkpointed layer is what Dynamo must
    trace whole, and a graph break inside it (context-parallel attention, a Mixture-of-Experts feed-forward) sends the
    layer back to eager without a word (measured: 0 graphs compiled with cp2); full checkpointing compiles inside the
    checkpoint. Fails when the layout is built, not after the queue wait. Tensor parallelism compiles
    (:mod:`lightning_4d.parallel.compile` says how).

    Raises:
        ValueError: ``compile`` not a bool, or True with ``activation_checkpointing="selective"``.
    """
    if not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r} is not valid: expected True or False.")
    if compile and activation_checkpointing == "selective":
        raise ValueError(
            "compile=True with activation_checkpointing='selective' is not supported: a graph break inside the "
            "checkpointed layer (context-parallel attention, Mixture-of-Experts layers) would run it eagerly. Use "
            "activation_checkpointing='full' or 'none' with compile=True."
        )


def check_values(config: "ParallelConfig") -> None:
    """The checks every layout field gets from its declaration (:data:`~lightning_4d.layout.LAYOUT_FIELDS`): a size
    (an int field of ``minimum`` 1) is a positive integer (``data_parallel_size`` also ``"auto"``), a field with
    ``choices`` is one of them (a bool is not a ZeRO stage), a ``bool`` field is ``True`` or ``False``.
    :class:`ParallelConfig` checks the features against each other after these.

    Raises:
        ValueError: the first field (registry order) whose value is not valid, naming it and what would be.
    """
    for f in LAYOUT_FIELDS:
        value = getattr(config, f.name)
        if f.choices is not None:
            if (isinstance(value, bool) and not any(isinstance(c, bool) for c in f.choices)) or value not in f.choices:
                raise ValueError(f"{f.name}={value!r} is not valid: expected one of {list(f.choices)}.")
        elif f.minimum == 1 and f.short in MESH_DIM_NAMES + ("ep", "dp_replicate") and value != "auto":
            check_positive_int(f.name, value)
        elif f.type is bool and not isinstance(value, bool):
            raise ValueError(f"{f.name}={value!r} is not valid: expected True or False.")


@layout_dataclass
class ParallelConfig(MoESizes):
    """The parallel layout of one training job: the fields of :data:`lightning_4d.layout.LAYOUT_FIELDS`, declared
    there once (:func:`lightning_4d.layout.layout_dataclass`), checked here against each other.

    Args:
        <the layout fields>

    Raises:
        ValueError: a size that is not a positive integer, a ZeRO stage outside 0-3, an unknown checkpointing mode, an
            unknown pipeline schedule, a ``virtual_pipeline_stages`` the schedule does not support, selective
            checkpointing with a zero-bubble schedule (``"zbv"``, ``"dualpipev"``) under pp > 1, an unknown
            context-parallel method, an unknown gradient compression or pipeline comm dtype, ``"powersgd"`` with
            ZeRO 2 or 3, a ``powersgd_rank`` below 1, a negative ``powersgd_start_step``, an unknown
            ``powersgd_comm_dtype``, a rule of a feature of :data:`lightning_4d.features.FEATURES` (its
            ``check``: MoE's, ep > 1 with PowerSGD; the tp ring overlap's),
            ``activation_offload_layers`` not an integer >= 0, or > 0 with activation checkpointing, ``compile`` not a
            bool, or True with selective checkpointing, an unknown ``float8`` recipe.
    """

    def __post_init__(self) -> None:
        if self.data_parallel_size == -1:
            self.data_parallel_size = "auto"
        check_values(self)
        self._check_gradient_compression()
        for feature in FEATURES:
            feature.check(self)
        self._check_offload()
        self._check_hsdp()
        self._check_optimizer_offload()
        check_compile(self.compile, self.activation_checkpointing)
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            # sequence parallelism is a property of a tp group: with tp=1 there is nothing to shard
            self.sequence_parallel = False

    def _check_gradient_compression(self) -> None:
        """PowerSGD's options, and PowerSGD only at ZeRO 0/1."""
        check_positive_int("powersgd_rank", self.powersgd_rank)
        if (
            isinstance(self.powersgd_start_step, bool)
            or not isinstance(self.powersgd_start_step, int)
            or self.powersgd_start_step < 0
        ):
            raise ValueError(
                f"powersgd_start_step={self.powersgd_start_step!r} is not valid: expected an integer >= 0 "
                "(optimizer steps reduced exactly before PowerSGD starts)."
            )
        if self.gradient_compression == "powersgd" and self.zero_stage >= 2:
            raise ValueError(
                f"gradient_compression='powersgd' is not supported with zero_stage={self.zero_stage}: FSDP2 "
                "reduce-scatters each gradient shard as it comes and PowerSGD needs whole matrices. Use zero_stage 0 "
                "or 1 with it, or gradient_compression='bf16' with ZeRO 2/3."
            )

    def _check_hsdp(self) -> None:
        """``data_parallel_replicate_size``: it divides dp (once dp is known), needs a ZeRO stage that shards
        something, not PowerSGD (the MoE rules, :func:`~lightning_4d.features.moe.check_moe_layout`: not with ep)."""
        r = self.data_parallel_replicate_size
        if r == 1:
            return
        if self.zero_stage == 0:
            raise ValueError(
                f"data_parallel_replicate_size={r} is not valid with zero_stage=0: hybrid sharding replicates a ZeRO "
                "shard group, and ZeRO 0 shards nothing (it already replicates over all of dp). Use zero_stage 1, 2 "
                "or 3 with it, or data_parallel_replicate_size=1."
            )
        if self.gradient_compression == "powersgd":
            raise ValueError(
                f"data_parallel_replicate_size={r} is not supported with gradient_compression='powersgd': its "
                "factors are all-reduced over the whole data-parallel group. Use gradient_compression 'none' or "
                "'bf16' with hybrid sharding."
            )
        if self.data_parallel_size != "auto" and int(self.data_parallel_size) % r != 0:
            raise ValueError(
                f"data_parallel_replicate_size={r} does not divide data_parallel_size={self.data_parallel_size}: dp "
                f"is replicate x shard. Valid data_parallel_replicate_size values: "
                f"{divisors(int(self.data_parallel_size))}."
            )

    def _check_optimizer_offload(self) -> None:
        """``optimizer_offload`` needs a ZeRO stage that shards the optimizer states (1, 2 or 3)."""
        if self.optimizer_offload is not True and self.optimizer_offload is not False:
            raise ValueError(f"optimizer_offload={self.optimizer_offload!r} is not valid: expected True or False.")
        if self.optimizer_offload and self.zero_stage == 0:
            raise ValueError(
                "optimizer_offload=True is not valid with zero_stage=0: every dp rank would hold all of Adam's states "
                "on the host (dp copies per node). Use zero_stage 1, 2 or 3 with it, or optimizer_offload=False."
            )

    def _check_offload(self) -> None:
        """``activation_offload_layers`` (not with checkpointing)."""
        offload = self.activation_offload_layers
        if isinstance(offload, bool) or not isinstance(offload, int) or offload < 0:
            raise ValueError(
                f"activation_offload_layers={offload!r} is not valid: expected an integer >= 0 (decoder layers per "
                "pipeline stage whose saved activations go to host memory; 0 = none)."
            )
        if offload and self.activation_checkpointing != "none":
            raise ValueError(
                f"activation_offload_layers={offload} is not supported with activation_checkpointing="
                f"{self.activation_checkpointing!r}: a checkpointed layer's own saved-tensor hooks take what it "
                "keeps, so nothing of it would reach host memory (Megatron-Core refuses the combination too). Use "
                "activation_checkpointing='none' with the offload, or activation_offload_layers=0."
            )

    # ------------------------------------------------------------------ derived facts
    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp(self) -> int:
        if self.data_parallel_size == "auto":
            raise RuntimeError("data_parallel_size is 'auto': call resolve(world_size) first.")
        return int(self.data_parallel_size)

    @property
    def dp_cp(self) -> int:
        """Size of the group that ZeRO shards over and gradients are reduced over (dp * cp)."""
        return self.dp * self.cp

    @property
    def dp_replicate(self) -> int:
        """HSDP's replicas of the ZeRO shard group (``data_parallel_replicate_size``; 1 without HSDP)."""
        return self.data_parallel_replicate_size

    @property
    def zero_shard(self) -> int:
        """Size of the group ZeRO shards over (``dp_shard_cp``: ``dp/replicate · cp``; ``dp_cp`` without HSDP).
        Gradients are averaged over all of ``dp_cp`` all the same (reduce-scattered within the shard group, then
        all-reduced across the replicas)."""
        return self.dp_cp // self.dp_replicate

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is on (default: on when tp > 1)."""
        return self.tp > 1 and (self.sequence_parallel is None or bool(self.sequence_parallel))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Shape of the ``("pp", "dp", "cp", "tp")`` mesh."""
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def v(self) -> int:
        """Pipeline stages (model chunks) per pp rank: ``virtual_pipeline_stages`` or the schedule's default."""
        if self.virtual_pipeline_stages is not None:
            return self.virtual_pipeline_stages
        return SCHEDULE_STAGES[self.pipeline_schedule][1] if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ``pp * v``."""
        return self.pp * self.v

    @property
    def default_num_microbatches(self) -> int:
        """m when ``num_microbatches`` is not given and the DataModule does not set it: ``2·pp`` for dualpipev (its
        minimum), else ``pp`` (the fewest that keep every stage of 1F1B busy); 1 without pp."""
        if self.pp == 1:
            return 1
        return 2 * self.pp if self.pipeline_schedule == "dualpipev" else self.pp

    @property
    def microbatches(self) -> int:
        """m, the micro-batches the pipeline schedule runs per optimizer step: ``num_microbatches`` or
        :attr:`default_num_microbatches` (1 without pp)."""
        if self.pp == 1:
            return 1
        return self.num_microbatches or self.default_num_microbatches

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The pipeline stages held by pp rank ``pp_rank``, in order.

        Looped placement (gpipe, 1f1b, interleaved_1f1b): rank r holds stages ``r, r+p, r+2p, ...`` (Megatron's
        interleaved assignment). V placement (zbv, dualpipev): rank r holds stages ``r`` and ``2p-1-r``, so the first
        and the last stage sit on rank 0 (``torch.distributed.pipelining``'s ``style="v"``).
        """
        p, v = self.pp, self.v
        if SCHEDULE_STAGES[self.pipeline_schedule][2] == "v" and p > 1:
            return [pp_rank, 2 * p - 1 - pp_rank]
        return [pp_rank + i * p for i in range(v)]

    def stage_layer_ranges(self, num_layers: int) -> list[range]:
        """The decoder-layer indices of every pipeline stage (``pp * v`` ranges, stage order): stage ``k`` holds
        ``[sum(split[:k]), sum(split[:k+1]))`` of :meth:`layer_split` (one range of all layers without pp).

        Raises:
            ValueError: see :meth:`layer_split`.
        """
        if self.pp == 1:
            return [range(num_layers)]
        split = self.layer_split(num_layers)
        starts = itertools.accumulate(split, initial=0)
        return [range(start, start + n) for start, n in zip(starts, split)]

    def rank_stages(self, num_layers: int, pp_rank: int) -> list[tuple[int, range]]:
        """``[(stage index, decoder layers), ...]`` of pp rank ``pp_rank``, in the order of :meth:`stage_indices`.

        Raises:
            ValueError: see :meth:`layer_split`.
        """
        if self.pp == 1:
            return [(0, range(num_layers))]
        given = self.pipeline_layer_split
        key = (self.pp, self.v, self.pipeline_schedule, None if given is None else tuple(given), num_layers, pp_rank)
        stages = _RANK_STAGES.get(key)
        if stages is None:  # the memory model and the planner ask for the same ranks thousands of times
            split = self.layer_split(num_layers)
            stages = tuple((st, range(sum(split[:st]), sum(split[: st + 1]))) for st in self.stage_indices(pp_rank))
            if len(_RANK_STAGES) < _RANK_STAGES_MAX:
                _RANK_STAGES[key] = stages
        return list(stages)

    def layer_split(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage (``pp * v`` counts, stage order).

        Raises:
            ValueError: ``num_layers`` not divisible by ``pp * v`` (no explicit split), or a ``pipeline_layer_split``
                with the wrong number of entries, a sum other than ``num_layers``, or an empty stage.
        """
        n = self.num_stages
        if self.pipeline_layer_split is not None:
            split = list(self.pipeline_layer_split)
            if len(split) != n or sum(split) != num_layers or min(split) < 1:
                raise ValueError(
                    f"pipeline_layer_split={split} is not valid: expected {n} layer counts (pp={self.pp} x "
                    f"virtual_pipeline_stages={self.v}), each >= 1, summing to num_layers={num_layers} (got "
                    f"{len(split)} entries summing to {sum(split)})."
                )
            return split
        if num_layers % n != 0:
            valid = [d for d in divisors(num_layers) if d % self.v == 0 and d // self.v > 0]
            if num_layers < n:
                raise ValueError(
                    f"num_layers={num_layers} cannot be split into pp*v = {self.pp}*{self.v} = {n} pipeline stages "
                    f"(at least one layer per stage); valid pipeline_parallel_size values: "
                    f"{[d // self.v for d in valid]}."
                )
            raise ValueError(
                f"num_layers={num_layers} cannot be split into pp*v = {self.pp}*{self.v} = {n} equal pipeline stages; "
                f"set pipeline_layer_split to {n} layer counts summing to {num_layers}, "
                "or use a pipeline_parallel_size "
                f"with pp*{self.v} dividing {num_layers} (valid pp: {[d // self.v for d in valid]})."
            )
        return [num_layers // n] * n

    def validate_microbatches(self, num_microbatches: int) -> None:
        """Check ``num_microbatches`` (m) against the schedule (no constraint when pp = 1).

        Raises:
            ValueError: m < 1; m < p for 1f1b; m not a multiple of p for interleaved_1f1b; m < 2p for dualpipev.
        """
        m = check_positive_int("num_microbatches", num_microbatches)
        p, name = self.pp, self.pipeline_schedule
        if p == 1:
            return
        if name == "1f1b" and m < p:
            raise ValueError(
                f"num_microbatches={m} is too small for pipeline_schedule='1f1b' with pipeline_parallel_size={p}: 1F1B "
                f"needs at least p={p} micro-batches (use num_microbatches >= {p}, ideally several times p to shrink "
                f"the bubble (p-1)/(m+p-1), or pipeline_schedule='gpipe')."
            )
        if name == "interleaved_1f1b" and m % p != 0:
            raise ValueError(
                f"num_microbatches={m} is not a multiple of pipeline_parallel_size={p}, which "
                f"pipeline_schedule='interleaved_1f1b' needs; use e.g. num_microbatches={max(p, (m // p + 1) * p)}."
            )
        if name == "dualpipev" and m < 2 * p:
            raise ValueError(
                f"num_microbatches={m} is too small for pipeline_schedule='dualpipev' with pipeline_parallel_size={p}: "
                f"it needs at least 2p={2 * p} micro-batches."
            )

    @property
    def sequence_divisor(self) -> int:
        """The sequence length must be a multiple of this: tp under sp, times 2*cp (load-balanced causal split)."""
        return (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)

    # ------------------------------------------------------------------ validation
    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``data_parallel_size`` filled in and checked against ``world_size``.

        Raises:
            ValueError: the world size is not ``pp * dp * cp * tp`` (the message lists layouts that would fit).
        """
        check_positive_int("world_size", world_size)
        other = self.pp * self.cp * self.tp
        if self.data_parallel_size == "auto":
            if world_size % other != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp*cp*tp = {self.pp}*{self.cp}*{self.tp} = {other}, "
                    f"so data_parallel_size='auto' cannot be filled in. Valid tensor_parallel_size values for this "
                    f"world size (pp=cp=1): {divisors(world_size)}."
                )
            return replace(self, data_parallel_size=world_size // other)._check_ep()  # __post_init__: r divides dp
        if self.pp * self.dp * self.cp * self.tp != world_size:
            raise ValueError(
                f"world size {world_size} != pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp} = "
                f"{self.pp * self.dp * self.cp * self.tp}. Set data_parallel_size='auto' or choose sizes whose "
                f"product is {world_size} "
                f"(e.g. data_parallel_size={world_size // other if world_size % other == 0 else 'auto'})."
            )
        return replace(self)._check_ep()

    def _check_ep(self) -> "ParallelConfig":
        """``self`` once the MoE rules of the resolved sizes hold
        (:func:`~lightning_4d.features.moe.check_moe_layout`: ep divides dp·cp·tp).

        Raises:
            ValueError: they do not."""
        check_moe_layout(self, resolved=True)
        return self

    def validate_model(self, model_config: "LlamaConfig") -> None:
        """Check that a Llama model can be split by this layout.

        Raises:
            ValueError: heads, kv heads, FFN size or (padded) vocabulary not divisible by tp; layers that cannot be
                split into ``pp * v`` stages (see :meth:`layer_split`); tied embeddings with pp > 1 and PowerSGD;
                ``float8`` with a dimension of the dense linears not divisible by 16; cp's all-to-all attention
                with heads that do not split over tp·cp (:func:`~lightning_4d.features.context_parallel.check_heads`);
                the MoE rules of :mod:`lightning_4d.features.moe` (``docs/moe.md``).
        """
        tp = self.tp
        valid_tp = [d for d in divisors(model_config.num_kv_heads) if model_config.num_heads % d == 0]
        if model_config.num_heads % tp != 0:
            raise ValueError(
                f"num_heads={model_config.num_heads} is not divisible by tensor_parallel_size={tp}; valid "
                f"tensor_parallel_size values for this model: {valid_tp}."
            )
        if model_config.num_kv_heads % tp != 0:
            raise ValueError(
                f"num_kv_heads={model_config.num_kv_heads} is not divisible by tensor_parallel_size={tp} (kv heads are "
                f"split, not replicated, across tp); valid tensor_parallel_size values for this model: {valid_tp}."
            )
        if model_config.intermediate_size % tp != 0:
            raise ValueError(
                f"intermediate_size={model_config.intermediate_size} is not divisible by tensor_parallel_size={tp}."
            )
        if model_config.padded_vocab_size % tp != 0:
            needed = tp * model_config.pad_vocab_to_multiple_of
            padded = -(-model_config.vocab_size // needed) * needed
            raise ValueError(
                f"vocab_size={model_config.vocab_size} (padded to {model_config.padded_vocab_size}) "
                "is not divisible by "
                f"tensor_parallel_size={tp}: the embedding and the LM head are split by vocabulary. Set "
                f"pad_vocab_to_multiple_of={needed} in the model config (pads the vocabulary to {padded}; the extra "
                "rows are never targets) or choose a tensor_parallel_size that divides "
                f"{model_config.padded_vocab_size}."
            )
        if self.float8 is not None:
            self._check_float8_dims(model_config)
        check_heads(self, model_config)
        check_moe_layout(self, model_config)
        if self.pp > 1:
            self.layer_split(model_config.num_layers)
            if model_config.tie_word_embeddings and self.gradient_compression == "powersgd":
                # the two copies of the tied matrix (first and last stage) would be compressed with different random
                # projections (PowerSGD draws them in each rank's own parameter order) and drift apart
                raise ValueError(
                    "gradient_compression='powersgd' is not supported for tie_word_embeddings=True with "
                    f"pipeline_parallel_size={self.pp} (the embedding's two copies, on the first and the last stage, "
                    "must take identical steps): use gradient_compression='none' or 'bf16'."
                )

    def _check_float8_dims(self, model_config: "LlamaConfig") -> None:
        """Every dimension of the linears ``float8`` converts divisible by 16 (``torch._scaled_mm``'s requirement on
        the inner and output dimensions of each of its three matmuls; torchao's ``_auto_filter_for_recipe`` skips such
        layers, torchtitan refuses them): the hidden size, the query and kv projections' ``heads * head_dim`` and the
        FFN size, and each tp rank's shard of them (the column-parallel ``wq``/``wk``/``wv``/``w1``/``w3`` split their
        output dimension, the row-parallel ``wo``/``w2`` their input dimension, by tp); after the MoE component's rule
        (:func:`lightning_4d.features.moe.check_float8`)."""
        check_float8(self.float8, model_config)
        dims = _float8_dims(model_config)
        bad = {name: value for name, value in dims.items() if value % 16}
        if bad:
            raise ValueError(
                f"float8={self.float8!r} needs every dimension of the decoder layers' linears divisible by 16 "
                f"(torch._scaled_mm); this model has {bad}: use float8=None for it."
            )
        tp = self.tp
        shards = {f"{name}/tp": value // tp for name, value in dims.items() if name != "hidden_size"}
        bad = {name: value for name, value in shards.items() if value % 16}
        if bad:
            valid = [t for t in divisors(dims["intermediate_size"]) if not _float8_shard_problem(dims, t)]
            raise ValueError(
                f"float8={self.float8!r} with tensor_parallel_size={tp} gives per-rank linear shards not divisible "
                f"by 16 (torch._scaled_mm): {bad}; valid tensor_parallel_size values for float8 with this model: "
                f"{valid}, or float8=None."
            )

    def validate_float8_tokens(self, seq_length: int, micro_batch_size: int) -> None:
        """With ``float8``: the tokens each rank's linears take per micro-batch (``micro_batch_size * seq_length /
        cp``; under sequence parallelism the float8 linears take the all-gathered sequence) divisible by 16: they are
        the inner dimension of the weight gradient's ``torch._scaled_mm``. A no-op without float8.

        Raises:
            ValueError: they are not (the message names the valid micro-batch sizes for this sequence length)."""
        if self.float8 is None:
            return
        tokens = micro_batch_size * seq_length // self.cp
        if tokens % 16:
            per_sample = seq_length // self.cp
            step = 16 // math.gcd(per_sample, 16)
            raise ValueError(
                f"float8={self.float8!r} needs the tokens per rank of each micro-batch (micro_batch_size * "
                f"seq_length / cp = {micro_batch_size} * {seq_length} / {self.cp} = {tokens}) divisible by 16, the "
                f"inner dimension of the weight gradient's torch._scaled_mm: use a micro_batch_size that is a "
                f"multiple of {step}, or a seq_length / cp that is a multiple of 16."
            )

    def validate_sequence(self, seq_length: int) -> None:
        """Raise ``ValueError`` when ``seq_length`` is not a multiple of :attr:`sequence_divisor`."""
        check_positive_int("seq_length", seq_length)
        if seq_length % self.sequence_divisor != 0:
            why = []
            if self.sp:
                why.append(f"tp={self.tp} with sequence parallelism")
            if self.cp > 1:
                why.append(f"2*cp={2 * self.cp}")
            raise ValueError(
                f"seq_length={seq_length} is not a multiple of {self.sequence_divisor} ({' and '.join(why)}); "
                f"use e.g. seq_length={(seq_length // self.sequence_divisor + 1) * self.sequence_divisor}."
            )


def _float8_dims(model_config: "LlamaConfig") -> dict[str, int]:
    """The dimensions of the decoder layers' linears that ``float8`` converts
    (:meth:`ParallelConfig._check_float8_dims`)."""
    return {
        "hidden_size": model_config.hidden_size,
        "num_heads*head_dim": model_config.num_heads * model_config.head_dim,
        "num_kv_heads*head_dim": model_config.num_kv_heads * model_config.head_dim,
        "intermediate_size": model_config.intermediate_size,
    }


def _float8_shard_problem(dims: dict[str, int], tp: int) -> bool:
    """Whether tp ranks split some dimension of ``dims`` (:func:`_float8_dims`; not the hidden size) unevenly or into
    shards not divisible by 16."""
    return any(v % tp or (v // tp) % 16 for name, v in dims.items() if name != "hidden_size")
