"""Data-parallel gradient compression for the ZeRO 0/1 buckets (``parallel/grad_buffers.py``): PowerSGD.

``gradient_compression="bf16"`` needs no state: the bucket is cast to bfloat16 for its collective and back
(``GradientBuckets``; under ZeRO 2/3 FSDP2's ``reduce_dtype``). ``"powersgd"`` (Vogels, Karimireddy and Jaggi 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", arXiv 1905.13727, Algorithm 1 with
error feedback, warm start of §3) replaces, for every matrix gradient ``G`` (``m × n``, the local shard of a
tensor-parallel one) whose rank-r form is smaller (``r·(m + n) < m·n``), the all-reduce of ``G`` by two all-reduces
of ``r·(m + n)`` values:

1. ``M = G + E`` (E: this rank's error of the previous step, zero at first);
2. ``P = M·Q`` (``m × r``; Q: the previous step's, warm start, or at the first step a random normal matrix from a
   generator seeded alike on every rank), all-reduced (sum), then orthonormalized (reduced QR);
3. ``Q = Mᵀ·P`` (``n × r``), all-reduced and divided by D: ``Q = mean(M)ᵀ·P``;
4. the gradient the optimizer sees: ``P·Qᵀ``, the projection of the ranks' mean ``M`` on the columns of P;
   ``E = M − P·Qᵀ`` (what this rank's update missed, added back next step).

Vectors (norm weights) and matrices too small to gain are all-reduced uncompressed. Bytes per step for a matrix:
``2·(D−1)/D·w·r·(m + n)`` instead of ``2·(D−1)/D·4·m·n``, ``w`` the bytes of a factor element on the wire (4, or 2
with ``comm_dtype=torch.bfloat16``: P and Q are cast for their all-reduces and summed in bfloat16, the
orthonormalization and the error stay float32). State per compressed matrix, saved in checkpoints: E (float32,
``m × n``) and Q (float32, ``n × r``).

``start_step`` (PyTorch's ``start_powerSGD_iter`` of its DDP ``powerSGD_hook``, which its documentation recommends for
accuracy): the first ``start_step`` optimizer steps reduce every gradient exactly (the caller's ordinary
collective: ZeRO 1's reduce-scatter), compression starts after them, with E zero and Q random.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.partition import powersgd_compressible as compressible

__all__ = ["PowerSGD", "compressible"]

#: seed of the first step's random Q (identical on every rank: every rank draws the matrices in the same order)
POWERSGD_SEED = 0


class PowerSGD:
    """PowerSGD state and reduction over one process group (module docstring).

    Args:
        rank: r, the rank of the approximation.
        group: the data-parallel process group (``dp_cp``).
        start_step: the optimizer steps before compression starts (:meth:`active`).
        comm_dtype: the dtype P and Q are all-reduced in (``None``: float32; ``torch.bfloat16``: half the bytes).

    Attributes:
        errors: ``{key: E}`` float32 ``[m, n]`` per compressed matrix.
        qs: ``{key: Q}`` float32 ``[n, r]`` per compressed matrix.
    """

    def __init__(self, rank: int, group: Any, start_step: int = 0, comm_dtype: Optional[torch.dtype] = None) -> None:
        self.rank = rank
        self.group = group
        self.start_step = start_step
        self.comm_dtype = comm_dtype
        self.world = dist.get_world_size(group)
        self.errors: dict[Any, Tensor] = {}
        self.qs: dict[Any, Tensor] = {}
        self._generator: Optional[torch.Generator] = None

    def _first_q(self, n: int, device: torch.device) -> Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(POWERSGD_SEED)
        return torch.randn(n, self.rank, generator=self._generator).to(device)

    def active(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based, ``trainer.global_step``) is compressed: ``step >= start_step``."""
        return step >= self.start_step

    @torch.no_grad()
    def reduce(self, matrices: list[tuple[Any, Tensor]], vectors: list[Tensor]) -> None:
        """Replace each gradient, in place, by its data-parallel mean: ``matrices`` (``(key, [m, n] view)``, all
        :func:`compressible`) by their PowerSGD approximation, ``vectors`` (flat views) exactly.

        Collective over ``group``: every rank calls it with the same keys and shapes in the same order.
        """
        if vectors:
            flat = torch.cat([v.reshape(-1).float() for v in vectors])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            offset = 0
            for v in vectors:
                v.reshape(-1).copy_(flat[offset : offset + v.numel()])
                offset += v.numel()
        if not matrices:
            return
        ms = []
        for key, g in matrices:
            m = g.float()
            if key in self.errors:
                m = m + self.errors[key]
            if key not in self.qs:
                self.qs[key] = self._first_q(m.shape[1], m.device)
            ms.append(m)
        ps = [m @ self.qs[key] for m, (key, _) in zip(ms, matrices)]
        self._all_reduce(ps)
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in ps]
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        self._all_reduce(qs)
        for (key, g), m, p, q in zip(matrices, ms, ps, qs):
            q.div_(self.world)
            approx = p @ q.t()
            self.errors[key] = m - approx
            self.qs[key] = q
            g.copy_(approx)

    def _all_reduce(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` over the group in one all-reduce of their concatenation (in ``comm_dtype``)."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.comm_dtype is not None:
            flat = flat.to(self.comm_dtype)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def state(self, names: dict[Any, str]) -> dict[str, dict[str, Tensor]]:
        """``{name: {"error": E, "q": Q}}`` (for checkpoints; ``names`` maps keys to parameter names)."""
        return {names[k]: {"error": self.errors[k].cpu(), "q": self.qs[k].cpu()} for k in self.qs if k in names}

    def load_state(self, names: dict[Any, str], state: dict[str, dict[str, Tensor]], device: torch.device) -> None:
        """Restore :meth:`state` onto ``device`` (every compressed matrix's E and Q, so the first-step generator is
        not drawn from again)."""
        for key, name in names.items():
            if name in state:
                self.errors[key] = state[name]["error"].to(device)
                self.qs[key] = state[name]["q"].to(device)

    def tensors(self) -> list[Tensor]:
        """The state tensors (for byte counts)."""
        return [*self.errors.values(), *self.qs.values()]


# ---------------------------------------------------------------------------------------------------- pipeline sends
#: the largest finite float8 e4m3 value (``torch.finfo(torch.float8_e4m3fn).max``): a tensor is scaled so that its
#: largest magnitude lands there
FLOAT8_MAX = 448.0


def encode_float8(x: Tensor) -> Tensor:
    """``x`` ``[b, ...]`` as float8 e4m3 with one float32 scale for the whole tensor (``amax / 448``), packed as the
    bytes of a bfloat16 tensor ``[b, (n + n % 2 + 4) / 2]`` (n = elements per sample; each row ends with the scale's
    4 bytes): a floating-point tensor that autograd and the pipeline's send and receive carry as they are (gloo has no
    float8), a quarter of ``x``'s float32 bytes."""
    b = x.shape[0]
    flat = x.reshape(b, -1).float()
    scale = flat.abs().amax().clamp(min=torch.finfo(torch.float32).tiny) / FLOAT8_MAX
    q = (flat / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    tail = scale.reshape(1).expand(b).contiguous().view(torch.uint8).reshape(b, 4)
    return torch.cat([q, tail], dim=1).view(torch.bfloat16)


def decode_float8(wire: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`encode_float8`: a ``dtype`` tensor of ``shape`` (``shape[0]`` rows)."""
    raw = wire.contiguous().view(torch.uint8)
    n = 1
    for d in shape[1:]:
        n *= d
    scale = raw[0, -4:].contiguous().view(torch.float32)
    return (raw[:, :n].contiguous().view(torch.float8_e4m3fn).float() * scale).reshape(shape).to(dtype)


class SendFloat8(torch.autograd.Function):
    """At a stage's output: the activation as the float8 wire (:func:`encode_float8`); its gradient comes back as a
    float8 wire too and is decoded to the activation's dtype."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: D102
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return encode_float8(x)

    @staticmethod
    def backward(ctx: Any, grad_wire: Tensor) -> Tensor:  # noqa: D102
        return decode_float8(grad_wire, ctx.shape, ctx.dtype)


class ReceiveFloat8(torch.autograd.Function):
    """At a stage's input: the float8 wire decoded to ``[b, n / last_dim, last_dim]`` in ``dtype``; the gradient
    goes back encoded."""

    @staticmethod
    def forward(ctx: Any, wire: Tensor, last_dim: int, dtype: torch.dtype) -> Tensor:  # noqa: D102
        n = 2 * wire.shape[1] - 4
        n -= n % last_dim  # the pad byte of an odd element count
        return decode_float8(wire, torch.Size((wire.shape[0], n // last_dim, last_dim)), dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        return encode_float8(grad), None, None
