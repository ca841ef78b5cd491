"""``LlamaConfig``: the shape of a Llama 2 / Llama 3 decoder and its analytic parameter count (its presets:
:mod:`lightning_4d.models.presets`).

Field names follow this package; the corresponding names of Meta's reference ``ModelArgs`` (``llama/model.py`` of
github.com/meta-llama/llama and ``llama/model.py`` of github.com/meta-llama/llama3) and of the released
``params.json`` files are:

=========================  ==========================================================================
``LlamaConfig``            Meta ``ModelArgs`` / ``params.json``
=========================  ==========================================================================
``hidden_size``            ``dim``
``num_layers``             ``n_layers``
``num_heads``              ``n_heads``
``num_kv_heads``           ``n_kv_heads`` (grouped-query attention, Ainslie et al. 2023, arXiv 2305.13245)
``intermediate_size``      derived in Meta's ``FeedForward`` from ``dim``, ``multiple_of`` and
                           ``ffn_dim_multiplier``; stored here as the resulting number
``vocab_size``             ``vocab_size``
``norm_eps``               ``norm_eps``
``rope_theta``             ``rope_theta``
``rope_scaling``           ``use_scaled_rope`` (Llama 3.1+) with the constants of ``apply_scaling``
``max_seq_length``         ``max_seq_len``
=========================  ==========================================================================

Mixture-of-Experts fields (``num_experts`` > 0; ``docs/moe.md``) and their names in transformers' ``MixtralConfig``
and Llama 4's ``Llama4TextConfig``:

=========================  ==========================================================================
``LlamaConfig``            transformers
=========================  ==========================================================================
``num_experts``            ``num_local_experts``
``num_experts_per_token``  ``num_experts_per_tok`` (top-k)
``moe_intermediate_size``  Mixtral ``intermediate_size``; Llama 4 ``intermediate_size`` (while its dense layers
                           use ``intermediate_size_mlp``, our ``intermediate_size``)
``num_shared_experts``     Mixtral: 0; Llama 4: 1 (``shared_expert``)
``moe_layer_interval``     Llama 4 ``interleave_moe_layer_step``; Mixtral: 1
``router_score``           Mixtral: ``"softmax"``; Llama 4: ``"sigmoid"``
``router_aux_loss_coef``   ``router_aux_loss_coef``
=========================  ==========================================================================

All fields are typed and defaulted so that jsonargparse / ``LightningCLI`` can build a config from YAML.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_4d.models.presets import LLAMA4_UNIMPLEMENTED, PRESET_FIELDS

ATTENTION_BACKENDS = ("sdpa", "flash", "eager")
#: ``LlamaConfig.router_score``: how router logits become expert weights (``lightning_4d/features/moe/layer.py``)
ROUTER_SCORES = ("softmax", "sigmoid")
#: transformers' ``model_type`` of Llama 4 checkpoints (multimodal wrapper and text model)
LLAMA4_MODEL_TYPES = ("llama4", "llama4_text")


#: the largest size a model config may give (``vocab_size``, ``hidden_size``, ``intermediate_size``, heads, layers,
#: ``max_seq_length``): 2^30, ~100x the largest real one (Llama 4's 10M-token context), checked before any loop over
#: a size's divisors, so a crafted config (a checkpoint's, a ``config.json``) fails in one line instead of hanging
MAX_MODEL_SIZE = 2**30


def _check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) in ``1 .. MAX_MODEL_SIZE``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: expected a positive integer (1, 2, 3, ...).")
    if value > MAX_MODEL_SIZE:
        raise ValueError(f"{name}={value!r} is not valid: expected at most {MAX_MODEL_SIZE:,} (2^30).")


def _check_positive_float(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not valid: expected a number > 0.")


@dataclass
class RopeScaling:
    """Llama 3.1 frequency-dependent rescaling of the rotary inverse frequencies (``use_scaled_rope``).

    Source: ``apply_scaling`` in ``models/llama3/model.py`` (earlier ``models/llama3/reference_impl/model.py``) of
    github.com/meta-llama/llama-models, the Llama 3.1 / 3.2 reference,
    described in the Llama 3 paper (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783). With
    ``low_wavelen = original_max_position_embeddings / low_freq_factor`` and
    ``high_wavelen = original_max_position_embeddings / high_freq_factor`` (both in tokens), a frequency ``f``
    (radians per token) of wavelength ``2 pi / f`` tokens is

    - divided by ``factor`` when its wavelength exceeds ``low_wavelen`` (long-range dimensions are interpolated),
    - kept when its wavelength is below ``high_wavelen`` (short-range dimensions are untouched),
    - otherwise blended: ``(1 - smooth) * f / factor + smooth * f`` with
      ``smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
      / (high_freq_factor - low_freq_factor)``, which runs from 0 at ``low_wavelen`` to 1 at ``high_wavelen``.

    Args:
        factor: interpolation factor of the low frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B).
        low_freq_factor: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled.
        high_freq_factor: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept.
        original_max_position_embeddings: the context length (tokens) the frequencies were trained for (8192).

    Raises:
        ValueError: a non-positive value, or ``high_freq_factor <= low_freq_factor`` (the smooth band would be
            empty or inverted; Meta's code asserts the two wavelengths differ).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _check_positive_float("rope_scaling.factor", self.factor)
        _check_positive_float("rope_scaling.low_freq_factor", self.low_freq_factor)
        _check_positive_float("rope_scaling.high_freq_factor", self.high_freq_factor)
        _check_positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor!r} is not valid: expected a value greater than "
                f"low_freq_factor={self.low_freq_factor!r} (Llama 3.1 uses low 1.0, high 4.0)."
            )


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama 2 / Llama 3 decoder-only transformer.

    Args:
        vocab_size: number of token ids of the tokenizer.
        hidden_size: model width ``h`` (Meta's ``dim``).
        intermediate_size: SwiGLU hidden width ``f`` (columns of ``w1`` / ``w3``).
        num_layers: number of transformer blocks ``L``.
        num_heads: query heads ``a``.
        num_kv_heads: key/value heads (grouped-query attention); ``num_heads`` must be a multiple of it.
        max_seq_length: the longest sequence (tokens) the model is meant for; not enforced in ``forward`` (RoPE is
            computed for the positions given) but used by generation and data code.
        rope_theta: RoPE base ``theta`` (Su et al. 2021, "RoFormer", arXiv 2104.09864): 1e4 for Llama 2,
            5e5 for Llama 3.
        rope_scaling: Llama 3.1 frequency scaling, or ``None`` for plain RoPE. A ``dict`` is converted.
        norm_eps: epsilon added to the mean square in RMSNorm.
        tie_word_embeddings: share the ``[V, h]`` matrix of the embedding and the LM head (Llama 3.2 1B / 3B).
        attention_backend: ``"sdpa"``, ``"flash"`` (flash-attn 2, CUDA only) or ``"eager"`` (reference math).
        initializer_range: standard deviation of the normal initialization of embeddings and linear weights.
        pad_vocab_to_multiple_of: round the embedding / LM head rows up to a multiple of this (e.g. for tensor
            parallelism); the extra rows are never targets.
        num_experts: routed experts per Mixture-of-Experts layer; 0 (the default) is a dense Llama and every MoE
            field below is ignored (``docs/moe.md``).
        num_experts_per_token: top-k, the routed experts each token goes to (1 .. ``num_experts``).
        moe_intermediate_size: SwiGLU width of one expert (and of one shared expert); ``None``: ``intermediate_size``.
        num_shared_experts: experts every token goes through, as one dense SwiGLU of width
            ``num_shared_experts * moe_intermediate_size`` added to the routed output (Llama 4: 1; Mixtral: 0).
        moe_layer_interval: layer ``i`` (0-based) is an MoE layer when ``(i + 1) % moe_layer_interval == 0``, the
            others dense (transformers' Llama 4 ``interleave_moe_layer_step``: ``moe_layers = range(step - 1, L,
            step)``; Megatron-LM's ``moe_layer_freq=k`` puts MoE on layers ``0, k, 2k, ...`` instead). 1: every layer.
        router_score: ``"softmax"`` (Mixtral: softmax over all experts in float32, top-k of the probabilities,
            renormalized to sum 1, weighting the experts' outputs) or ``"sigmoid"`` (Llama 4: top-k of the logits,
            ``sigmoid`` of them, not renormalized, scaling the experts' inputs).
        router_aux_loss_coef: weight of the load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv
            2101.03961, Eq. 4-6; transformers' ``load_balancing_loss_func``) added to the training loss; the loss is
            the mean over MoE layers of ``E · sum_e f_e · P_e`` (``lightning_4d/features/moe/layer.py``).
        capacity_factor: ``None`` (dropless: every token reaches its top-k experts) or a number > 0: each expert
            takes at most ``ceil(capacity_factor · T · k / E)`` of the ``T`` tokens of one forward (on one rank),
            first come first served in token order; the assignments past it are dropped (their expert output is
            zero, the token keeps its other experts and the residual).
        unimplemented_features: parts of the architecture this package does not implement (Llama 4's NoPE layers,
            chunked attention, QK norm). A config naming any serves ``estimate`` / ``plan`` only:
            :meth:`check_trainable` raises (``CausalLMModule``, ``LlamaModel``).

    Raises:
        ValueError: a non-positive size, ``hidden_size`` not divisible by ``num_heads``, ``num_heads`` not divisible
            by ``num_kv_heads``, an odd head dimension, an unknown ``attention_backend`` or
            ``pad_vocab_to_multiple_of < 1``; for an MoE config (``num_experts`` > 0) a top-k outside
            ``1 .. num_experts``, ``capacity_factor`` <= 0, ``moe_layer_interval`` < 1 or larger than
            ``num_layers``, an unknown ``router_score``, a negative ``router_aux_loss_coef`` or
            ``num_shared_experts``. The message names the bad value and what would be valid.
    """

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    max_seq_length: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_backend: str = "sdpa"
    initializer_range: float = 0.02
    pad_vocab_to_multiple_of: int = 1
    num_experts: int = 0
    num_experts_per_token: int = 2
    moe_intermediate_size: Optional[int] = None
    num_shared_experts: int = 0
    moe_layer_interval: int = 1
    router_score: str = "softmax"
    router_aux_loss_coef: float = 0.01
    capacity_factor: Optional[float] = None
    unimplemented_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in (
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("max_seq_length", self.max_seq_length),
        ):
            _check_positive_int(name, value)
        pad = self.pad_vocab_to_multiple_of
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
            raise ValueError(
                f"pad_vocab_to_multiple_of={self.pad_vocab_to_multiple_of!r} is not valid: expected an integer >= 1 "
                "(1 means no padding)."
            )
        _check_positive_float("rope_theta", self.rope_theta)
        _check_positive_float("norm_eps", self.norm_eps)
        _check_positive_float("initializer_range", self.initializer_range)
        if self.hidden_size % self.num_heads != 0:
            h = self.hidden_size
            valid = [d for d in divisors(h) if (h // d) % 2 == 0]
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; valid num_heads "
                f"for this hidden_size (with an even head dimension): {valid}."
            )
        if self.num_heads % self.num_kv_heads != 0:
            valid = divisors(self.num_heads)
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} is not valid: num_heads={self.num_heads} must be divisible by it; "
                f"valid num_kv_heads: {valid}."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim={self.head_dim} (hidden_size={self.hidden_size} / num_heads={self.num_heads}) is not valid: "
                "rotary embeddings rotate pairs of dimensions, so the head dimension must be even."
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not valid: expected one of "
                f"{list(ATTENTION_BACKENDS)}."
            )
        if isinstance(self.rope_scaling, dict):
            valid = [f.name for f in dataclasses.fields(RopeScaling)]
            unknown = sorted(set(self.rope_scaling) - set(valid))
            if unknown:
                raise ValueError(
                    f"rope_scaling={self.rope_scaling!r} is not valid: unknown field(s) {unknown}; valid: {valid}."
                )
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling={self.rope_scaling!r} is not valid: expected None, a RopeScaling or a dict of its "
                "fields."
            )
        self._validate_moe()

    def _validate_moe(self) -> None:
        """The Mixture-of-Experts fields (class docstring, Raises)."""
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"num_experts={e!r} is not valid: expected 0 (a dense Llama) or a positive integer.")
        self.unimplemented_features = tuple(self.unimplemented_features)
        if e == 0:
            return
        k = self.num_experts_per_token
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(
                f"num_experts_per_token={k!r} is not valid: top-k must be an integer in 1 .. num_experts={e}."
            )
        if self.moe_intermediate_size is not None:
            _check_positive_int("moe_intermediate_size", self.moe_intermediate_size)
        s = self.num_shared_experts
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"num_shared_experts={s!r} is not valid: expected 0 or a positive integer.")
        interval = self.moe_layer_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= self.num_layers:
            raise ValueError(
                f"moe_layer_interval={interval!r} is not valid: expected an integer in 1 .. "
                f"num_layers={self.num_layers} (layer i is MoE when (i + 1) % interval == 0; 1: every "
                "layer)."
            )
        if self.router_score not in ROUTER_SCORES:
            raise ValueError(f"router_score={self.router_score!r} is not valid: expected one of {list(ROUTER_SCORES)}.")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(
                f"router_aux_loss_coef={coef!r} is not valid: expected a number >= 0 (0 turns the "
                "load-balancing loss off)."
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ValueError(
                f"capacity_factor={cf!r} is not valid: expected None (dropless) or a number > 0 (e.g. 1.25)."
            )

    # ------------------------------------------------------------------ Mixture of Experts
    @property
    def is_moe(self) -> bool:
        """Whether the model has Mixture-of-Experts layers (``num_experts`` > 0)."""
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        """SwiGLU width of one routed (or shared) expert: ``moe_intermediate_size``, else ``intermediate_size``."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) is a Mixture-of-Experts layer: ``(index + 1) % moe_layer_interval ==
        0`` in an MoE config (the rule of transformers' Llama 4, ``interleave_moe_layer_step``), never in a dense
        one."""
        return self.is_moe and (index + 1) % self.moe_layer_interval == 0

    @property
    def num_moe_layers(self) -> int:
        """Number of Mixture-of-Experts layers (0 for a dense config)."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def check_trainable(self, what: str = "this package's Llama") -> None:
        """Raise ``ValueError`` when the config names parts of its architecture that the model does not implement
        (``unimplemented_features``: such a preset serves ``estimate`` / ``plan`` only). ``what`` names the caller
        in the message."""
        if self.unimplemented_features:
            raise ValueError(
                f"{what} cannot build this model: it needs {', '.join(self.unimplemented_features)}, "
                "which lightning_4d's Llama does not implement; the config serves `lightning-4d "
                "estimate` / `plan` only (docs/moe.md)."
            )

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        """Dimension of one attention head: ``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the LM head: ``vocab_size`` rounded up to a multiple of
        ``pad_vocab_to_multiple_of``."""
        m = self.pad_vocab_to_multiple_of
        return -(-self.vocab_size // m) * m

    def num_parameters(self) -> int:
        """Analytic number of parameters of ``LlamaModel(self)`` (a tied embedding / LM head counted once).

        With ``h`` = hidden_size, ``f`` = intermediate_size, ``d`` = head_dim, ``a`` = num_heads,
        ``k`` = num_kv_heads, ``V`` = padded_vocab_size and ``L`` = num_layers::

            per block = h*a*d (wq) + 2*h*k*d (wk, wv) + a*d*h (wo) + 3*h*f (w1, w2, w3) + 2*h (two RMSNorms)
            total     = L * per block + V*h (embedding) + h (final RMSNorm) + V*h (LM head, unless tied)

        No biases (Meta's reference uses ``bias=False`` everywhere). A Mixture-of-Experts layer replaces the
        ``3*h*f`` of its feed-forward by ``E*h`` (router) ``+ 3*E*h*f_e`` (routed experts) ``+ 3*h*n_s*f_e`` (shared
        experts), with ``E`` = num_experts, ``f_e`` = :attr:`expert_intermediate_size`, ``n_s`` =
        num_shared_experts.
        """
        return self._count_parameters(active=False)

    def num_active_parameters(self) -> int:
        """Parameters one token goes through: :meth:`num_parameters` less, in every MoE layer, the ``E - k`` routed
        experts it does not reach (``3*h*f_e`` each). Equal to :meth:`num_parameters` for a dense config."""
        return self._count_parameters(active=True)

    def _count_parameters(self, active: bool) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        a, k, v = self.num_heads, self.num_kv_heads, self.padded_vocab_size
        attention = h * a * d + 2 * h * k * d + a * d * h
        feed_forward = 3 * h * f
        block = attention + feed_forward + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        total = self.num_layers * block + v * h + h + head
        if self.is_moe:
            fe, e = self.expert_intermediate_size, self.num_experts
            routed = self.num_experts_per_token if active else e
            moe = e * h + 3 * routed * h * fe + 3 * h * self.num_shared_experts * fe
            total += self.num_moe_layers * (moe - feed_forward)
        return total

    def flops_per_token(self, seq_length: int, attention_context: Optional[float] = None) -> float:
        """Model FLOPs of one training step (forward + backward) per token: ``6·N + 12·L·h·s``.

        The standard definition behind model FLOPs utilization (MFU) of Chowdhery et al. 2022, "PaLM: Scaling
        Language Modeling with Pathways", arXiv 2204.02311, appendix B: ``6N + 12·L·H·Q·T`` with H heads of size Q
        (``H·Q = h``, the hidden size) and T = ``seq_length`` tokens of context. ``6N``: every parameter takes part
        in one multiply-add (2 FLOPs) per token forward and two backward; ``12·L·h·s``: per layer the attention
        scores ``QKᵀ`` and their product with V (2 matmuls of ``2·s·h`` FLOPs per token forward, twice as many
        backward), counted in full although causal attention needs only half of them (the convention, so that MFU
        is comparable across implementations), and recomputation (activation checkpointing) is not counted.

        N is :meth:`num_parameters`: every parameter, the embedding table (and an untied LM head) included, as in
        PaLM's count. The embedding lookup does no matmul, so for an untied model this counts ``6·V·h`` FLOPs per
        token that are not executed (5.2% of the total for llama3-8b at s=8192).

        For a Mixture-of-Experts config N is :meth:`num_active_parameters` (the parameters one token goes through:
        the router, its top-k routed experts and the shared experts), as MFU is reported for MoE models (e.g.
        DeepSeek-V3, arXiv 2412.19437); equal to :meth:`num_parameters` for a dense config.

        ``attention_context``: with document masking, the context a token's attention spans on average in place of
        ``s``: ``Σ n_d² / s`` over the documents of a window (lengths ``n_d``; :func:`~lightning_4d.models.
        document_mask.attention_context`), the same full-square convention per document: the documents' own FLOPs,
        not those of a window-long context. The masked kernels compute more (whole masked blocks, no causal half
        skipped), which the step-time model charges (``lightning_4d.planning.step_time.attention_work``) and MFU,
        a count of useful FLOPs, does not.

        Raises:
            ValueError: ``seq_length`` is not a positive integer.
        """
        _check_positive_int("seq_length", seq_length)
        context = seq_length if attention_context is None else attention_context
        return float(6 * self.num_active_parameters() + 12 * self.num_layers * self.hidden_size * context)

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset_names() -> list[str]:
        """Names accepted by :meth:`from_preset`, in definition order."""
        return list(PRESETS)

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> "LlamaConfig":
        """A fresh copy of preset ``name`` with ``overrides`` applied (validated again).

        Raises:
            ValueError: ``name`` is not a preset (the message lists the valid names), or an override is invalid.
            TypeError: an override that is not a field of ``LlamaConfig``.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: expected one of {cls.preset_names()}.")
        return dataclasses.replace(copy.deepcopy(PRESETS[name]), **overrides)

    @classmethod
    def from_name(cls, name: Union[str, "os.PathLike[str]"]) -> "LlamaConfig":
        """A preset (:meth:`from_preset`) or, when ``name`` is an existing path, a Hugging Face Llama directory or
        ``config.json`` (:meth:`from_hf`). What ``CausalLMModule(model_config=...)`` and YAML's ``model_config:``
        accept as a string.

        Raises:
            ValueError: neither a preset name nor an existing path (the message lists the presets).
        """
        if str(name) in PRESETS:
            return cls.from_preset(str(name))
        if os.path.exists(name):
            return cls.from_hf(name)
        raise ValueError(
            f"model_config={str(name)!r} is not valid: expected a preset ({cls.preset_names()}), the "
            "directory of a Hugging Face Llama (holding config.json), or a LlamaConfig"
        )

    @classmethod
    def from_hf(cls, path: Union[str, "os.PathLike[str]"], **overrides: object) -> "LlamaConfig":
        """The config of a Hugging Face Llama checkpoint: ``path`` is its directory (holding ``config.json``) or the
        ``config.json`` itself (Llama 2, 3, 3.1 / 3.2 with ``rope_scaling`` / ``rope_parameters`` of type
        ``llama3``, tied 3.2). Field mapping (transformers' ``LlamaConfig`` -> ours): ``num_hidden_layers`` ->
        ``num_layers``, ``num_attention_heads`` -> ``num_heads``, ``num_key_value_heads`` -> ``num_kv_heads``
        (default: ``num_heads``), ``max_position_embeddings`` -> ``max_seq_length``, ``rms_norm_eps`` ->
        ``norm_eps``, ``rope_theta`` (top level, or inside ``rope_parameters`` since transformers 5), the llama3
        ``rope_scaling`` fields -> :class:`RopeScaling`; ``vocab_size``, ``hidden_size``, ``intermediate_size``,
        ``tie_word_embeddings`` and ``initializer_range`` keep their names. A transformers Mixtral
        (``model_type`` ``"mixtral"``, no sliding window, no router jitter): ``num_local_experts`` ->
        ``num_experts``, ``num_experts_per_tok`` -> ``num_experts_per_token``, ``intermediate_size`` -> both
        ``intermediate_size`` and ``moe_intermediate_size``, ``router_aux_loss_coef`` kept, every layer MoE,
        softmax router, no shared expert. ``overrides`` are applied last.

        Raises:
            ValueError: the file is missing or not JSON, ``model_type`` is not ``"llama"`` or ``"mixtral"`` (Llama
                4 names the parts our Llama lacks), or the checkpoint uses
                what our Llama does not have (biases, an activation other than SiLU, a ``head_dim`` other than
                ``hidden_size / num_attention_heads``, a rope type other than ``default`` / ``llama3``); the
                message names the field.
        """
        import json
        from pathlib import Path

        file = Path(path)
        file = file / "config.json" if file.is_dir() else file
        if not file.is_file():
            raise ValueError(
                f"{str(path)!r} holds no Hugging Face config.json: pass the model directory written by "
                "save_pretrained (or the config.json itself)"
            )
        try:
            hf = json.loads(file.read_text())
        except ValueError as e:
            raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from e
        return cls.from_hf_dict(hf, source=str(file), **overrides)

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "the Hugging Face config", **overrides: object) -> "LlamaConfig":
        """:meth:`from_hf` for a ``config.json`` already read (or a transformers ``LlamaConfig.to_dict()``);
        ``source`` names it in errors. Raises ``ValueError`` as :meth:`from_hf` does."""
        file = source
        kind = hf.get("model_type")
        if kind in LLAMA4_MODEL_TYPES:
            raise ValueError(
                f"{str(file)!r}: model_type={kind!r} (Llama 4) is not supported: lightning_4d's Llama "
                f"does not implement {', '.join(LLAMA4_UNIMPLEMENTED)}; the presets "
                "llama4-scout-17b-16e and llama4-maverick-17b-128e serve estimate / plan only"
            )
        if kind not in ("llama", "mixtral"):
            raise ValueError(f"{str(file)!r}: model_type={kind!r} is not supported: expected 'llama' or 'mixtral'")
        moe = _mixtral_fields(hf, file) if kind == "mixtral" else {}
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{str(file)!r}: {flag}=true is not supported (our Llama has no biases)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{str(file)!r}: hidden_act={hf['hidden_act']!r} is not supported: expected 'silu'")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise ValueError(
                f"{str(file)!r}: head_dim={hf['head_dim']} is not supported: expected hidden_size / "
                f"num_attention_heads = {hf['hidden_size'] // heads}"
            )
        theta, scaling = _rope_of(hf, file)
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            max_seq_length=hf.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
            **moe,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """This config as a Hugging Face Llama ``config.json`` dict (the inverse of :meth:`from_hf`; rope scaling
        as transformers 5 writes it, ``rope_parameters`` with ``rope_type`` ``llama3``, and as ``rope_scaling`` for
        older readers). The padded vocabulary rows are not part of it: ``vocab_size`` is the tokenizer's.

        A Mixture-of-Experts config becomes a transformers ``MixtralConfig`` dict (``model_type`` ``"mixtral"``):
        ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` = the expert width,
        ``router_aux_loss_coef``, no sliding window, no router jitter. ``capacity_factor`` is a training rule with no
        Hugging Face field (transformers' Mixtral is dropless).

        Raises:
            ValueError: an MoE config Mixtral cannot express (shared experts, dense layers between MoE layers,
                ``router_score="sigmoid"``, rope scaling), or one with ``unimplemented_features``.
        """
        self.check_trainable("to_hf")
        rope: dict = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling), rope_type="llama3")
        if self.is_moe:
            return self._to_hf_mixtral(rope)
        return self._to_hf_llama(rope)

    def _hf_shape(self, architecture: str, model_type: str, intermediate_size: int, rope: dict) -> dict:
        """The ``config.json`` fields a transformers Llama and Mixtral share, in the order both write them."""
        return {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_length,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
        }

    def _to_hf_mixtral(self, rope: dict) -> dict:
        """:meth:`to_hf` of a Mixture-of-Experts config (``rope``: its ``rope_parameters``)."""
        bad = {
            "num_shared_experts": (self.num_shared_experts, 0),
            "moe_layer_interval": (self.moe_layer_interval, 1),
            "router_score": (self.router_score, "softmax"),
            "rope_scaling": (self.rope_scaling, None),
        }
        for name, (value, want) in bad.items():
            if value != want:
                raise ValueError(
                    f"to_hf: {name}={value!r} has no transformers Mixtral equivalent: expected "
                    f"{want!r} (Mixtral: every layer MoE, softmax top-k router, no shared expert, "
                    "plain RoPE)"
                )
        return {
            **self._hf_shape("MixtralForCausalLM", "mixtral", self.expert_intermediate_size, rope),
            "sliding_window": None,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_token,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
        }

    def _to_hf_llama(self, rope: dict) -> dict:
        """:meth:`to_hf` of a dense config (``rope``: its ``rope_parameters``)."""
        return {
            **self._hf_shape("LlamaForCausalLM", "llama", self.intermediate_size, rope),
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }


def _mixtral_fields(hf: dict, file: str) -> dict:
    """:class:`LlamaConfig`'s Mixture-of-Experts fields of a transformers Mixtral ``config.json`` dict (``file``
    names it in errors).

    Raises:
        ValueError: a sliding window or router jitter (not implemented).
    """
    if hf.get("sliding_window") is not None:
        raise ValueError(
            f"{str(file)!r}: sliding_window={hf['sliding_window']} is not supported (our "
            "attention is full causal): expected null, as Mixtral 8x7B / 8x22B"
        )
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(
            f"{str(file)!r}: router_jitter_noise={hf['router_jitter_noise']} is not supported: expected 0.0"
        )
    return dict(
        num_experts=hf["num_local_experts"],
        num_experts_per_token=hf.get("num_experts_per_tok", 2),
        moe_intermediate_size=hf["intermediate_size"],
        num_shared_experts=0,
        moe_layer_interval=1,
        router_score="softmax",
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _rope_of(hf: dict, file: str) -> tuple[object, Optional[RopeScaling]]:
    """``(rope_theta, rope scaling or None)`` of a Hugging Face ``config.json`` dict: ``rope_parameters``
    (transformers 5) and ``rope_scaling`` (older writers) read together (``file`` names it in errors).

    Raises:
        ValueError: a rope type other than ``"default"`` and ``"llama3"``.
    """
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"{str(file)!r}: rope type {kind!r} is not supported: expected 'default' or 'llama3'")
    scaling = None
    if kind == "llama3":
        scaling = RopeScaling(**{f.name: rope[f.name] for f in dataclasses.fields(RopeScaling) if f.name in rope})
    return theta, scaling


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (>= 1) in increasing order (the valid sizes an error message lists), in ``O(sqrt(n))``
    steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _preset(fields: dict[str, Any]) -> LlamaConfig:
    """The ``LlamaConfig`` of one row of :data:`~lightning_4d.models.presets.PRESET_FIELDS` (validated)."""
    scaling = fields.get("rope_scaling")
    return LlamaConfig(**({**fields, "rope_scaling": RopeScaling(**scaling)} if scaling else fields))


#: the model presets by name, in definition order (their table: :mod:`lightning_4d.models.presets`)
PRESETS: dict[str, LlamaConfig] = {name: _preset(fields) for name, fields in PRESET_FIELDS.items()}


def _allow_in_weights_only_checkpoints() -> None:
    """Let ``torch.load(weights_only=True)`` (Lightning's default) read checkpoints whose hyper-parameters hold a
    ``LlamaConfig``: the two dataclasses are plain data."""
    try:
        import torch.serialization

        torch.serialization.add_safe_globals([LlamaConfig, RopeScaling])
    except (ImportError, AttributeError):  # pragma: no cover - torch without safe globals
        pass


if "torch" in sys.modules:  # else lightning_4d.models.llama registers them: the config stays importable without torch
    _allow_in_weights_only_checkpoints()
