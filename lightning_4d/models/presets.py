"""The model presets' table: the fields of ``LlamaConfig`` for Llama 2 / Llama 3 / Llama 4 / Mixtral shapes and the
package's tiny test models, by name. Plain data that imports nothing; :mod:`lightning_4d.models.llama_config` builds
``PRESETS`` (``LlamaConfig.from_preset``, ``--model`` of the CLI) from it.
"""

from __future__ import annotations

from typing import Any

#: what transformers' ``Llama4TextModel`` has and our Llama does not (both Scout and Maverick)
LLAMA4_UNIMPLEMENTED = (
    "NoPE layers (no_rope_layers: every 4th layer without RoPE)",
    "chunked local attention (attention_chunk_size=8192 on the RoPE layers)",
    "attention temperature tuning on the NoPE layers (attn_temperature_tuning)",
)

#: what Scout lacks besides :data:`LLAMA4_UNIMPLEMENTED`: its QK norm and its rope scaling
SCOUT_UNIMPLEMENTED = (
    *LLAMA4_UNIMPLEMENTED,
    "QK norm (use_qk_norm)",
    "llama3 rope scaling with low_freq_factor = high_freq_factor",
)


def _llama3_scaling(factor: float = 8.0) -> dict[str, Any]:
    """The fields of Llama 3.1's ``RopeScaling`` (``apply_scaling`` of Meta's ``llama/model.py``) at ``factor``."""
    return dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


#: the columns of :func:`_shape`'s positional values, the fields every preset gives
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "max_seq_length",
    "rope_theta",
)


def _shape(*values: Any, **fields: Any) -> dict[str, Any]:
    """One preset's fields: ``values`` in the order of :data:`SHAPE_FIELDS` (``rope_theta`` may be left out: the
    default), then ``fields`` (the rest, by name)."""
    return dict(zip(SHAPE_FIELDS, values), **fields)


#: the columns of :func:`_moe`'s positional values: routed experts, top-k, their SwiGLU width
MOE_FIELDS = ("num_experts", "num_experts_per_token", "moe_intermediate_size")


def _moe(*values: Any, **fields: Any) -> dict[str, Any]:
    """A Mixture-of-Experts preset's own fields: ``values`` in the order of :data:`MOE_FIELDS`, then ``fields``."""
    return dict(zip(MOE_FIELDS, values), **fields)


def _llama4(routed: int, interval: int, unimplemented: tuple[str, ...]) -> dict[str, Any]:
    """The MoE fields of a Llama 4 text model: ``routed`` experts of width 8192, top-1, one shared expert, an MoE
    layer every ``interval`` layers, the sigmoid router, aux-loss weight 0.001, what our Llama lacks
    (``unimplemented``)."""
    return _moe(
        routed,
        1,
        8192,
        num_shared_experts=1,
        moe_layer_interval=interval,
        router_score="sigmoid",
        router_aux_loss_coef=0.001,
        unimplemented_features=unimplemented,
    )


# Sizes from Meta's released params.json files (intermediate sizes as computed by Meta's FeedForward from
# multiple_of / ffn_dim_multiplier); rope_theta 1e4 for Llama 2, 5e5 for Llama 3; norm_eps 1e-5. Columns: V, h, f, L,
# a, kv heads, max_seq_length, rope_theta (SHAPE_FIELDS).
PRESET_FIELDS: dict[str, dict[str, Any]] = {
    "llama2-7b": _shape(32000, 4096, 11008, 32, 32, 32, 4096, 10000.0),
    "llama2-13b": _shape(32000, 5120, 13824, 40, 40, 40, 4096, 10000.0),
    "llama2-70b": _shape(32000, 8192, 28672, 80, 64, 8, 4096, 10000.0),
    "llama3-8b": _shape(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0),
    "llama3.1-8b": _shape(128256, 4096, 14336, 32, 32, 8, 131072, 500000.0, rope_scaling=_llama3_scaling(8.0)),
    "llama3-70b": _shape(128256, 8192, 28672, 80, 64, 8, 8192, 500000.0),
    "llama3.1-70b": _shape(128256, 8192, 28672, 80, 64, 8, 131072, 500000.0, rope_scaling=_llama3_scaling(8.0)),
    "llama3.1-405b": _shape(128256, 16384, 53248, 126, 128, 8, 131072, 500000.0, rope_scaling=_llama3_scaling(8.0)),
    "llama3.2-1b": _shape(
        128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, rope_scaling=_llama3_scaling(32.0), tie_word_embeddings=True
    ),
    "llama3.2-3b": _shape(
        128256, 3072, 8192, 28, 24, 8, 131072, 500000.0, rope_scaling=_llama3_scaling(32.0), tie_word_embeddings=True
    ),
    # Mixture of Experts. Mixtral: transformers' MixtralConfig of mistralai/Mixtral-8x7B-v0.1 and
    # mistral-community/Mixtral-8x22B-v0.1 (config.json): every layer MoE, 8 experts, top-2, softmax router
    "mixtral-8x7b": _shape(32000, 4096, 14336, 32, 32, 8, 32768, 1e6, **_moe(8, 2, 14336, router_aux_loss_coef=0.02)),
    "mixtral-8x22b": _shape(32000, 6144, 16384, 56, 48, 8, 65536, 1e6, **_moe(8, 2, 16384, router_aux_loss_coef=0.001)),
    # Llama 4 text models (text_config of meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E): top-1 sigmoid
    # router, one shared expert of the expert width, dense layers of intermediate_size_mlp = 16384 (Maverick: every
    # other layer, interleave_moe_layer_step=2). Estimate / plan only (unimplemented_features). Not represented:
    # Scout's rope_scaling (llama3 type, factor 16, low_freq_factor = high_freq_factor = 1: RopeScaling needs
    # high > low; RoPE does not enter the memory estimate) and Scout's QK norm (no parameters)
    "llama4-scout-17b-16e": _shape(
        202048, 5120, 16384, 48, 40, 8, 10485760, 500000.0, **_llama4(16, 1, SCOUT_UNIMPLEMENTED)
    ),
    "llama4-maverick-17b-128e": _shape(
        202048, 5120, 16384, 48, 40, 8, 1048576, 500000.0, **_llama4(128, 2, LLAMA4_UNIMPLEMENTED)
    ),
    # small models for tests and CPU demos (byte-level vocabulary; rope_theta the default)
    "tiny-test": _shape(256, 64, 128, 2, 4, 2, 512),
    "tiny": _shape(256, 128, 352, 4, 8, 4, 1024),
    "tiny-moe": _shape(256, 64, 128, 2, 4, 2, 512, **_moe(8, 2, 64)),
    "small": _shape(256, 256, 688, 6, 8, 4, 2048),
}
# small with the embedding and the LM head tied (Llama 3.2's shape of weights): the support matrix's tied rows
PRESET_FIELDS["small-tied"] = {**PRESET_FIELDS["small"], "tie_word_embeddings": True}
