"""The memory estimator of Fujii, Watanabe and Yokota (2024), reproduced faithfully.

Source: K. Fujii, K. Watanabe, R. Yokota, "Accelerating Large Language Model Training with 4D Parallelism and Memory
Consumption Estimator", arXiv 2411.06465 (2024). It models Megatron-LM (bf16, FlashAttention, sequence parallel,
distributed optimizer, fp32 gradient accumulation) training a Llama model, and calls a layout trainable when the
estimate is at most 80% of the GPU's memory. The formulas below are those of ``/work/shared/memory-model.md`` §1
("the paper's formula, reproduced faithfully"), quirks included: the ``·h`` of the input-to-embedding term
``8·(s/c)·b·h·p/t`` and the RMSNorm weights divided by ``t``. This is a *reference to compare with*, not our
strategy's own memory model.

Symbols (as on the page): h hidden, L layers, V vocabulary, f FFN size, a heads, k KV heads, t tp, p pp, d dp,
c cp, s sequence, b micro-batch, m micro-batches, v virtual stages.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_4d.config import _check_positive_int

__all__ = ["Fujii2024Estimate", "fujii2024_estimate", "fujii2024_from_config"]

GIB = 2**30

#: The paper's rule (arXiv 2411.06465, its finding over 454 runs on A100 and H100, as memory-model.md §1 states it):
#: no OOM was observed below 80% of the GPU's memory.
DEFAULT_BUDGET = 0.8


@dataclass(frozen=True)
class Fujii2024Estimate:
    """Per-rank estimate of the most loaded rank (the first pipeline stage), in bytes.

    Attributes:
        parameters_on_rank: parameter count on the most loaded rank.
        bytes_per_parameter: 18, or ``6 + 12/(d·c)`` with the distributed optimizer (paper Eq. 4 and §2.2).
        model_states: ``parameters_on_rank · bytes_per_parameter`` bytes.
        activations: activation bytes, including the input-to-embedding term and, when ``p == 1``, the final-norm
            output and fp32 logits term (paper Eq. 12 and memory-model.md §1).
        total: ``model_states + activations`` bytes.
    """

    parameters_on_rank: float
    bytes_per_parameter: float
    model_states: float
    activations: float
    total: float

    def total_gib(self) -> float:
        """Total in GiB (2**30 bytes), as memory-model.md §1 ("in GiB = 2^30 bytes")."""
        return self.total / GIB

    def fits(self, device_memory_bytes: float, budget: float = DEFAULT_BUDGET) -> bool:
        """The paper's trainability rule: ``total <= budget · device_memory_bytes`` (80% by default).

        memory-model.md §1: "A layout is called trainable when the total is at most 80% of the GPU's memory".

        Raises:
            ValueError: ``device_memory_bytes <= 0`` or ``budget`` outside ``(0, 1]``.
        """
        if not device_memory_bytes > 0:
            raise ValueError(f"device_memory_bytes={device_memory_bytes!r} is not valid: expected a positive number")
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget!r} is not valid: expected a fraction in (0, 1]")
        return self.total <= budget * device_memory_bytes

    def to_dict(self) -> dict:
        """The fields, plus ``total_gib``."""
        out = asdict(self)
        out["total_gib"] = self.total_gib()
        return out


def fujii2024_estimate(
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: Optional[int] = None,
    virtual_stages: int = 1,
    distributed_optimizer: bool = True,
    flash_attention: bool = True,
    attention_dropout: bool = False,
    tie_word_embeddings: bool = False,
) -> Fujii2024Estimate:
    """Estimate the memory of the most loaded rank (first pipeline stage) by Fujii et al. 2024 (arXiv 2411.06465).

    Args:
        hidden_size, num_layers, vocab_size, intermediate_size, num_heads, num_kv_heads: h, L, V, f, a, k.
        tp, pp, dp, cp: t, p, d, c.
        seq_length, micro_batch_size: s (the global sequence, before context parallelism), b.
        num_microbatches: m per step; ``None`` means "at least p" (no m/p discount).
        virtual_stages: v, model chunks per pipeline rank; ``v > 1`` is the interleaved schedule.
        distributed_optimizer: shard the 12 optimizer bytes over ``d·c`` (paper Eq. 4 and §2.2).
        flash_attention: if False, add the s² attention terms of Korthikanti et al. 2022.
        attention_dropout: adds ``a·s²·b`` per layer; only without FlashAttention (FlashAttention recomputes its
            dropout mask, and Eq. 12 has no such term).
        tie_word_embeddings: share the embedding and the head (see the parameter count below).

    Raises:
        ValueError: a non-positive (or non-integer) size, ``num_heads`` not divisible by ``num_kv_heads``,
            ``virtual_stages < 1``. The message names the value and what would be valid.
    """
    h = _check_positive_int("hidden_size", hidden_size)
    L = _check_positive_int("num_layers", num_layers)
    V = _check_positive_int("vocab_size", vocab_size)
    f = _check_positive_int("intermediate_size", intermediate_size)
    a = _check_positive_int("num_heads", num_heads)
    k = _check_positive_int("num_kv_heads", num_kv_heads)
    t = _check_positive_int("tp", tp)
    p = _check_positive_int("pp", pp)
    d = _check_positive_int("dp", dp)
    c = _check_positive_int("cp", cp)
    s = _check_positive_int("seq_length", seq_length)
    b = _check_positive_int("micro_batch_size", micro_batch_size)
    m = None if num_microbatches is None else _check_positive_int("num_microbatches", num_microbatches)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} is not valid: expected an integer >= 1")
    v = virtual_stages
    if a % k != 0:
        raise ValueError(
            f"num_heads={a} is not divisible by num_kv_heads={k}: expected num_kv_heads to be a divisor of num_heads"
        )

    # --- Parameters ------------------------------------------------------------------------------------------
    # memory-model.md §1, the page's P_layers line (arXiv 2411.06465's parameter count): all layers + final norm,
    #   P_layers = 2·L·h²·((1 + k/a) + 1.5·f/h + 1/h) + h
    # (attention: Q,O h² each, K,V h²·k/a each; SwiGLU's three h·f matrices; two RMSNorm vectors per layer; final
    # norm).
    P_layers = 2 * L * h * h * ((1 + k / a) + 1.5 * f / h + 1 / h) + h
    # memory-model.md §1: "Embedding and untied LM head: V·h each".
    embedding = V * h
    # memory-model.md §1, most loaded rank (first stage):
    #   p > 1: ((P_layers − h)/p + V·h)/t      (the per-layer norm weights are divided by t: the authors' quirk)
    #   p = 1: the same rank also holds the head and the final norm: add V·h/t + h
    # Our reading: "add V·h/t + h" is taken literally, so the final norm h is added undivided by t (unlike the
    # per-layer norms inside P_layers − h). tie_word_embeddings: with p = 1 and tied weights the head *is* the
    # embedding, so the extra V·h/t is not added (the final norm h still is). With p > 1 the first stage holds only
    # the embedding either way, so tying changes nothing there (the copy on the last stage is not counted: the
    # page, like Megatron's estimator, takes the first stage as the most loaded rank).
    params = ((P_layers - h) / p + embedding) / t
    if p == 1:
        if not tie_word_embeddings:
            params += embedding / t
        params += h

    # --- Bytes per parameter: paper Eq. 4 and §2.2 -------------------------------------------------------------
    # 2 (bf16 weight) + 4 (fp32 main gradient) + 12 (fp32 master, Adam m, Adam v) = 18; with the distributed
    # optimizer the 12 are sharded over the d·c data-parallel ranks: 6 + 12/(d·c).
    bytes_per_param = 6 + 12 / (d * c) if distributed_optimizer else 18.0
    model_states = params * bytes_per_param

    # --- Activations ---------------------------------------------------------------------------------------------
    # Paper Eq. 12 (FlashAttention, no dropout), bytes per layer per micro-batch: s·b·h·(12 + 4·k/a + 8·f/h);
    # per rank s -> s/c (context parallel) and / t (tensor + sequence parallel). memory-model.md §1.
    s_r = s / c
    per_layer = s_r * b * h * (12 + 4 * k / a + 8 * f / h)
    if not flash_attention:
        # Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198):
        # the attention scores and softmax output 4·a·s²·b, + a·s²·b for the dropout mask. memory-model.md §1;
        # "per rank use s/c for s", applied here too: 4·a·(s/c)²·b (before / t).
        per_layer += 4 * a * s_r * s_r * b
        if attention_dropout:
            per_layer += a * s_r * s_r * b
    per_layer /= t

    # memory-model.md §1: the first stage under 1F1B holds p micro-batches of L/p layers: L × per-layer, whatever p
    # is; plus the input-to-embedding term as the authors wrote it, 8·(s/c)·b·h·p/t (the ·h is their quirk).
    activations = L * per_layer + 8 * s_r * b * h * p / t
    if v > 1:
        # memory-model.md §1: interleaved with v virtual stages, multiply by 1 + (p−1)/(p·v).
        activations *= 1 + (p - 1) / (p * v)
    elif m is not None and m < p:
        # memory-model.md §1: fewer micro-batches than stages (m < p, non-interleaved): multiply by m/p.
        activations *= m / p
    if p == 1:
        # memory-model.md §1: with p = 1 the rank also holds the final-norm output and fp32 logits:
        # 4·(s/c)·b·h·(1 + V/h)/t.
        activations += 4 * s_r * b * h * (1 + V / h) / t

    # memory-model.md §1: Total = model states + activations.
    total = model_states + activations
    return Fujii2024Estimate(
        parameters_on_rank=float(params),
        bytes_per_parameter=float(bytes_per_param),
        model_states=float(model_states),
        activations=float(activations),
        total=float(total),
    )


def fujii2024_from_config(
    model_config: Any, *, tp: int, pp: int, dp: int, cp: int, seq_length: int, micro_batch_size: int, **kw: Any
) -> Fujii2024Estimate:
    """:func:`fujii2024_estimate` with the model sizes read from ``model_config`` (duck-typed).

    ``model_config`` needs the attributes ``hidden_size``, ``num_layers``, ``vocab_size``, ``intermediate_size``,
    ``num_heads``, ``num_kv_heads`` and ``tie_word_embeddings`` (as :class:`lightning_4d.models.LlamaConfig` has);
    ``vocab_size`` is taken as is (no padding). ``kw`` passes the other keyword arguments of
    :func:`fujii2024_estimate`; a ``tie_word_embeddings`` given there overrides the config's.
    """
    tie = kw.pop("tie_word_embeddings", getattr(model_config, "tie_word_embeddings", False))
    return fujii2024_estimate(
        hidden_size=model_config.hidden_size,
        num_layers=model_config.num_layers,
        vocab_size=model_config.vocab_size,
        intermediate_size=model_config.intermediate_size,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        tie_word_embeddings=bool(tie),
        **kw,
    )
