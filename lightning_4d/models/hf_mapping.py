"""Our Llama's Hugging Face state-dict adapter: parameter names to and from transformers' ``LlamaForCausalLM`` (and
``MixtralForCausalLM`` for a Mixture-of-Experts config, whose MoE layers' names are the MoE feature's:
:mod:`lightning_4d.features.moe.layer`, "Mixtral names") and the q/k row permutation (torchtitan's
``models/llama3/model/state_dict_adapter.py``, beside the model).

Pure torch, no I/O: :mod:`lightning_4d.families.native_llama` reads Hugging Face directories with it (``init_from``) and
:mod:`lightning_4d.export_hf` writes them (``export-hf``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_4d.features.moe import layer as moe_layer

#: our Llama's per-layer parameter paths -> those of transformers' ``LlamaForCausalLM`` (``model.layers.<i>.``)
HF_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
HF_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: the parameters whose rows Hugging Face stores in rotate-half order (rotary embedding of q and k)
ROTARY = ("attention.wq.weight", "attention.wk.weight")
#: the parameters with one row per (padded) vocabulary entry
VOCABULARY = ("tok_embeddings.weight", "output.weight")


def hf_name(name: str) -> str:
    """The transformers ``LlamaForCausalLM`` state-dict key of our ``LlamaModel`` parameter ``name`` (canonical,
    :func:`lightning_4d.models.llama.canonical_name`): ``"layers.3.attention.wq.weight"`` ->
    ``"model.layers.3.self_attn.q_proj.weight"``.

    Raises:
        ValueError: ``name`` is not a parameter of our Llama.
    """
    if name in HF_TOP:
        return HF_TOP[name]
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers":
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in HF_LAYER:
            return f"model.layers.{parts[1]}.{HF_LAYER[module]}.{leaf}"
        moe = moe_layer.hf_layer_name(name, parts[1], module, leaf)
        if moe is not None:
            return moe
    raise ValueError(
        f"{name!r} is not a parameter of lightning_4d's Llama (expected tok_embeddings, layers.<i>...., norm or output)"
    )


def hf_slices(name: str, config: Any) -> list[tuple[str, Optional[int]]]:
    """The Hugging Face tensors of our parameter ``name`` (``config``: a ``LlamaConfig``): ``[(hf key, index of dim 0
    or None), ...]``. One ``(hf_name(name), None)`` for every parameter but an MoE layer's stacked weights, which are
    one tensor per index of dim 0 (:func:`lightning_4d.features.moe.layer.hf_stacked_slices`).

    Raises:
        ValueError: ``name`` has no Hugging Face name (:func:`hf_name`).
    """
    return moe_layer.hf_stacked_slices(name, config) or [(hf_name(name), None)]


def rotary_from_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a Hugging Face ``q_proj`` / ``k_proj`` weight ``[heads·d, h]`` (any whole number of heads) in our
    order: transformers rotates halves (row ``j`` pairs with ``j + d/2`` in a head), Meta's Llama and ours rotate
    interleaved pairs (``2j`` with ``2j+1``). The inverse of the permutation in transformers'
    ``convert_llama_weights_to_hf.py``: ``w.view(heads, 2, d/2, h).transpose(1, 2)``."""
    heads, h = w.shape[0] // head_dim, w.shape[1]
    return w.reshape(heads, 2, head_dim // 2, h).transpose(1, 2).reshape(heads * head_dim, h)


def rotary_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`rotary_from_hf` (ours -> Hugging Face row order), as transformers' conversion script
    permutes Meta's weights."""
    heads, h = w.shape[0] // head_dim, w.shape[1]
    return w.reshape(heads, head_dim // 2, 2, h).transpose(1, 2).reshape(heads * head_dim, h)


def param_names(config: Any) -> list[str]:
    """The canonical parameter names of an unsplit ``LlamaModel`` of ``config`` (a ``LlamaConfig``; the tied head
    excluded)."""
    names = ["tok_embeddings.weight"]
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            names += [f"layers.{i}.{m}.weight" for m in HF_LAYER if not m.startswith("feed_forward.")]
            names += moe_layer.hf_param_names(config, i)
        else:
            names += [f"layers.{i}.{m}.weight" for m in HF_LAYER]
    names.append("norm.weight")
    if not config.tie_word_embeddings:
        names.append("output.weight")
    return names


def to_hf_tensor(name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """Our parameter ``name``'s full tensor in Hugging Face's form: q/k rows permuted (:func:`rotary_to_hf`), the
    padded vocabulary rows dropped."""
    if name.endswith(ROTARY):
        tensor = rotary_to_hf(tensor, config.head_dim)
    if name in VOCABULARY:
        tensor = tensor[: config.vocab_size]
    return tensor


def hf_tensors(name: str, tensor: torch.Tensor, config: Any) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of our parameter ``name`` from its full ``tensor``: ``[(hf key, tensor), ...]`` in
    Hugging Face's form (:func:`to_hf_tensor`), one per key of :func:`hf_slices` (an MoE layer's stacked weight
    ``[E, d1, d2]``: one ``[d1, d2]`` view per index of dim 0, a Mixtral directory's tensors; every other parameter:
    itself).

    Raises:
        ValueError: ``name`` has no Hugging Face name (:func:`hf_name`).
    """
    t = to_hf_tensor(name, tensor, config)
    return [(hf, t if index is None else t[index]) for hf, index in hf_slices(name, config)]
