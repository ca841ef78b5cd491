"""Rotary position embeddings (RoPE) with the Llama 3.1 frequency scaling, computed on the fly.

RoPE: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv 2104.09864. Meta's
reference (``precompute_freqs_cis`` / ``apply_rotary_emb`` in ``llama/model.py`` of github.com/meta-llama/llama and
github.com/meta-llama/llama3) treats each pair of *adjacent* dimensions ``(2i, 2i+1)`` of a head as one complex number
``x[2i] + j x[2i+1]`` and multiplies it by ``exp(j * p * inv_freq[i])`` at position ``p``. This module computes the
same rotation with real arithmetic (``cos`` / ``sin``) in float32.

Nothing here is cached or registered as a buffer: ``LlamaModel`` is built on the meta device and materialized later,
so the tables are computed in each forward from the positions (they are small: ``s * head_dim / 2`` numbers).
"""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

from lightning_4d.config import zigzag_chunks
from lightning_4d.models.llama_config import LlamaConfig

DeviceLike = Union[torch.device, str, None]


def rope_inv_freq(config: LlamaConfig, device: DeviceLike = None) -> Tensor:
    """Inverse frequencies of the rotary embedding, in radians per token.

    ``inv_freq[i] = rope_theta ** (-2i / head_dim)`` for ``i = 0 .. head_dim/2 - 1`` (RoFormer section 3.2.2; Meta's
    ``precompute_freqs_cis``), then, when ``config.rope_scaling`` is set, Meta's Llama 3.1 ``apply_scaling``
    (``models/llama3/model.py`` of github.com/meta-llama/llama-models; Dubey et al. 2024, arXiv 2407.21783): with
    ``wavelen = 2 pi / inv_freq`` (tokens), ``low = original_max_position_embeddings / low_freq_factor`` and
    ``high = original_max_position_embeddings / high_freq_factor``

    - ``wavelen < high``: unchanged;
    - ``wavelen > low``: divided by ``factor``;
    - otherwise ``(1 - smooth) * inv_freq / factor + smooth * inv_freq`` with
      ``smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
      / (high_freq_factor - low_freq_factor)``.

    Args:
        config: supplies ``head_dim``, ``rope_theta`` and ``rope_scaling``.
        device: where to create the tensor (default: the current default device).

    Returns:
        float32 tensor of shape ``[head_dim // 2]``.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_context = float(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rope_cos_sin(config: LlamaConfig, positions: Tensor, device: DeviceLike = None) -> tuple[Tensor, Tensor]:
    """Cosine and sine of the rotation angles ``positions * inv_freq``, in float32.

    The angle of position ``p`` and pair ``i`` is ``p * inv_freq[i]`` radians (Meta: ``torch.outer(t, freqs)`` then
    ``torch.polar``), computed in float32 as in the reference (positions up to 2**24 are exact in float32).

    Args:
        config: the model config (see :func:`rope_inv_freq`).
        positions: integer token positions, ``LongTensor`` of shape ``[s]`` (shared by the batch) or ``[b, s]``.
        device: where to compute (default: ``positions.device``).

    Returns:
        ``(cos, sin)``, each float32 of shape ``[s, head_dim // 2]`` or ``[b, s, head_dim // 2]``.

    Raises:
        ValueError: ``positions`` is not 1-D or 2-D, or is a floating-point tensor.
    """
    if positions.ndim not in (1, 2):
        raise ValueError(f"positions has shape {tuple(positions.shape)}: expected [s] or [b, s].")
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions has dtype {positions.dtype}: expected integer token positions (torch.long).")
    device = positions.device if device is None else device
    inv_freq = rope_inv_freq(config, device=device)
    angles = positions.to(device=device, dtype=torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each adjacent pair ``(x[..., 2i], x[..., 2i+1])`` of every head by the angle whose cosine / sine are
    ``cos[..., i]`` / ``sin[..., i]``.

    Equivalent to Meta's ``apply_rotary_emb``: ``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) *
    freqs_cis).flatten(3).type_as(x)``, i.e. ``(x0 + j x1) * (cos + j sin)``:
    ``out0 = x0 cos - x1 sin``, ``out1 = x0 sin + x1 cos``.

    Args:
        x: ``[b, s, n_heads, head_dim]`` queries or keys (any floating dtype; ``n_heads`` may be a local shard).
        cos, sin: ``[s, head_dim // 2]`` or ``[b, s, head_dim // 2]`` from :func:`rope_cos_sin`.

    Returns:
        The rotated tensor, same shape and dtype as ``x``. The arithmetic runs in float32, or in float64 when ``x``
        or ``cos`` is float64.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if x.ndim != 4:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected [b, s, n_heads, head_dim].")
    if cos.shape != sin.shape or cos.ndim not in (2, 3):
        raise ValueError(
            f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)}: expected equal shapes [s, head_dim/2] or "
            "[b, s, head_dim/2]."
        )
    if x.shape[-1] != 2 * cos.shape[-1] or x.shape[1] != cos.shape[-2]:
        raise ValueError(
            f"x has shape {tuple(x.shape)} but cos has shape {tuple(cos.shape)}: expected cos[..., s, head_dim/2] with "
            f"s={x.shape[1]} and head_dim/2={x.shape[-1] // 2}."
        )
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    # [s, d/2] -> [1, s, 1, d/2]; [b, s, d/2] -> [b, s, 1, d/2]
    cos = cos.to(compute).unsqueeze(-2)
    sin = sin.to(compute).unsqueeze(-2)
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    x0, x1 = x.to(compute).unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def context_parallel_positions(local_length: int, cp_rank: int, cp_size: int, device: DeviceLike = None) -> Tensor:
    """Positions of the tokens a context-parallel rank holds under the load-balanced ("zigzag") split.

    The full sequence of ``s = local_length * cp_size`` tokens is cut into ``2c`` chunks of ``C = s / 2c``; rank
    ``i`` holds chunks ``i`` and ``2c - 1 - i`` (:func:`lightning_4d.config.zigzag_chunks`), so its positions are
    ``[iC, (i+1)C) ++ [(2c-1-i)C, (2c-i)C)``. With ``cp_size = 1``: ``arange(local_length)``.

    Returns:
        ``LongTensor [local_length]``.

    Raises:
        ValueError: ``local_length`` odd while ``cp_size > 1``, or ``cp_rank`` outside ``0 .. cp_size - 1``.
    """
    if cp_size == 1:
        return torch.arange(local_length, device=device)
    if local_length % 2 != 0 or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"local_length={local_length}, cp_rank={cp_rank}, cp_size={cp_size}: expected an even local length and "
            "0 <= cp_rank < cp_size."
        )
    chunk = local_length // 2
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in zigzag_chunks(cp_rank, cp_size)])
