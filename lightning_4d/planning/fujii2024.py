"""The memory estimator of Fujii, Watanabe and Yokota (2024), reproduced faithfully.

Source: K. Fujii, K. Watanabe, R. Yokota, "Accelerating Large Language Model Training with 4D Parallelism and Memory
Consumption Estimator", arXiv 2411.06465 (2024). It models Megatron-LM (bf16, FlashAttention, sequence parallel,
distributed optimizer, fp32 gradient accumulation) training a Llama model, and calls a layout trainable when the
estimate is at most 80% of the GPU's memory (its finding over 454 runs on A100 and H100: no out-of-memory error
below 80%). The authors' reference code is ``megatron/training/theoretical_memory_usage.py`` in the okoge-kaz fork
of Megatron-LM. The formulas are reproduced as the paper states them, quirks included: the ``·h`` of the
input-to-embedding term ``8·(s/c)·b·h·p/t`` and the RMSNorm weights divided by ``t``. ``docs/memory.md`` lists them
with their equation numbers. This is a *reference to compare with*, not our strategy's own memory model.

Parts, as :func:`fujii2024_estimate` adds them up:

- parameters on the most loaded rank (:func:`_parameters_on_rank`; the paper's parameter count of the Llama
  architecture);
- bytes per parameter (:func:`_bytes_per_parameter`; Eq. 4 and §2.2: 18, or ``6 + 12/(d·c)`` with the
  distributed optimizer);
- activations (:func:`_activations`; Eq. 12 per layer, then the pipeline-schedule factors and the input and output
  terms).

Symbols (as on the page): h hidden, L layers, V vocabulary, f FFN size, a heads, k KV heads, t tp, p pp, d dp,
c cp, s sequence, b micro-batch, m micro-batches, v virtual stages.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_4d.config import check_positive_int
from lightning_4d.features.moe.costs import check_dense

__all__ = [
    "Fujii2024Estimate",
    "Fujii2024Layout",
    "Fujii2024Model",
    "check_dense",
    "fujii2024_estimate",
    "fujii2024_from_config",
    "fujii2024_of_layout",
]

GIB = 2**30

#: The paper's rule (arXiv 2411.06465, its finding over 454 runs on A100 and H100): no out-of-memory error was
#: observed below 80% of the GPU's memory.
DEFAULT_BUDGET = 0.8


@dataclass(frozen=True)
class Fujii2024Estimate:
    """Per-rank estimate of the most loaded rank (the first pipeline stage), in bytes.

    Attributes:
        parameters_on_rank: parameter count on the most loaded rank.
        bytes_per_parameter: 18, or ``6 + 12/(d·c)`` with the distributed optimizer (paper Eq. 4 and §2.2).
        model_states: ``parameters_on_rank · bytes_per_parameter`` bytes.
        activations: activation bytes, including the input-to-embedding term and, when ``p == 1``, the final-norm
            output and fp32 logits term (paper Eq. 12 and the pipeline terms: :func:`_activations`).
        total: ``model_states + activations`` bytes.
    """

    parameters_on_rank: float
    bytes_per_parameter: float
    model_states: float
    activations: float
    total: float

    def total_gib(self) -> float:
        """Total in GiB (2**30 bytes), the paper's unit."""
        return self.total / GIB

    def fits(self, device_memory_bytes: float, budget: float = DEFAULT_BUDGET) -> bool:
        """The paper's trainability rule: ``total <= budget · device_memory_bytes`` (80% by default): a layout is
        trainable when the estimate is at most 80% of the GPU's memory (arXiv 2411.06465, over 454 runs).

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


@dataclass(frozen=True)
class Fujii2024Model:
    """The model sizes the paper's formulas read: h ``hidden_size``, L ``num_layers``, V ``vocab_size`` (as is, no
    padding), f ``intermediate_size``, a ``num_heads``, k ``num_kv_heads``, and whether the embedding and the head
    share one weight (see :func:`_parameters_on_rank`). Checked by :func:`fujii2024_estimate`."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class Fujii2024Layout:
    """The layout the paper's formulas read: t ``tp``, p ``pp``, d ``dp``, c ``cp``, v ``virtual_stages`` (model
    chunks per pipeline rank; ``v > 1`` is the interleaved schedule) and ``distributed_optimizer`` (shard the 12
    optimizer bytes over ``d·c``, paper Eq. 4 and §2.2). Checked by :func:`fujii2024_estimate`."""

    tp: int
    pp: int
    dp: int
    cp: int
    virtual_stages: int = 1
    distributed_optimizer: bool = True


