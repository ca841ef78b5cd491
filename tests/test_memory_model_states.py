"""The model-state terms of the memory model (``planning/states.py``, ``planning/params.py``) against the real
module's tensors: ZeRO 1's owned ranges from ``torch.chunk`` of the parameters of the meta-device model, the stages of
a pipeline from its parameter names, autocast's weight copies from its ``nn.Linear`` weights, and the byte counts as
whole numbers. Each test was checked to fail on the edits of these modules that mutation testing left alive
(``benchmarks/results/mutation_states_params_survivors_cpu_2026-12-03.md``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_4d import ParallelConfig
from lightning_4d.models import LlamaConfig, LlamaModel
from lightning_4d.planning.model import model_state_bytes, saved_activation_bytes
from lightning_4d.planning.params import Sizes, UntiedView, as_held, stage_params, weighted_params
from lightning_4d.planning.workload import Workload

ONE_BUCKET = 2**40  # every parameter of a group in one ZeRO 1 bucket


def _params(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(LlamaModel(cfg).named_parameters())


def _owned(numel: int, world: int, rank: int) -> int:
    """Elements of range ``rank`` of a bucket of ``numel`` elements cut by ``torch.chunk`` into ``world`` ranges."""
    chunks = torch.empty(numel, device="meta").chunk(world)
    return chunks[rank].numel() if rank < len(chunks) else 0


def _adam_owned(cfg, pc: ParallelConfig, dp_cp_rank: int, tp_rank: int = 0, pp_rank: int = 0) -> int:
    """Elements rank ``dp_cp_rank`` owns at ZeRO 1 per the memory model (32-true: Adam's m and v, 8 B each)."""
    st = model_state_bytes(
        cfg, pc, "32-true", dp_cp_rank=dp_cp_rank, tp_rank=tp_rank, pp_rank=pp_rank, bucket_bytes=ONE_BUCKET
    )
    assert st.optimizer_states % 8 == 0
    return st.optimizer_states // 8


def test_zero1_ranges_equal_torch_chunk_of_the_real_parameters():
    """ZeRO 1 with one bucket per group: rank r owns range r of each group's parameters, ``torch.chunk`` of their
    elements over the group.

    - tiny-moe at dp3, tp1, ep1: no MoE parameter has a group of its own (no tp, no ep: ``gradient_groups`` is empty),
      so every element is in one bucket over 3 ranks; 255,296 elements ≡ 2 (mod 3), ranges of 85,099, the last 85,098
      (the router and the experts in buckets of their own would leave the last rank 85,096);
    - tiny-moe at dp10, ep2: the experts' local half (4 of 8) over their ep data-parallel group of 10/2 = 5 ranks
      (index r // 2), every other parameter over 10;
    - a stage group of one rank (dp1 tp2, dp4 with 4 HSDP replicas) shards nothing at ZeRO 1
      (``setup_zero``: ``shard = zero_stage == 1 and world > 1``), the MoE layers' ``dp·cp·tp`` buckets included: each
      tp rank owns all its elements, Adam's m and v twice its float32 parameters' bytes.
    """
    cfg = LlamaConfig.from_preset("tiny-moe")
    params = _params(cfg)
    total = sum(p.numel() for p in params.values())
    assert total == 255_296 and total % 3 == 2
    pc = ParallelConfig(data_parallel_size=3, zero_stage=1)
    assert (
        [_adam_owned(cfg, pc, r) for r in range(3)]
        == [_owned(total, 3, r) for r in range(3)]
        == [85_099] * 2 + [85_098]
    )
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    local, dense = experts // 2, total - experts
    pc = ParallelConfig(data_parallel_size=10, expert_parallel_size=2, zero_stage=1)
    expected = [_owned(dense, 10, r) + _owned(local, 5, r // 2) for r in range(10)]
    assert [_adam_owned(cfg, pc, r) for r in range(10)] == expected
    for pc in (
        ParallelConfig(data_parallel_size=1, tensor_parallel_size=2, zero_stage=1),
        ParallelConfig(data_parallel_size=4, data_parallel_replicate_size=4, tensor_parallel_size=2, zero_stage=1),
    ):
        for t in (0, 1):
            st = model_state_bytes(cfg, pc, "32-true", tp_rank=t)
            assert st.optimizer_states == 2 * st.parameters, (pc, t)


def test_zero1_pipeline_stage_owns_exactly_its_parameters():
    """ZeRO 1 at pp2 dp2 on tiny-test (untied): the two dp ranks of pp rank 0 own, together, each element of
    ``tok_embeddings`` and ``layers.0`` once, those of pp rank 1 ``layers.1``, ``norm`` and ``output``
    (53,376 and 53,440 elements: the final norm's 64 apart), the real module's parameters by name."""
    cfg = LlamaConfig.from_preset("tiny-test")
    params = _params(cfg)
    stages = (("tok_embeddings.", "layers.0."), ("layers.1.", "norm.", "output."))
    expected = [sum(p.numel() for n, p in params.items() if n.startswith(prefixes)) for prefixes in stages]
    assert expected == [53_376, 53_440]
    pc = ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2, zero_stage=1)
    got = [sum(_adam_owned(cfg, pc, r, pp_rank=pp) for r in range(2)) for pp in range(2)]
    assert got == expected


def test_model_state_bytes_are_whole_numbers():
    """Every field of ``ModelStates`` is an ``int`` (``estimate --json`` prints bytes as integers): under tp2 every
    local matrix of tiny-test (embedding, wq, wk, wv, wo, w1, w3, w2, head) and, at ZeRO 3, the stacked expert weights
    of tiny-moe with 6 experts that FSDP2 shards on dim 1 over dp2·tp2 (6 rows over 4 ranks, 64 columns a multiple of
    4). The values themselves: ``tests/test_memory_model.py``'s by-hand tests."""
    layouts = [
        ("tiny-test", {}, ParallelConfig(data_parallel_size=1, tensor_parallel_size=2, zero_stage=0)),
        ("tiny-moe", {"num_experts": 6}, ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3)),
    ]
    for preset, overrides, pc in layouts:
        cfg = LlamaConfig.from_preset(preset, **overrides)
        for precision in ("32-true", "bf16-mixed"):
            st = model_state_bytes(cfg, pc, precision, tp_rank=1)
            fields = vars(st)
            assert all(type(v) is int for v in fields.values()), (preset, precision, fields)


def test_autocast_copies_count_the_linear_weights_only():
    """``16-mixed`` (autocast): the bfloat16 copies are those of the real module's ``nn.Linear`` weights, 2 bytes per
    element; the RMSNorm weights (attention, feed-forward and final norms) are not cast, nor the embedding."""
    cfg = LlamaConfig.from_preset("tiny-test")
    with torch.device("meta"):
        model = LlamaModel(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    work = Workload(cfg, micro_batch_size=1, seq_length=64, precision="16-mixed")
    got = saved_activation_bytes(work, ParallelConfig(data_parallel_size=1))
    assert got["compute_weights"] == 2 * linear == 2 * (2 * 36_864 + 256 * 64)


def test_as_held_reads_tied_embeddings_under_pp_zero3_as_untied():
    """``as_held``: a tied config at pp2 ZeRO 3 is read as untied (two tensors), every other attribute its own; a
    config without ``tie_word_embeddings`` (duck-typed) is untied and returned itself, as is any config elsewhere."""
    pc = ParallelConfig(data_parallel_size=1, pipeline_parallel_size=2, num_microbatches=2, zero_stage=3)
    tied = LlamaConfig.from_preset("tiny-test", tie_word_embeddings=True)
    view = as_held(tied, pc)
    assert isinstance(view, UntiedView) and view.tie_word_embeddings is False and view.hidden_size == 64
    bare = SimpleNamespace(hidden_size=64)
    assert as_held(bare, pc) is bare
    assert as_held(tied, ParallelConfig(data_parallel_size=1, pipeline_parallel_size=2, zero_stage=1)) is tied


def test_stage_params_default_to_the_whole_model_in_its_order():
    """``stage_params`` and ``weighted_params`` with their defaults (ep = 1) at tp1 list the real module's
    parameters, element counts in ``model.parameters()`` order (ZeRO 1's buckets follow it), the experts whole: the
    setup peak's largest whole parameter (``planning/buffers.py``) is tiny-moe's stacked expert weight, 8·64·64."""
    for preset in ("tiny-test", "tiny-moe"):
        cfg = LlamaConfig.from_preset(preset)
        real = [p.numel() for p in _params(cfg).values()]
        layers = list(range(cfg.num_layers))
        held = [p.numel for p in stage_params(Sizes.of(cfg, cfg.num_layers), 1, layers, True, True)]
        assert held == real, preset
        weighted = weighted_params(cfg, 1, layers, True, True)
        assert sum(p.numel * n for p, n in weighted) == sum(real)
        assert max(p.numel for p, _ in weighted) == max(real) == (8 * 64 * 64 if preset == "tiny-moe" else 256 * 64)
