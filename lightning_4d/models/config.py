"""``LlamaConfig``: the shape of a Llama 2 / Llama 3 decoder, its presets and its analytic parameter count.

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

All fields are typed and defaulted so that jsonargparse / ``LightningCLI`` can build a config from YAML.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Optional, Union

ATTENTION_BACKENDS = ("sdpa", "flash", "eager")


def _check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: expected a positive integer (1, 2, 3, ...).")


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

    Raises:
        ValueError: a non-positive size, ``hidden_size`` not divisible by ``num_heads``, ``num_heads`` not divisible
            by ``num_kv_heads``, an odd head dimension, an unknown ``attention_backend`` or
            ``pad_vocab_to_multiple_of < 1``. The message names the bad value and what would be valid.
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

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_seq_length",
        ):
            _check_positive_int(name, getattr(self, name))
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
            valid = [d for d in range(1, h + 1) if h % d == 0 and (h // d) % 2 == 0]
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; valid num_heads "
                f"for this hidden_size (with an even head dimension): {valid}."
            )
        if self.num_heads % self.num_kv_heads != 0:
            valid = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
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
                raise ValueError(f"rope_scaling={self.rope_scaling!r} is not valid: unknown field(s) {unknown}; "
                                 f"valid: {valid}.")
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling={self.rope_scaling!r} is not valid: expected None, a RopeScaling or a dict of its "
                "fields."
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

        No biases (Meta's reference uses ``bias=False`` everywhere).
        """
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        a, k, v = self.num_heads, self.num_kv_heads, self.padded_vocab_size
        attention = h * a * d + 2 * h * k * d + a * d * h
        feed_forward = 3 * h * f
        block = attention + feed_forward + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * block + v * h + h + head

    def flops_per_token(self, seq_length: int) -> float:
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

        Raises:
            ValueError: ``seq_length`` is not a positive integer.
        """
        _check_positive_int("seq_length", seq_length)
        return float(6 * self.num_parameters() + 12 * self.num_layers * self.hidden_size * seq_length)

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
        raise ValueError(f"model_config={str(name)!r} is not valid: expected a preset ({cls.preset_names()}), the "
                         "directory of a Hugging Face Llama (holding config.json), or a LlamaConfig")

    @classmethod
    def from_hf(cls, path: Union[str, "os.PathLike[str]"], **overrides: object) -> "LlamaConfig":
        """The config of a Hugging Face Llama checkpoint: ``path`` is its directory (holding ``config.json``) or the
        ``config.json`` itself (Llama 2, 3, 3.1 / 3.2 with ``rope_scaling`` / ``rope_parameters`` of type
        ``llama3``, tied 3.2). Field mapping (transformers' ``LlamaConfig`` -> ours): ``num_hidden_layers`` ->
        ``num_layers``, ``num_attention_heads`` -> ``num_heads``, ``num_key_value_heads`` -> ``num_kv_heads``
        (default: ``num_heads``), ``max_position_embeddings`` -> ``max_seq_length``, ``rms_norm_eps`` ->
        ``norm_eps``, ``rope_theta`` (top level, or inside ``rope_parameters`` since transformers 5), the llama3
        ``rope_scaling`` fields -> :class:`RopeScaling`; ``vocab_size``, ``hidden_size``, ``intermediate_size``,
        ``tie_word_embeddings`` and ``initializer_range`` keep their names. ``overrides`` are applied last.

        Raises:
            ValueError: the file is missing or not JSON, ``model_type`` is not ``"llama"``, or the checkpoint uses
                what our Llama does not have (biases, an activation other than SiLU, a ``head_dim`` other than
                ``hidden_size / num_attention_heads``, a rope type other than ``default`` / ``llama3``); the
                message names the field.
        """
        import json
        from pathlib import Path

        file = Path(path)
        file = file / "config.json" if file.is_dir() else file
        if not file.is_file():
            raise ValueError(f"{str(path)!r} holds no Hugging Face config.json: pass the model directory written by "
                             "save_pretrained (or the config.json itself)")
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
        if hf.get("model_type") != "llama":
            raise ValueError(f"{str(file)!r}: model_type={hf.get('model_type')!r} is not supported: expected 'llama'")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{str(file)!r}: {flag}=true is not supported (our Llama has no biases)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{str(file)!r}: hidden_act={hf['hidden_act']!r} is not supported: expected 'silu'")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise ValueError(f"{str(file)!r}: head_dim={hf['head_dim']} is not supported: expected hidden_size / "
                             f"num_attention_heads = {hf['hidden_size'] // heads}")
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"{str(file)!r}: rope type {kind!r} is not supported: expected 'default' or 'llama3'")
        scaling = None
        if kind == "llama3":
            scaling = RopeScaling(**{f.name: rope[f.name] for f in dataclasses.fields(RopeScaling) if f.name in rope})
        fields = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            max_seq_length=hf.get("max_position_embeddings", 2048), rope_theta=float(theta), rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """This config as a Hugging Face Llama ``config.json`` dict (the inverse of :meth:`from_hf`; rope scaling
        as transformers 5 writes it, ``rope_parameters`` with ``rope_type`` ``llama3``, and as ``rope_scaling`` for
        older readers). The padded vocabulary rows are not part of it: ``vocab_size`` is the tokenizer's."""
        rope: dict = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(dataclasses.asdict(self.rope_scaling), rope_type="llama3")
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_length, "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta, "rope_parameters": rope,
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings, "initializer_range": self.initializer_range,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        }


def _llama3_scaling(factor: float = 8.0) -> RopeScaling:
    return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


# Sizes from Meta's released params.json files (intermediate sizes as computed by Meta's FeedForward from
# multiple_of / ffn_dim_multiplier); rope_theta 1e4 for Llama 2, 5e5 for Llama 3; norm_eps 1e-5.
PRESETS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
        max_seq_length=4096, rope_theta=10000.0,
    ),
    "llama2-13b": LlamaConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40,
        max_seq_length=4096, rope_theta=10000.0,
    ),
    "llama2-70b": LlamaConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        max_seq_length=4096, rope_theta=10000.0,
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        max_seq_length=8192, rope_theta=500000.0,
    ),
    "llama3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        max_seq_length=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        max_seq_length=8192, rope_theta=500000.0,
    ),
    "llama3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        max_seq_length=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3.1-405b": LlamaConfig(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128, num_kv_heads=8,
        max_seq_length=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        max_seq_length=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(32.0), tie_word_embeddings=True,
    ),
    "llama3.2-3b": LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8,
        max_seq_length=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(32.0), tie_word_embeddings=True,
    ),
    # small models for tests and CPU demos (byte-level vocabulary)
    "tiny-test": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        max_seq_length=512,
    ),
    "tiny": LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=8, num_kv_heads=4,
        max_seq_length=1024,
    ),
    "small": LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_layers=6, num_heads=8, num_kv_heads=4,
        max_seq_length=2048,
    ),
}


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
