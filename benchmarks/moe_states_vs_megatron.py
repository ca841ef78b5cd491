"""Mixture-of-Experts model states per GPU: our estimate next to Megatron-LM's theoretical memory formula.

Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` (``compute_weight_and_optimizer_memory``; read at
commit 00caa53af30912914981c86f39db123961678bbd of NVIDIA/Megatron-LM) counts, per transformer layer, the attention
``2·h²·(1 + g/a)·(a·d/h)``, 2 RMSNorms of h, and the MLP ``2·h·f·3/2`` (SwiGLU); an MoE layer's MLP is
``2·h·(f_moe·E + f_shared)·3/2`` (all E experts; no router term); embeddings ``h·V`` (twice, untied). The most loaded
shard holds ``(layers/pp + embedding)/tp`` (+ the head's ``h·V/tp`` when pp = 1) at ``18`` bytes per parameter, or
``6 + 12/dp`` with the distributed optimizer: bf16 weight (2), float32 gradient (4), and float32 master, Adam m and
v (12) sharded over dp. There is no expert-parallel term: every rank is counted with all E experts.

Ours: ``parameters + gradients + optimizer_states`` of :func:`~lightning_4d.planning.model.estimate_memory`
(bf16-mixed, ZeRO 1 = the distributed optimizer: bf16 weights, float32 gradients, float32 master + m + v sharded;
experts ``/ep`` with their optimizer states over dp·cp/ep), validated against the real tensors on CPU
(``tests/test_expert_parallel.py``). ``Megatron, ep applied``: the formula with the experts' share divided by ep and
their 12 bytes over dp/ep instead of dp (what Megatron-Core's expert-data-parallel distributed optimizer does at
run time; a correction we apply, not in the file). The last columns: what remains between ours and that, and the
router's weights (``E·h`` per MoE layer), which the file does not count.

Usage::

    python benchmarks/moe_states_vs_megatron.py
"""

from __future__ import annotations

from lightning_4d.config import ParallelConfig
from lightning_4d.models import LlamaConfig
from lightning_4d.planning.model import estimate_memory
from lightning_4d.planning.workload import Workload

GIB = 2**30
#: (preset, dp, ep): tp = pp = cp = 1, ZeRO 1
LAYOUTS = [("mixtral-8x7b", 8, 1), ("mixtral-8x7b", 8, 8), ("mixtral-8x7b", 64, 8), ("mixtral-8x7b", 64, 2)]


def megatron_parameters(cfg: LlamaConfig) -> tuple[float, float]:
    """(all parameters, the routed experts' share of them) as Megatron-LM's ``compute_weight_and_optimizer_memory``
    counts them for our config (pp = tp = 1; RMSNorm: 1 per hidden unit; untied or tied embeddings)."""
    h, a, g, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = 2 * h * h * (1 + g / a) * (a * d / h)
    dense = 2 * h * (cfg.intermediate_size * 3 / 2 + 1) + attention
    fe, e = cfg.expert_intermediate_size, cfg.num_experts
    shared = cfg.num_shared_experts * fe
    moe = 2 * h * (fe * e * 3 / 2 + shared * 3 / 2 + 1) + attention
    n_moe = cfg.num_moe_layers
    block = dense * (cfg.num_layers - n_moe) + moe * n_moe + h
    embedding = h * cfg.padded_vocab_size * (1 if cfg.tie_word_embeddings else 2)
    return block + embedding, n_moe * 2 * h * fe * e * 3 / 2


def main() -> None:
    print(
        "| model | dp | ep | ours (GiB) | Megatron formula as written (GiB) | Megatron, ep applied (GiB) "
        "| ours − ep applied (bytes) | router: E·h·L x (6 + 12/dp) bytes |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset, dp, ep in LAYOUTS:
        cfg = LlamaConfig.from_preset(preset)
        est = estimate_memory(
            Workload(cfg, 1, 4096, "bf16-mixed"),
            ParallelConfig(data_parallel_size=dp, expert_parallel_size=ep, zero_stage=1),
        )
        ours = est.parameters + est.gradients + est.optimizer_states
        total, experts = megatron_parameters(cfg)
        written = total * (6 + 12 / dp)
        applied = (total - experts) * (6 + 12 / dp) + experts / ep * (6 + 12 / (dp // ep))
        router = cfg.num_moe_layers * cfg.num_experts * cfg.hidden_size * (6 + 12 / dp)
        print(
            f"| {preset} | {dp} | {ep} | {ours / GIB:.2f} | {written / GIB:.2f} | {applied / GIB:.2f} "
            f"| {ours - applied:,.0f} | {router:,.0f} |"
        )


if __name__ == "__main__":
    main()
