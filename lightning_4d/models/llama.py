"""The Llama 2 / Llama 3 decoder-only transformer, following Meta's reference implementation.

Sources: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", arXiv 2307.09288; Dubey et al.
2024, "The Llama 3 Herd of Models", arXiv 2407.21783; reference code ``llama/model.py`` of
github.com/meta-llama/llama (Llama 2), ``llama/model.py`` of github.com/meta-llama/llama3 (Llama 3) and
``models/llama3/model.py`` of github.com/meta-llama/llama-models (Llama 3.1, 3.2: RoPE scaling).

Architecture per block (pre-norm residual)::

    h   = x + Attention(RMSNorm(x))          # GQA, RoPE on q and k, causal
    out = h + FeedForward(RMSNorm(h))        # SwiGLU

then a final RMSNorm and the LM head. Module and parameter names are Meta's (``tok_embeddings``, ``layers.{i}``,
``attention.wq`` ... ``feed_forward.w1`` ... ``attention_norm``, ``ffn_norm``, ``norm``, ``output``), so a Meta
checkpoint maps onto this model name for name (``layers`` is a ``ModuleDict`` keyed ``"0" .. "L-1"``).

Built for parallelism:

- no buffers: rotary tables are computed in ``forward``, so ``with torch.device("meta"): LlamaModel(cfg)`` followed
  by ``model.to_empty(device=...)`` and ``model.init_weights(seed)`` gives a complete model;
- attention derives its local head count from the projected tensors, so tensor parallelism may column-shard
  ``wq``/``wk``/``wv`` and row-shard ``wo``;
- ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` and entries of ``layers`` deleted (a pruned
  model, e.g. one stage of a pipeline split made outside this file): without ``tok_embeddings`` ``forward`` takes
  hidden states;
- :meth:`LlamaModel.init_weights` draws every parameter's full tensor from a generator seeded by (seed, parameter
  name) and keeps this rank's shard, so the weights do not depend on the parallel layout.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_4d.features.moe.layer import MoEFeedForward, MoEModel
from lightning_4d.models.attention_backends import attention
from lightning_4d.models.document_mask import window_mask
from lightning_4d.models.llama_config import LlamaConfig, _allow_in_weights_only_checkpoints
from lightning_4d.models.rope import apply_rotary, context_parallel_positions, rope_cos_sin

# the module levels wrappers insert into parameter names (defined once, below the model and the parallel code);
# removed from parameter names so that a parameter keeps one name on every layout
from lightning_4d.module_tree import MODULE_WRAPPER_PREFIXES

_MASK64 = (1 << 64) - 1

_allow_in_weights_only_checkpoints()


def canonical_name(name: str) -> str:
    """The parameter name without wrapper components.

    Activation checkpointing (``checkpoint_wrapper``: ``_checkpoint_wrapped_module.``), ``torch.compile``
    (``_orig_mod.``) and FSDP1 (``_fsdp_wrapped_module.``) insert a module level into parameter names, anywhere in the
    dotted path. ``"layers.0._checkpoint_wrapped_module.attention.wq.weight"`` -> ``"layers.0.attention.wq.weight"``.
    """
    return ".".join(part for part in name.split(".") if part not in MODULE_WRAPPER_PREFIXES)


def _full_weight(shape: torch.Size, std: Optional[float], seed: Optional[int], device: torch.device) -> Tensor:
    """A parameter's full float32 tensor for :meth:`LlamaModel.init_weights`: ones (``std`` ``None``: an RMSNorm
    weight), else ``Normal(0, std)`` drawn by a generator on ``device`` seeded with ``seed``
    (:func:`_param_seed`)."""
    if std is None:
        return torch.ones(shape, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    full = torch.empty(shape, dtype=torch.float32, device=device)
    full.normal_(mean=0.0, std=std, generator=generator)
    return full


def _copy_piece(p: Tensor, local: Tensor, full: Tensor, local_piece: Optional[Callable[[Tensor, Any], Tensor]]) -> None:
    """Copy this rank's piece of ``full`` into parameter ``p`` (``local``: its local tensor): a DTensor's shard,
    ``local_piece(full, p)`` (a view: nothing beside ``full`` is allocated) or ``distribute_tensor``'s (no
    communication: every rank drew the same ``full``), a plain tensor all of it, cast to the parameter's dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor) and local_piece is not None:  # a view: nothing beside ``full`` is allocated
        local.copy_(local_piece(full, p))
    elif isinstance(p, DTensor):
        shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local.copy_(shard)
    else:
        p.copy_(full)