def fujii2024_estimate(
    model: Fujii2024Model,
    layout: Fujii2024Layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: Optional[int] = None,
    flash_attention: bool = True,
    attention_dropout: bool = False,
) -> Fujii2024Estimate:
    """Estimate the memory of the most loaded rank (first pipeline stage) by Fujii et al. 2024 (arXiv 2411.06465).

    Args:
        model: h, L, V, f, a, k and tied embeddings (:class:`Fujii2024Model`).
        layout: t, p, d, c, v and the distributed optimizer (:class:`Fujii2024Layout`).
        seq_length, micro_batch_size: s (the global sequence, before context parallelism), b.
        num_microbatches: m per step; ``None`` means "at least p" (no m/p discount).
        flash_attention: if False, add the s² attention terms of Korthikanti et al. 2022.
        attention_dropout: adds ``a·s²·b`` per layer; only without FlashAttention (FlashAttention recomputes its
            dropout mask, and Eq. 12 has no such term).

    Raises:
        ValueError: a non-positive (or non-integer) size, ``num_heads`` not divisible by ``num_kv_heads``,
            ``virtual_stages < 1``. The message names the value and what would be valid.
    """
    h = check_positive_int("hidden_size", model.hidden_size)
    L = check_positive_int("num_layers", model.num_layers)
    V = check_positive_int("vocab_size", model.vocab_size)
    f = check_positive_int("intermediate_size", model.intermediate_size)
    a = check_positive_int("num_heads", model.num_heads)
    k = check_positive_int("num_kv_heads", model.num_kv_heads)
    t = check_positive_int("tp", layout.tp)
    p = check_positive_int("pp", layout.pp)
    d = check_positive_int("dp", layout.dp)
    c = check_positive_int("cp", layout.cp)
    s = check_positive_int("seq_length", seq_length)
    b = check_positive_int("micro_batch_size", micro_batch_size)
    m = None if num_microbatches is None else check_positive_int("num_microbatches", num_microbatches)
    v = layout.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages={v!r} is not valid: expected an integer >= 1")
    if a % k != 0:
        raise ValueError(
            f"num_heads={a} is not divisible by num_kv_heads={k}: expected num_kv_heads to be a divisor of num_heads"
        )

    dims = (h, L, V, f, a, k)
    params = _parameters_on_rank(dims, t, p, model.tie_word_embeddings)
    bytes_per_param = _bytes_per_parameter(d, c, layout.distributed_optimizer)
    model_states = params * bytes_per_param
    activations = _activations(dims, (t, p, c, v), (s, b, m), flash_attention, attention_dropout)
    # Total = model states + activations (the paper's total per GPU, compared with 80% of the GPU's memory)
    total = model_states + activations
    return Fujii2024Estimate(
        parameters_on_rank=float(params),
        bytes_per_parameter=float(bytes_per_param),
        model_states=float(model_states),
        activations=float(activations),
        total=float(total),
    )


def _parameters_on_rank(dims: tuple[int, ...], t: int, p: int, tie: bool) -> float:
    """Parameters on the most loaded rank (the first pipeline stage), the paper's parameter count of Llama
    (``dims`` = (h, L, V, f, a, k)).

    All layers plus the final norm, ``P_layers = 2·L·h²·((1 + k/a) + 1.5·f/h + 1/h) + h`` (attention: Q and O h²
    each, K and V h²·k/a each with GQA; SwiGLU's three h·f matrices; two RMSNorm vectors per layer; the final norm);
    embedding and untied LM head V·h each. On the first stage: ``((P_layers − h)/p + V·h)/t`` (the per-layer norm
    weights divided by t, the authors' quirk); when p = 1 the same rank also holds the head and the final norm: add
    ``V·h/t + h``.

    Our reading: "add V·h/t + h" is taken literally, so the final norm h is added undivided by t (unlike the
    per-layer norms inside P_layers − h). Tied weights: with p = 1 the head *is* the embedding, so the extra V·h/t is
    not added (the final norm h still is). With p > 1 the first stage holds only the embedding either way, so tying
    changes nothing there (the copy on the last stage is not counted: the paper, like Megatron's estimator, takes
    the first stage as the most loaded rank).
    """
    h, L, V, f, a, k = dims
    P_layers = 2 * L * h * h * ((1 + k / a) + 1.5 * f / h + 1 / h) + h
    embedding = V * h
    params = ((P_layers - h) / p + embedding) / t
    if p == 1:
        if not tie:
            params += embedding / t
        params += h
    return params


def _bytes_per_parameter(d: int, c: int, distributed_optimizer: bool) -> float:
    """Bytes per parameter, paper Eq. 4 and §2.2: 2 (bf16 weight) + 4 (fp32 main gradient) + 12 (fp32 master
    weight, Adam m, Adam v) = 18; with the distributed optimizer the 12 are sharded over the d·c data-parallel
    ranks: ``6 + 12/(d·c)``."""
    return 6 + 12 / (d * c) if distributed_optimizer else 18.0


