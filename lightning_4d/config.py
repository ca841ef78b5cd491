"""``ParallelConfig``: the 4D layout (pp, dp, cp, tp), the ZeRO stage and the options that go with them.

All validation of a layout lives here and is pure Python: it runs before any process group exists, so a bad layout
fails in a second with a message that names the bad value and what would be valid. The mesh is
``("pp", "dp", "cp", "tp")`` (tp innermost, pp outermost; see ``docs/architecture.md``) and its world size is
``pp * dp * cp * tp``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Literal, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from lightning_4d.models.config import LlamaConfig

ZERO_STAGES = (0, 1, 2, 3)
ACTIVATION_CHECKPOINTING = ("none", "full")
MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive_int(name: str, value: object) -> int:
    """Return ``value`` when it is an int >= 1 (not a bool); else raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: expected a positive integer (1, 2, 4, ...).")
    return value


@dataclass
class ParallelConfig:
    """The parallel layout of one training job.

    Args:
        data_parallel_size: dp, the number of model replicas that see different data. ``"auto"`` (or -1) takes what
            is left of the world size after pp, cp and tp.
        tensor_parallel_size: tp, the ranks that split every matrix of a layer (Megatron-style column/row split).
        pipeline_parallel_size: pp, the number of pipeline stages (not supported yet: raises NotImplementedError at
            setup).
        context_parallel_size: cp, the ranks that split the sequence of one sample (not supported yet).
        zero_stage: ZeRO stage over the ``dp_cp`` group: 0 replicated, 1 optimizer states sharded, 2 + gradients
            sharded, 3 + parameters sharded (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054).
        sequence_parallel: shard the norm / residual regions of a tp group over the sequence (Korthikanti et al.
            2022, arXiv 2205.05198). ``None`` means "on when tp > 1".
        activation_checkpointing: ``"none"`` or ``"full"`` (recompute each transformer layer in backward).

    Raises:
        ValueError: a size that is not a positive integer, a ZeRO stage outside 0-3, an unknown checkpointing mode.
    """

    data_parallel_size: Union[int, Literal["auto"]] = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    zero_stage: int = 1
    sequence_parallel: Optional[bool] = None
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        if self.data_parallel_size == -1:
            self.data_parallel_size = "auto"
        if self.data_parallel_size != "auto":
            _check_positive_int("data_parallel_size", self.data_parallel_size)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive_int("context_parallel_size", self.context_parallel_size)
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={self.zero_stage!r} is not valid: expected one of {list(ZERO_STAGES)}.")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not valid: expected one of "
                f"{list(ACTIVATION_CHECKPOINTING)}."
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            # sequence parallelism is a property of a tp group: with tp=1 there is nothing to shard
            self.sequence_parallel = False

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
    def sequence_divisor(self) -> int:
        """The sequence length must be a multiple of this: tp under sp, times 2*cp (load-balanced causal split)."""
        return (self.tp if self.sp else 1) * (2 * self.cp if self.cp > 1 else 1)

    def to_dict(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ validation
    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``data_parallel_size`` filled in and checked against ``world_size``.

        Raises:
            ValueError: the world size is not ``pp * dp * cp * tp`` (the message lists layouts that would fit).
        """
        _check_positive_int("world_size", world_size)
        other = self.pp * self.cp * self.tp
        if self.data_parallel_size == "auto":
            if world_size % other != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp*cp*tp = {self.pp}*{self.cp}*{self.tp} = {other}, "
                    f"so data_parallel_size='auto' cannot be filled in. Valid tensor_parallel_size values for this "
                    f"world size (pp=cp=1): {_divisors(world_size)}."
                )
            return replace(self, data_parallel_size=world_size // other)
        if self.pp * self.dp * self.cp * self.tp != world_size:
            raise ValueError(
                f"world size {world_size} != pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*{self.tp} = "
                f"{self.pp * self.dp * self.cp * self.tp}. Set data_parallel_size='auto' or choose sizes whose "
                f"product is {world_size} (e.g. data_parallel_size={world_size // other if world_size % other == 0 else 'auto'})."
            )
        return replace(self)

    def check_supported(self) -> None:
        """Raise ``NotImplementedError`` for dimensions the strategy does not implement yet (pp > 1, cp > 1)."""
        if self.pp > 1:
            raise NotImplementedError(
                f"pipeline_parallel_size={self.pp}: pipeline parallelism is not supported yet by FourDStrategy; "
                "use pipeline_parallel_size=1 (dp with ZeRO and tp with sequence parallelism are supported)."
            )
        if self.cp > 1:
            raise NotImplementedError(
                f"context_parallel_size={self.cp}: context parallelism is not supported yet by FourDStrategy; "
                "use context_parallel_size=1 (dp with ZeRO and tp with sequence parallelism are supported)."
            )

    def validate_model(self, model_config: "LlamaConfig") -> None:
        """Check that a Llama model can be split by this layout.

        Raises:
            ValueError: heads, kv heads, FFN size or (padded) vocabulary not divisible by tp; layers not divisible
                by pp.
        """
        tp = self.tp
        valid_tp = [d for d in _divisors(model_config.num_kv_heads) if model_config.num_heads % d == 0]
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
                f"vocab_size={model_config.vocab_size} (padded to {model_config.padded_vocab_size}) is not divisible by "
                f"tensor_parallel_size={tp}: the embedding and the LM head are split by vocabulary. Set "
                f"pad_vocab_to_multiple_of={needed} in the model config (pads the vocabulary to {padded}; the extra "
                f"rows are never targets) or choose a tensor_parallel_size that divides {model_config.padded_vocab_size}."
            )
        if model_config.num_layers % self.pp != 0:
            raise ValueError(
                f"num_layers={model_config.num_layers} is not divisible by pipeline_parallel_size={self.pp}; valid "
                f"values: {_divisors(model_config.num_layers)}."
            )

    def validate_sequence(self, seq_length: int) -> None:
        """Raise ``ValueError`` when ``seq_length`` is not a multiple of :attr:`sequence_divisor`."""
        _check_positive_int("seq_length", seq_length)
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
