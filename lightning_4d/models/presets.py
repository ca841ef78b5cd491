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


def _llama3_scaling(factor: float = 8.0) -> dict[str, Any]:
    """The fields of Llama 3.1's ``RopeScaling`` (``apply_scaling`` of Meta's ``llama/model.py``) at ``factor``."""
    return dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


# Sizes from Meta's released params.json files (intermediate sizes as computed by Meta's FeedForward from
# multiple_of / ffn_dim_multiplier); rope_theta 1e4 for Llama 2, 5e5 for Llama 3; norm_eps 1e-5.
PRESET_FIELDS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_seq_length=4096,
        rope_theta=10000.0,
    ),
    "llama2-13b": dict(
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        max_seq_length=4096,
        rope_theta=10000.0,
    ),
    "llama2-70b": dict(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_seq_length=4096,
        rope_theta=10000.0,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=8192,
        rope_theta=500000.0,
    ),
    "llama3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_seq_length=8192,
        rope_theta=500000.0,
    ),
    "llama3.1-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        max_seq_length=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3.1-405b": dict(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        max_seq_length=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0),
        tie_word_embeddings=True,
    ),
    "llama3.2-3b": dict(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        max_seq_length=131072,
        rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0),
        tie_word_embeddings=True,
    ),
    # Mixture of Experts. Mixtral: transformers' MixtralConfig of mistralai/Mixtral-8x7B-v0.1 and
    # mistral-community/Mixtral-8x22B-v0.1 (config.json): every layer MoE, 8 experts, top-2, softmax router
    "mixtral-8x7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=32768,
        rope_theta=1e6,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=14336,
        router_aux_loss_coef=0.02,
    ),
    "mixtral-8x22b": dict(
        vocab_size=32000,
        hidden_size=6144,
        intermediate_size=16384,
        num_layers=56,
        num_heads=48,
        num_kv_heads=8,
        max_seq_length=65536,
        rope_theta=1e6,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=16384,
        router_aux_loss_coef=0.001,
    ),
    # Llama 4 text models (text_config of meta-llama/Llama-4-Scout-17B-16E and -Maverick-17B-128E): top-1 sigmoid
    # router, one shared expert of the expert width, dense layers of intermediate_size_mlp = 16384 (Maverick: every
    # other layer, interleave_moe_layer_step=2). Estimate / plan only (unimplemented_features). Not represented:
    # Scout's rope_scaling (llama3 type, factor 16, low_freq_factor = high_freq_factor = 1: RopeScaling needs
    # high > low; RoPE does not enter the memory estimate) and Scout's QK norm (no parameters)
    "llama4-scout-17b-16e": dict(
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=16384,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        max_seq_length=10485760,
        rope_theta=500000.0,
        num_experts=16,
        num_experts_per_token=1,
        moe_intermediate_size=8192,
        num_shared_experts=1,
        moe_layer_interval=1,
        router_score="sigmoid",
        router_aux_loss_coef=0.001,
        unimplemented_features=(
            *LLAMA4_UNIMPLEMENTED,
            "QK norm (use_qk_norm)",
            "llama3 rope scaling with low_freq_factor = high_freq_factor",
        ),
    ),
    "llama4-maverick-17b-128e": dict(
        vocab_size=202048,
        hidden_size=5120,
        intermediate_size=16384,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        max_seq_length=1048576,
        rope_theta=500000.0,
        num_experts=128,
        num_experts_per_token=1,
        moe_intermediate_size=8192,
        num_shared_experts=1,
        moe_layer_interval=2,
        router_score="sigmoid",
        router_aux_loss_coef=0.001,
        unimplemented_features=LLAMA4_UNIMPLEMENTED,
    ),
    # small models for tests and CPU demos (byte-level vocabulary)
    "tiny-test": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_length=512,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_length=1024,
    ),
    "tiny-moe": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_length=512,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=64,
    ),
    "small": dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        max_seq_length=2048,
    ),
}
# small with the embedding and the LM head tied (Llama 3.2's shape of weights): the support matrix's tied rows
PRESET_FIELDS["small-tied"] = {**PRESET_FIELDS["small"], "tie_word_embeddings": True}