def _activations(
    dims: tuple[int, ...],
    layout: tuple[int, int, int, int],
    batch: tuple[int, int, Optional[int]],
    flash_attention: bool,
    attention_dropout: bool,
) -> float:
    """Activation bytes of the first pipeline stage (``dims`` = (h, L, V, f, a, k), ``layout`` = (t, p, c, v),
    ``batch`` = (s, b, m)).

    - Per layer per micro-batch, paper Eq. 12 (FlashAttention, no dropout): ``s·b·h·(12 + 4·k/a + 8·f/h)``, with s/c
      for s (context parallel) and divided by t (tensor + sequence parallel). Without FlashAttention the s²
      attention terms of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
      arXiv 2205.05198) are added: the scores and softmax output ``4·a·s²·b``, + ``a·s²·b`` for the dropout mask
      (s/c for s here too, before / t).
    - The first stage under 1F1B holds p micro-batches of L/p layers: L × the per-layer figure, whatever p is; plus
      the input-to-embedding term as the authors wrote it, ``8·(s/c)·b·h·p/t`` (the ·h is their quirk).
    - Interleaved with v virtual stages: × ``1 + (p−1)/(p·v)``; fewer micro-batches than stages (m < p,
      non-interleaved): × ``m/p``.
    - p = 1: the rank also holds the final-norm output and fp32 logits, ``4·(s/c)·b·h·(1 + V/h)/t``.
    """
    h, L, V, f, a, k = dims
    t, p, c, v = layout
    s, b, m = batch
    s_r = s / c
    per_layer = s_r * b * h * (12 + 4 * k / a + 8 * f / h)
    if not flash_attention:
        per_layer += 4 * a * s_r * s_r * b
        if attention_dropout:
            per_layer += a * s_r * s_r * b
    per_layer /= t
    activations = L * per_layer + 8 * s_r * b * h * p / t
    if v > 1:
        activations *= 1 + (p - 1) / (p * v)
    elif m is not None and m < p:
        activations *= m / p
    if p == 1:
        activations += 4 * s_r * b * h * (1 + V / h) / t
    return activations


def fujii2024_from_config(
    model_config: Any, *, tp: int, pp: int, dp: int, cp: int, seq_length: int, micro_batch_size: int, **kw: Any
) -> Fujii2024Estimate:
    """:func:`fujii2024_estimate` with the model sizes read from ``model_config`` (duck-typed).

    ``model_config`` needs the attributes ``hidden_size``, ``num_layers``, ``vocab_size``, ``intermediate_size``,
    ``num_heads``, ``num_kv_heads`` and ``tie_word_embeddings`` (as :class:`lightning_4d.models.LlamaConfig` has);
    ``vocab_size`` is taken as is (no padding). ``kw``: ``num_microbatches``, ``flash_attention`` and
    ``attention_dropout`` (of :func:`fujii2024_estimate`), ``virtual_stages`` and ``distributed_optimizer`` (of
    :class:`Fujii2024Layout`); a ``tie_word_embeddings`` given there overrides the config's.

    Raises:
        ValueError: an MoE config (:func:`lightning_4d.features.moe.costs.check_dense`): the paper models dense
        Llama only
            (use our model, ``formula="lightning_4d"``).
    """
    check_dense(model_config)
    tie = kw.pop("tie_word_embeddings", getattr(model_config, "tie_word_embeddings", False))
    model = Fujii2024Model(
        model_config.hidden_size,
        model_config.num_layers,
        model_config.vocab_size,
        model_config.intermediate_size,
        model_config.num_heads,
        model_config.num_kv_heads,
        bool(tie),
    )
    layout = Fujii2024Layout(tp, pp, dp, cp, kw.pop("virtual_stages", 1), kw.pop("distributed_optimizer", True))
    return fujii2024_estimate(model, layout, seq_length=seq_length, micro_batch_size=micro_batch_size, **kw)


def fujii2024_of_layout(
    model_config: Any, parallel_config: Any, seq_length: int, micro_batch_size: int, num_microbatches: int
) -> Fujii2024Estimate:
    """The paper's estimate for a resolved :class:`~lightning_4d.config.ParallelConfig` (duck-typed): the one place
    where a layout becomes the paper's arguments (``estimate``, ``plan`` and ``MemoryEstimatorCallback`` call it).

    - ``distributed_optimizer`` is ZeRO stage >= 1: the paper's distributed optimizer shards the 12 optimizer bytes
      over ``d·c`` (Eq. 4, §2.2), which is what ZeRO 1 does; ZeRO 2 and 3 shard more than the paper models (the
      CLI refuses them with this formula and the planner skips them), and 18 bytes per parameter for them, what
      ``zero_stage == 1`` gave, would count their optimizer states unsharded.
    - ``virtual_stages`` is the layout's v: the interleaved schedule's activation factor ``1 + (p-1)/(p·v)``
      (:func:`_activations`) needs it; without it an interleaved layout got the non-interleaved ``m/p`` discount.

    Raises:
        ValueError: see :func:`fujii2024_from_config`.
    """
    pc = parallel_config
    return fujii2024_from_config(
        model_config,
        tp=pc.tp,
        pp=pc.pp,
        dp=pc.dp,
        cp=pc.cp,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        virtual_stages=pc.v,
        distributed_optimizer=pc.zero_stage >= 1,
    )
