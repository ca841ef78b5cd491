"""Causal multi-head attention with grouped-query attention (GQA), behind three interchangeable backends.

Scaled dot-product attention (Vaswani et al. 2017, "Attention Is All You Need", arXiv 1706.03762, eq. 1):
``softmax(q k^T / sqrt(head_dim) + causal mask) v``, where position ``t`` attends to positions ``<= t``.

Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): with ``n_q`` query heads and ``n_kv`` key/value
heads, query head ``j`` uses kv head ``j // (n_q // n_kv)``. This is Meta's ``repeat_kv`` (``llama/model.py`` of
github.com/meta-llama/llama3: each kv head repeated ``n_rep`` times consecutively, i.e. ``repeat_interleave`` on the
head dimension), PyTorch's ``scaled_dot_product_attention(enable_gqa=True)`` and flash-attn's convention ("if Q has
6 heads and K, V have 2 heads, head 0, 1, 2 of Q will attention to head 0 of K, V").

Backends:

- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (PyTorch >= 2.5),
  which picks a fused kernel (flash / memory-efficient / cuDNN / math) for the device and dtype.
- ``"flash"``: ``flash_attn.flash_attn_func(causal=True)`` from flash-attn 2 (Dao 2023, arXiv 2307.08691); CUDA
  tensors in float16 / bfloat16 only.
- ``"eager"``: explicit matmuls, mask and softmax in float32 (float64 for float64 inputs); the reference the others
  are tested against.

Document masking (``mask``, :mod:`lightning_4d.models.document_mask`): a ``[b, 1, s, s]`` mask of the allowed (query,
key) pairs (boolean, or additive in the query's dtype) replaces the causal mask; ``"sdpa"`` passes it as
``attn_mask`` (PyTorch picks a kernel that takes a mask: on CPU the fused flash kernel, on CUDA the memory-efficient
one), ``"eager"`` adds it to the scores (a boolean one: the scores it refuses at ``-inf``); ``"flash"``
(flash-attn's fixed-length kernel) takes no mask and is refused.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("sdpa", "flash", "eager")


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def available_backends() -> list[str]:
    """Backends usable on this machine: always ``"sdpa"`` and ``"eager"``; ``"flash"`` too when the ``flash_attn``
    package is installed and CUDA is available."""
    names = ["sdpa", "eager"]
    if _flash_attn_installed() and torch.cuda.is_available():
        names.append("flash")
    return names


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q, k, v of shape [b, s, heads, head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}."
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape.")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, sequence and head_dim "
            "(self-attention: [b, s, heads, head_dim])."
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[2]}) must be a multiple of the number of kv heads ({k.shape[2]})."
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")


def sdpa_repeats_kv_heads(q: Tensor, k: Tensor) -> bool:
    """Whether :func:`_sdpa` repeats the kv heads itself: float32 on CUDA with fewer kv than query heads. There
    SDPA's only GQA-capable fused kernel (flash) takes 16-bit inputs, and ``enable_gqa=True`` falls back to the math
    kernel, which materializes the ``[b, heads, s, s]`` scores: measured on an H200 (torch 2.11, ``small`` preset,
    b=8, s=2048, full checkpointing, ``32-true``) 4.30 GiB allocated against 0.50 GiB estimated. With the heads
    repeated the memory-efficient kernel runs; it saves the repeated k and v (``lightning_4d.planning.model`` counts
    them for ``device_type="cuda"``)."""
    return q.is_cuda and q.dtype == torch.float32 and q.shape[2] != k.shape[2]


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    out = sdpa_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask)
    return out.transpose(1, 2)


def sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, mask: Optional[Tensor] = None
) -> Tensor:
    """Causal ``F.scaled_dot_product_attention`` on ``[b, heads, s, d]`` tensors (k, v with kv heads, which divide
    the query heads), GQA by ``enable_gqa=True`` or, where :func:`sdpa_repeats_kv_heads` says so (float32 on CUDA),
    by repeating the kv heads first. ``scale`` defaults to ``1/sqrt(d)``; ``mask`` (``BoolTensor [b, 1, s, s]``, a
    document mask that already holds the causal one) replaces the causal mask. Used by the ``"sdpa"`` backend and by
    the transformers adapters (``lightning_4d.adapters.hf_llama.attention``), so both take the same kernel."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and sdpa_repeats_kv_heads(q.transpose(1, 2), k.transpose(1, 2)):
        n_rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), False
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    n_rep = q.shape[2] // k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    # [b, s, h, d] -> [b, h, s, d], kv heads repeated so that query head j meets kv head j // n_rep
    qh = q.to(compute).transpose(1, 2)
    kh = k.to(compute).repeat_interleave(n_rep, dim=2).transpose(1, 2)
    vh = v.to(compute).repeat_interleave(n_rep, dim=2).transpose(1, 2)
    s = q.shape[1]
    scores = torch.matmul(qh, kh.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [b, h, s, s]
    if mask is not None and mask.dtype != torch.bool:  # the additive form (0 / -inf)
        scores = scores + mask.to(compute)
    else:
        refused = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(diagonal=1) if mask is None else ~mask
        scores = scores.masked_fill(refused, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh)  # [b, h, s, d]
    return out.transpose(1, 2).to(q.dtype)


def _flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if not _flash_attn_installed():
        raise RuntimeError(
            "attention_backend='flash' needs the flash-attn package, which is not installed "
            "(pip install 'lightning-4d[flash]' on a CUDA machine); use attention_backend='sdpa' instead."
        )
    if not q.is_cuda:
        raise RuntimeError(
            f"attention_backend='flash' needs CUDA tensors; got tensors on {q.device}. Use attention_backend='sdpa' "
            "(or 'eager') on this device."
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(
            f"attention_backend='flash' supports float16 and bfloat16 only; got {q.dtype}. Train with "
            "precision='bf16-mixed' / 'bf16-true', or use attention_backend='sdpa'."
        )
    from flash_attn import flash_attn_func

    # flash-attn takes [b, s, heads, d] directly and supports GQA (k/v with fewer heads)
    return flash_attn_func(q, k, v, causal=True)


def attention(q: Tensor, k: Tensor, v: Tensor, backend: str = "sdpa", mask: Optional[Tensor] = None) -> Tensor:
    """Causal self-attention with grouped-query heads.

    Args:
        q: queries ``[b, s, n_q_heads, head_dim]``.
        k: keys ``[b, s, n_kv_heads, head_dim]``; ``n_q_heads`` must be a multiple of ``n_kv_heads``.
        v: values ``[b, s, n_kv_heads, head_dim]``.
        backend: ``"sdpa"``, ``"flash"`` or ``"eager"`` (see the module docstring).
        mask: ``None`` (causal), or the allowed (query, key) pairs of document masking ``[b, 1, s, s]``
            (:func:`lightning_4d.models.document_mask.window_mask`; every query allows at least itself): boolean, or
            additive (0 / ``-inf``) in ``q``'s dtype.

    Returns:
        ``[b, s, n_q_heads, head_dim]`` in ``q``'s dtype (possibly non-contiguous; reshape, not view, to merge heads).
        Softmax scale ``1 / sqrt(head_dim)``; no dropout.

    Raises:
        ValueError: an unknown backend, shapes / dtypes that do not fit together, or a ``mask`` with ``"flash"``.
        RuntimeError: ``"flash"`` without flash-attn installed, on a non-CUDA device, or with a dtype other than
            float16 / bfloat16.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} is not valid: expected one of {list(BACKENDS)}.")
    _check_shapes(q, k, v)
    if backend == "sdpa":
        return _sdpa(q, k, v, mask)
    if backend == "eager":
        return _eager(q, k, v, mask)
    if mask is not None:
        raise ValueError(MASK_BACKEND_ERROR)
    return _flash(q, k, v)


#: the refusal of document masking with flash-attn's fixed-length kernel (checked up front by the task)
MASK_BACKEND_ERROR = (
    "document_masking=True is not supported with attention_backend='flash' yet (flash-attn's fixed-length kernel "
    "takes no mask): use attention_backend='sdpa' or 'eager' with document masking."
)
