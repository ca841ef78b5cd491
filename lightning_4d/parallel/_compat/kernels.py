"""Private compute kernels: torch's grouped GEMM (the MoE layers' stacked feed-forwards), ATen's fused flash attention
and flash-attn 2's kernels (context parallelism's attention, which needs the log-sum-exp the public SDPA does not
return)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import Tensor

#: ``torch._grouped_mm(x [N, k], w [G, k, n], offs=int32 [G]) -> [N, n]``: one GEMM per row group of ``x`` (group g the
#: rows up to ``offs[g]``) with ``w[g]``, CUDA and bfloat16 (the MoE layers' stacked feed-forwards,
#: ``lightning_4d/features/moe/layer.py``, as in torchtitan's MoE); ``None`` on a torch without it (the loop then)
try:
    grouped_mm = torch._grouped_mm
except AttributeError:  # pragma: no cover - torch < 2.8
    grouped_mm = None


#: the tensors both ATen flash backward kernels take first: the output gradient, q, k, v, the output and the
#: log-sum-exp the forward returned
_ATEN_FLASH_BACKWARD_TENSORS = ("grad_out", "query", "key", "value", "out", "logsumexp")
#: ATen's fused flash-attention kernels that return the log-sum-exp (the public SDPA does not); each name with the
#: leading arguments it is called with (``tests/test_compat.py`` checks these against the op schemas)
ATEN_FLASH_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": ("query", "key", "value", "dropout_p", "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (*_ATEN_FLASH_BACKWARD_TENSORS, "dropout_p", "is_causal"),
    "_scaled_dot_product_flash_attention": ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"),
    "_scaled_dot_product_flash_attention_backward": (
        *_ATEN_FLASH_BACKWARD_TENSORS,
        "cum_seq_q",
        "cum_seq_k",
        "max_q",
        "max_k",
        "dropout_p",
        "is_causal",
        "philox_seed",
        "philox_offset",
    ),
}


#: the head dimensions ATen's CUDA flash kernel takes: the public SDPA's guard (``check_head_dim_size_flash``: a
#: multiple of 8, at most 256); the private kernels called here skip that guard
ATEN_FLASH_MAX_HEAD_DIM = 256


def aten_flash_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ATen's CUDA flash kernel (:func:`aten_flash_forward` off the CPU) takes ``[b, heads, s, head_dim]``
    blocks of ``dtype``: float16 or bfloat16, ``head_dim`` a multiple of 8 and at most
    :data:`ATEN_FLASH_MAX_HEAD_DIM`."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= ATEN_FLASH_MAX_HEAD_DIM


def aten_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """``(out, logsumexp)`` of ATen's flash kernel on ``[b, heads, s, d]`` tensors (k, v with as many heads as q), no
    dropout: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype),
    ``_scaled_dot_product_flash_attention`` elsewhere (CUDA, float16/bfloat16). ``mask`` (CPU only): an additive
    ``[b, 1, s_q, s_k]`` mask in q's dtype (the CPU kernel refuses a boolean one); a query row it refuses entirely
    comes back with output 0 and log-sum-exp 0 (measured on torch 2.13), which the caller corrects.

    Raises:
        ValueError: a ``mask`` on CUDA (its flash kernel takes none).
    """
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse
    if mask is not None:
        raise ValueError("ATen's CUDA flash kernel takes no attention mask")
    res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def aten_flash_backward(
    dout: Tensor,
    qkv: tuple[Tensor, Tensor, Tensor],
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`aten_flash_forward` of ``qkv = (q, k, v)`` given the output gradient and the final
    ``out`` and ``lse`` (``[b, heads, s_q]`` float32; made contiguous here, as the CUDA kernel reads it as a dense
    array); ``mask``: as in :func:`aten_flash_forward` (CPU only).

    On CUDA the cumulative sequence lengths are passed as ``None`` (an undefined tensor, as the forward returns them
    for dense batches): a defined one, even empty, selects the variable-length kernel, which wants int32 lengths
    (``RuntimeError: cu_seqlens_q must have dtype int32``). The random-number state arguments are unused without
    dropout; they are passed as the forward returns them on this device and torch version
    (:func:`_flash_rng_state`)."""
    aten = torch.ops.aten
    q, k, v = qkv
    lse = lse.contiguous()
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
        return dq, dk, dv
    if mask is not None:
        raise ValueError("ATen's CUDA flash kernel takes no attention mask")
    sq, sk = q.shape[2], k.shape[2]
    seed, offset = _flash_rng_state(q.device, q.dtype)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _flash_rng_state(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(philox_seed, philox_offset)`` as ATen's flash forward returns them on ``device`` (their dtype, shape and
    device changed across torch versions), from one forward on a ``[1, 1, 8, 8]`` block, once per device and dtype."""
    tiny = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype)
    res = torch.ops.aten._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, False, False)
    return res[6], res[7]


# ---------------------------------------------------------------------------------------------------- flash-attn
#: the extra that installs the flash-attn range whose private kernels :func:`flash_attn_forward` calls
FLASH_ATTN_EXTRA = "lightning-4d[flash]"
#: the options both private kernels of ``flash_attn.flash_attn_interface`` take after their tensors, in order
#: (flash-attn 2.7.0 - 2.8.x: ``window_size_left/right`` and ``softcap``; 2.6 took a ``window_size`` tuple)
_FLASH_ATTN_OPTIONS = (
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
)
#: the private functions of ``flash_attn.flash_attn_interface`` used, and the leading parameters they are called with
FLASH_ATTN_FUNCTIONS = {
    "_flash_attn_forward": ("q", "k", "v", *_FLASH_ATTN_OPTIONS, "return_softmax"),
    "_flash_attn_backward": (
        "dout",
        "q",
        "k",
        "v",
        "out",
        "softmax_lse",
        "dq",
        "dk",
        "dv",
        *_FLASH_ATTN_OPTIONS,
        "deterministic",
    ),
}


def flash_attn_interface() -> Any:
    """``flash_attn.flash_attn_interface``, imported on first use.

    Raises:
        ImportError: flash-attn is not installed (or lacks the functions of :data:`FLASH_ATTN_FUNCTIONS`).
    """
    try:
        from flash_attn import flash_attn_interface as fa
    except ImportError as err:
        raise ImportError(
            f"the 'flash' attention kernel needs flash-attn 2.7-2.8, which is not installed: pip install "
            f"'{FLASH_ATTN_EXTRA}' on a CUDA machine, or use the 'sdpa' kernel."
        ) from err
    missing = [name for name in FLASH_ATTN_FUNCTIONS if name not in vars(fa)]
    if missing:
        raise ImportError(
            f"the installed flash-attn has no {missing}: the 'flash' kernel needs flash-attn 2.7-2.8 "
            f"(pip install '{FLASH_ATTN_EXTRA}')."
        )
    return fa


def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, softmax_lse)`` of flash-attn 2's forward on ``[b, s, heads, d]`` tensors (GQA native), no dropout, no
    window, no softcap; ``softmax_lse`` is ``[b, heads, s]`` float32."""
    fa = flash_attn_interface()
    out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
    return out, lse


def flash_attn_backward(
    dout: Tensor,
    qkv: tuple[Tensor, Tensor, Tensor],
    out: Tensor,
    lse: Tensor,
    grads: tuple[Tensor, Tensor, Tensor],
    causal: bool,
    scale: float,
    deterministic: bool = False,
) -> None:
    """flash-attn 2's backward of :func:`flash_attn_forward` on ``[b, s, heads, d]`` tensors (``qkv``: its q, k and
    v), writing ``grads`` = (dq, dk, dv) (allocated by the caller) in place."""
    fa = flash_attn_interface()
    (q, k, v), (dq, dk, dv) = qkv, grads
    fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, deterministic)