def _param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``seed`` and a parameter's canonical name, stable across processes and runs.

    ``z = (seed * 2**32 + crc32(name)) mod 2**64`` goes through the splitmix64 finalizer (Steele, Lea & Flood 2014,
    "Fast splittable pseudorandom number generators", OOPSLA; constants of Vigna's ``splitmix64.c``), a bijection of
    64-bit integers that spreads nearby inputs apart; the top bit is dropped so the result is a valid non-negative
    ``torch.Generator`` seed. Python's ``hash`` is not used: it is salted per process for strings.
    """
    z = ((seed & _MASK64) * (1 << 32) + zlib.crc32(name.encode("utf-8"))) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


class _RMSNormFunction(torch.autograd.Function):
    """``y = (x · rrms).to(x.dtype) · weight`` with ``rrms = 1/sqrt(mean(x², last dim) + eps)`` computed in float32
    (float64 for float64 input), saving for backward only ``x`` (as given: the residual stream's tensor, no copy),
    the float32 ``rrms`` ``[..., 1]`` and ``weight``; the normalized tensor is recomputed in backward.

    Backward (with ``n = x·rrms`` in float32, ``g`` the output gradient, ``H`` the last dimension):
    ``dweight = sum(g · n.to(x.dtype))`` over all but the last dimension (in ``weight``'s dtype, as autograd's
    ``mul``), ``gn = (g · weight)`` in float32, ``dx = rrms · (gn − n · mean(gn · n, last dim))`` (the derivative of
    ``x / sqrt(mean(x²) + eps)``; Zhang & Sennrich 2019, arXiv 1910.07467, Eq. 4).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # noqa: D102
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rrms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rrms)
        return (xf * rrms).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:  # noqa: D102
        x, weight, rrms = ctx.saved_tensors
        normed = x.to(rrms.dtype) * rrms
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (grad * normed.type_as(x)).sum(dim=tuple(range(grad.ndim - 1))).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            gn = (grad * weight).to(rrms.dtype)
            dx = (rrms * (gn - normed * (gn * normed).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dweight, None


class RMSNorm(nn.Module):
    """Root-mean-square layer normalization (Zhang & Sennrich 2019, arXiv 1910.07467), as in Meta's ``RMSNorm``.

    ``y = x / sqrt(mean(x**2, last dim) + eps) * weight``, the normalization computed in float32 and cast back to
    ``x``'s dtype before the multiplication by ``weight`` (Meta: ``self._norm(x.float()).type_as(x) * self.weight``).
    float64 inputs are normalized in float64.

    Memory: saves for backward only its input (as given, no copy) and the float32 reciprocal RMS ``[..., 1]``
    (:class:`_RMSNormFunction`; the normalized tensor is recomputed in backward), as Megatron-LM's fused norm does.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square, for numerical stability.

    Shapes: ``x`` ``[..., dim]`` -> ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set ``weight`` to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query heads and rotary position embeddings.

    Submodules (no biases): ``wq`` ``h -> a*d``, ``wk`` ``h -> k*d``, ``wv`` ``h -> k*d``, ``wo`` ``a*d -> h`` with
    ``a`` = num_heads, ``k`` = num_kv_heads, ``d`` = head_dim. As in Meta's ``Attention``: project, reshape to heads,
    rotate q and k (:func:`~lightning_4d.models.rope.apply_rotary`), attend causally
    (:func:`~lightning_4d.models.attention_backends.attention`, scale ``1/sqrt(d)``), merge heads, project with ``wo``.

    The number of heads is read from the projected tensors (``view(b, s, -1, d)``), not from the config, so a
    tensor-parallel shard holding ``a/t`` query and ``k/t`` kv heads runs unchanged.

    ``core_attention``: ``None`` (plain causal attention over the tokens given), or a callable ``(q, k, v, backend,
    document_ids) -> out`` that replaces it; context parallelism sets one that attends over the whole sequence of the
    cp group (``LlamaFamily.apply_context_parallel``, :mod:`lightning_4d.families.native_llama`).

    ``input_projection``: ``None`` (``wq(x)``, ``wk(x)``, ``wv(x)``), or a callable ``(x, (wq, wk, wv)) -> (q, k, v)``
    that replaces the three projections; sequence parallelism sets one that saves only this rank's sequence shard of
    ``x`` for backward (:func:`lightning_4d.features.tensor_parallel.runtime.apply_tensor_parallel`).

    ``output_projection``: ``None`` (``wo(out)``), or a callable ``(out, wo) -> y`` that replaces it;
    the tp ring overlap sets the ring matmul-reduce-scatter
    (:func:`lightning_4d.features.tensor_parallel.runtime.ring_output_projection`).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.backend = config.attention_backend
        self.core_attention = None
        self.input_projection = None
        self.output_projection = None
        self.wq = nn.Linear(h, config.num_heads * d, bias=False)
        self.wk = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        document_ids: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Args: ``x`` ``[b, s, h]``; ``cos``, ``sin`` ``[s, d/2]`` or ``[b, s, d/2]`` float32 (from
        :func:`~lightning_4d.models.rope.rope_cos_sin`); document masking (:mod:`lightning_4d.models.document_mask`):
        ``mask`` ``BoolTensor [b, 1, s, s]`` for plain attention, ``document_ids`` ``LongTensor [b, s_full]`` (the
        whole sequence) for ``core_attention``. Returns ``[b, s, h]``."""
        if self.input_projection is not None:
            q, k, v = self.input_projection(x, (self.wq, self.wk, self.wv))
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.core_attention is not None:
            out = self.core_attention(q, k, v, self.backend, document_ids)
        else:
            out = attention(q, k, v, self.backend, mask)  # [b, s, local heads, d]
        out = out.reshape(b, s, -1)
        return self.wo(out) if self.output_projection is None else self.output_projection(out, self.wo)


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202; Meta's
    ``FeedForward``): ``w2(silu(w1 x) * w3 x)``.

    Submodules (no biases): ``w1`` gate ``h -> f``, ``w3`` up ``h -> f``, ``w2`` down ``f -> h``.
    Shapes: ``[b, s, h]`` -> ``[b, s, h]`` (``f`` may be a tensor-parallel shard).

    ``input_projection``: ``None`` (``w1(x)``, ``w3(x)``), or a callable ``(x, (w1, w3)) -> (gate, up)`` replacing
    them (see :class:`Attention`); ``output_projection``: ``None`` (``w2(z)``), or a callable ``(z, w2) -> y``
    replacing it (see :class:`Attention`).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_projection = None
        self.output_projection = None
        h, f = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(h, f, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_projection is not None:
            gate, up = self.input_projection(x, (self.w1, self.w3))
        else:
            gate, up = self.w1(x), self.w3(x)
        z = F.silu(gate) * up
        return self.w2(z) if self.output_projection is None else self.output_projection(z, self.w2)


class TransformerBlock(nn.Module):
    """One pre-norm decoder block (Meta's ``TransformerBlock``)::

        h   = x + attention(attention_norm(x), cos, sin)
        out = h + feed_forward(ffn_norm(h))

    ``feed_forward`` is a :class:`FeedForward`, or in an MoE layer (``config.is_moe_layer(layer_index)``) a
    :class:`~lightning_4d.features.moe.layer.MoEFeedForward`.

    Shapes: ``x`` ``[b, s, h]`` -> ``[b, s, h]``.
    """

    def __init__(self, config: LlamaConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.feed_forward: nn.Module = (
            MoEFeedForward(config) if config.is_moe_layer(layer_index) else FeedForward(config)
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, **documents: Optional[Tensor]) -> Tensor:
        """``documents``: document masking's keywords (``document_ids`` or ``mask``, what
        :meth:`LlamaModel.document_inputs` gives), passed on to :meth:`Attention.forward`."""
        h = x + self.attention(self.attention_norm(x), cos, sin, **documents)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(MoEModel, nn.Module):
    """Llama 2 / 3 decoder: token embedding, ``num_layers`` blocks, final RMSNorm, LM head.

    Args:
        config: the model's hyper-parameters.
        init_seed: default seed of :meth:`init_weights`.

    Submodules: ``tok_embeddings`` (``nn.Embedding(padded_vocab_size, h)``), ``layers`` (``nn.ModuleDict`` of
    :class:`TransformerBlock` keyed ``"0"`` .. ``"L-1"``), ``norm`` (:class:`RMSNorm`), ``output``
    (``nn.Linear(h, padded_vocab_size, bias=False)``; with ``tie_word_embeddings`` its weight *is* the embedding's).
    ``tok_embeddings``, ``norm`` or ``output`` may be set to ``None`` and layers deleted (a pruned model).

    Building: on a real device the constructor ends with :meth:`init_weights`; on the meta device nothing is
    initialized, and the caller runs ``model.to_empty(device=...)`` then ``model.init_weights(seed)``.
    """

    def __init__(self, config: LlamaConfig, init_seed: int = 0) -> None:
        super().__init__()
        config.check_trainable("LlamaModel")
        self.config = config
        self.init_seed = init_seed
        # context parallelism: (cp rank, cp size) when the model sees only its zigzag shard of every sequence
        # (lightning_4d.features.context_parallel.runtime); default rotary positions are then those of the shard's
        # tokens
        self.context_parallel: Optional[tuple[int, int]] = None
        # None, or a callable (hidden states, output linear) -> logits replacing ``output(h)``: sequence parallelism
        # sets one that saves only this rank's sequence shard of the head's input
        # (lightning_4d.features.tensor_parallel.runtime)
        self.head_projection: Optional[Callable[[Tensor, nn.Linear], Tensor]] = None
        vocab, h = config.padded_vocab_size, config.hidden_size
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(vocab, h)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.num_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(h, eps=config.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(h, vocab, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # ------------------------------------------------------------------ forward
    def forward(
        self, input_ids: Tensor, positions: Optional[Tensor] = None, document_ids: Optional[Tensor] = None
    ) -> Tensor:
        """Next-token logits.

        Args:
            input_ids: token ids ``LongTensor [b, s]``; for a model without ``tok_embeddings``, hidden states
                ``[b, s_local, h]`` (``s_local`` = ``s / tp`` when they arrive sharded over the sequence by sequence
                parallelism: pass ``positions`` of all ``s`` tokens then, a multiple of ``s_local``).
            positions: token positions ``LongTensor [s]`` or ``[b, s]`` for the rotary embedding; default
                ``arange(s)``, or under context parallelism the positions of this cp rank's zigzag shard
                (:func:`~lightning_4d.models.rope.context_parallel_positions`). With document masking, the
                positions restarting at each document (:func:`~lightning_4d.models.document_mask.document_positions`,
                this rank's shard of them under cp).
            document_ids: ``None`` (causal attention over the whole window), or the document ids ``LongTensor [b,
                s_full]`` of the whole sequence (also under context parallelism; :mod:`lightning_4d.models.
                document_mask`): attention stays within each document.

        Returns:
            logits ``[b, s, padded_vocab_size]`` in the model's dtype (not upcast: the loss does that); hidden states
            ``[b, s, h]`` when ``output`` is ``None`` (before the final norm if ``norm`` is ``None`` too).

        Raises:
            ValueError: ``positions`` whose last dimension is not ``s`` (token input) or not a multiple of
                ``s_local`` (hidden-state input).
        """
        s = input_ids.shape[1]
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        if positions is None:
            cp_rank, cp_size = self.context_parallel or (0, 1)
            positions = context_parallel_positions(s, cp_rank, cp_size, device=input_ids.device)
        elif positions.shape[-1] != s if self.tok_embeddings is not None else positions.shape[-1] % s != 0:
            raise ValueError(
                f"positions has shape {tuple(positions.shape)}: expected [s] or [b, s] with s={s} (the sequence "
                "length of input_ids)."
            )
        cos, sin = rope_cos_sin(self.config, positions)
        documents = self.document_inputs(h, document_ids)
        for block in self.layers.values():
            h = block(h, cos, sin, **documents)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h) if self.head_projection is None else self.head_projection(h, self.output)
        return h

    def document_inputs(self, h: Tensor, document_ids: Optional[Tensor]) -> dict[str, Optional[Tensor]]:
        """The document-masking keyword arguments of every block (:meth:`TransformerBlock.forward`) for hidden
        states ``h`` and the document ids ``[b, s]`` of the whole sequence (``None``: none). Without cp one additive
        mask in the attention's dtype (the autocast dtype, else ``h``'s) for every layer, each layer's kernel keeping
        a reference, not a copy; under cp the ids, which the cp attention masks block by block."""
        if document_ids is None:
            return {}
        if self.context_parallel is not None:
            return {"document_ids": document_ids}
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        return {"mask": window_mask(document_ids, dtype)}

    # ------------------------------------------------------------------ parameters
    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - signature of nn.Module._apply
        """``nn.Module._apply`` (behind ``to``, ``to_empty``, ``cuda``, ``float``, ...), then re-tie the head.

        Moving a plain parameter off the meta device (``to_empty``) replaces it with a new ``Parameter`` in each
        owning module, which would silently untie ``output.weight`` from ``tok_embeddings.weight``. DTensor
        parameters are swapped in place and stay tied; plain ones are re-tied here.
        """
        tied = (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )
        result = super()._apply(fn, recurse)
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return result

    def num_parameters(self) -> int:
        """Number of parameter elements held by this module (global sizes for DTensors; a tied matrix counted once;
        a pruned model counts its own layers only)."""
        return sum(p.numel() for p in self.parameters())

    def _init_std(self, module: nn.Module, canonical: str) -> Optional[float]:
        """Standard deviation of the normal initialization of a parameter, or ``None`` for "ones" (RMSNorm)."""
        if isinstance(module, RMSNorm):
            return None
        std = self.config.initializer_range
        owner = canonical.rsplit(".", 1)[0]
        if owner.endswith(("attention.wo", "feed_forward.w2")) or self.is_residual_output(canonical):
            # residual-branch output projections: std / sqrt(2 L), two residual additions per block
            # (Radford et al. 2019, GPT-2, section 2.3; Shoeybi et al. 2019, Megatron-LM, arXiv 1909.08053)
            std = std / math.sqrt(2 * self.config.num_layers)
        return std

    @torch.no_grad()
    def init_weights(
        self, seed: Optional[int] = None, local_piece: Optional[Callable[[Tensor, Any], Tensor]] = None
    ) -> None:
        """Deterministic, layout-independent initialization of every parameter, in place.

        For each parameter (a tied matrix once), with ``name`` its canonical name (wrapper components removed, see
        :func:`canonical_name`): a ``torch.Generator`` on the parameter's device is seeded with a 63-bit mix of
        ``seed`` and ``crc32(name)`` (:func:`_param_seed`) and the FULL tensor (the global shape for a DTensor) is
        drawn in float32:

        - RMSNorm weights: 1;
        - ``tok_embeddings``, ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` and the untied ``output``:
          ``Normal(0, initializer_range)``;
        - MoE layers (:mod:`lightning_4d.features.moe.layer`): ``router`` and the stacked ``w1`` / ``w3`` as the linear
          weights, the output projections ``w2`` as ``feed_forward.w2`` (:meth:`MoEModel.is_residual_output
          <lightning_4d.features.moe.layer.MoEModel.is_residual_output>`; a stacked tensor drawn whole, so ep keeps the
          same weights);
        - ``attention.wo`` and ``feed_forward.w2``: ``Normal(0, initializer_range / sqrt(2 * num_layers))``, the
          scaled initialization of the residual-branch output projections (GPT-2, Radford et al. 2019, section 2.3;
          Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053).

        A DTensor parameter keeps this rank's shard of the full tensor: ``local_piece(full, p)``, a view of ``full``
        (the strategy passes one built from the DTensor's offset: only ``full`` is allocated beside the parameters),
        else ``distribute_tensor(full, mesh, placements, src_data_rank=None)`` (no communication, every rank draws the
        same full tensor; it allocates the pieces beside ``full``); a plain tensor gets all of it. Either way it is cast
        to the parameter's dtype. The same seed therefore gives the same full weights under any tensor / data / ZeRO
        layout (on one device type; CPU and CUDA generators produce different streams). With ``tie_word_embeddings``, an
        ``output.weight`` that is not the embedding's (a pruned model holding only the head) is drawn under the name
        ``tok_embeddings.weight``, so both copies start equal. Transient memory: one full parameter in float32 (with
        ``local_piece``).

        Args:
            seed: the seed; default ``self.init_seed``.

        Raises:
            RuntimeError: a parameter is still on the meta device (call ``to_empty(device=...)`` first).
        """
        from torch.distributed.tensor import DTensor

        seed = self.init_seed if seed is None else seed
        modules = dict(self.named_modules())
        for name, p in self.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.is_meta:
                raise RuntimeError(
                    f"parameter {name} is on the meta device: call model.to_empty(device=...) before init_weights()."
                )
            canonical = canonical_name(name)
            module_name, _, _ = name.rpartition(".")
            std = self._init_std(modules[module_name], canonical)
            key = canonical
            if self.config.tie_word_embeddings and canonical == "output.weight":
                key = "tok_embeddings.weight"
            full = _full_weight(p.shape, std, _param_seed(seed, key) if std is not None else None, local.device)
            _copy_piece(p, local, full, local_piece)
            del full
