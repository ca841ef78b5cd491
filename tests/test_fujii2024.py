"""The estimator of Fujii, Watanabe and Yokota 2024 (arXiv 2411.06465; Eq. 4, Eq. 12 and the pipeline terms, as
docs/memory.md lists them).

Every expected value is derived here by hand, term by term, in integer arithmetic (never by calling the module),
and the final numbers are written out as literals too.
"""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_4d.planning import (
    Fujii2024Estimate,
    Fujii2024Layout,
    Fujii2024Model,
    fujii2024_estimate,
    fujii2024_from_config,
)

GIB = 2**30

LLAMA3_8B = dict(
    hidden_size=4096, num_layers=32, vocab_size=128256, intermediate_size=14336, num_heads=32, num_kv_heads=8
)
LLAMA2_7B = dict(
    hidden_size=4096, num_layers=32, vocab_size=32000, intermediate_size=11008, num_heads=32, num_kv_heads=32
)


def _estimate(**kw):
    """:func:`fujii2024_estimate` of keyword arguments named as the paper's symbols' long names: the model's sizes
    and the layout's go into their objects."""
    model = Fujii2024Model(**{f: kw.pop(f) for f in _MODEL_FIELDS if f in kw})
    layout = Fujii2024Layout(**{f: kw.pop(f) for f in _LAYOUT_FIELDS if f in kw})
    return fujii2024_estimate(model, layout, **kw)


_MODEL_FIELDS = [f.name for f in dataclasses.fields(Fujii2024Model)]
_LAYOUT_FIELDS = [f.name for f in dataclasses.fields(Fujii2024Layout)]


def _same(actual, expected):
    return actual == pytest.approx(expected, rel=1e-12, abs=0)


def test_llama2_7b_parameter_count_matches_published():
    # P_layers = 2·L·h²·((1 + k/a) + 1.5·f/h + 1/h) + h, written out in integers:
    h, L, V, f, a, k = 4096, 32, 32000, 11008, 32, 32
    attention = 2 * L * h * h * (a + k) // a  # 2·L·h²·(1 + k/a) = 2,147,483,648
    mlp = 3 * L * h * f  # 2·L·h²·1.5·f/h = 4,328,521,728
    norms = 2 * L * h  # 2·L·h²·(1/h) = 262,144
    final_norm = h  # 4,096
    p_layers = attention + mlp + norms + final_norm
    assert (attention, mlp, norms, final_norm) == (2_147_483_648, 4_328_521_728, 262_144, 4_096)
    assert p_layers == 6_476_271_616
    embedding_and_head = 2 * V * h  # 262,144,000
    assert p_layers + embedding_and_head == 6_738_415_616  # Llama-2-7B's published count
    # The module's p = 1, t = 1 count is P_layers - h + V·h + V·h + h = the same total.
    est = _estimate(**LLAMA2_7B, tp=1, pp=1, dp=1, cp=1, seq_length=4096, micro_batch_size=1)
    assert _same(est.parameters_on_rank, 6_738_415_616)


def test_llama3_8b_tp2_pp1_dp4():
    h, L, V, f, a, k = 4096, 32, 128256, 14336, 32, 8
    t, p, d, c, s, b = 2, 1, 4, 1, 8192, 1
    # Parameters: P_layers = 2·L·h²·(1 + k/a) + 3·L·h·f + 2·L·h + h
    p_layers = 2 * L * h * h * (a + k) // a + 3 * L * h * f + 2 * L * h + h
    assert p_layers == 1_342_177_280 + 5_637_144_576 + 262_144 + 4_096 == 6_979_588_096
    vh = V * h
    assert vh == 525_336_576
    # p = 1: ((P_layers - h)/p + V·h)/t + V·h/t + h   (untied head; final norm h not divided by t)
    assert (p_layers - h + vh) % t == 0 and vh % t == 0
    params = (p_layers - h + vh) // t + vh // t + h
    assert params == 3_752_460_288 + 262_668_288 + 4_096 == 4_015_132_672
    # Distributed optimizer: 6 + 12/(d·c) = 6 + 12/4 = 9 bytes.
    bpp = 6 + 12 // (d * c)
    assert bpp == 9
    model_states = params * bpp
    assert model_states == 36_136_194_048
    # Eq. 12 per layer: (s/c)·b·h·(12 + 4·k/a + 8·f/h)/t = (s/c)·b·(12·h + 4·h·k/a + 8·f)/t
    per_layer = (s // c) * b * (12 * h + 4 * h * k // a + 8 * f) // t
    assert per_layer == 8192 * 167_936 // 2 == 687_865_856
    layers = L * per_layer  # 22,011,707,392
    embedding_input = 8 * (s // c) * b * h * p // t  # 134,217,728
    logits = 4 * (s // c) * b * (h + V) // t  # 4·(s/c)·b·h·(1 + V/h)/t = 2,168,455,168
    activations = layers + embedding_input + logits
    assert (layers, embedding_input, logits) == (22_011_707_392, 134_217_728, 2_168_455_168)
    assert activations == 24_314_380_288
    total = model_states + activations
    assert total == 60_450_574_336  # 56.30 GiB

    est = _estimate(**LLAMA3_8B, tp=t, pp=p, dp=d, cp=c, seq_length=s, micro_batch_size=b)
    assert _same(est.parameters_on_rank, params)
    assert est.bytes_per_parameter == 9
    assert _same(est.model_states, model_states)
    assert _same(est.activations, activations)
    assert _same(est.total, total)
    assert est.total_gib() == pytest.approx(60_450_574_336 / GIB)
    assert est.fits(80 * GIB)  # 56.3 GiB <= 64 GiB
    assert not est.fits(40 * GIB)
    assert est.to_dict() == {
        "parameters_on_rank": est.parameters_on_rank,
        "bytes_per_parameter": 9.0,
        "model_states": est.model_states,
        "activations": est.activations,
        "total": est.total,
        "total_gib": est.total_gib(),
    }


def test_llama3_8b_tp4_pp4_dp2_cp2_enough_microbatches():
    h, L, V, f, a, k = 4096, 32, 128256, 14336, 32, 8
    t, p, d, c, s, b, m = 4, 4, 2, 2, 8192, 1, 8
    p_layers = 2 * L * h * h * (a + k) // a + 3 * L * h * f + 2 * L * h + h  # 6,979,588,096
    vh = V * h
    # p > 1: ((P_layers - h)/p + V·h)/t
    assert (p_layers - h) % p == 0
    first_stage = (p_layers - h) // p + vh
    assert first_stage == 1_744_896_000 + 525_336_576 == 2_270_232_576
    params = first_stage // t
    assert params == 567_558_144
    bpp = 6 + 12 // (d * c)  # 6 + 12/4 = 9
    model_states = params * bpp
    assert model_states == 5_108_023_296
    s_c = s // c  # 4096
    per_layer = s_c * b * (12 * h + 4 * h * k // a + 8 * f) // t
    assert per_layer == 171_966_464
    layers = L * per_layer  # L × per-layer, whatever p is
    embedding_input = 8 * s_c * b * h * p // t
    assert (layers, embedding_input) == (5_502_926_848, 134_217_728)
    activations = layers + embedding_input  # m >= p: no m/p factor; p > 1: no logits term
    assert activations == 5_637_144_576
    total = model_states + activations
    assert total == 10_745_167_872

    est = _estimate(**LLAMA3_8B, tp=t, pp=p, dp=d, cp=c, seq_length=s, micro_batch_size=b, num_microbatches=m)
    assert _same(est.parameters_on_rank, params)
    assert _same(est.model_states, model_states)
    assert _same(est.activations, activations)
    assert _same(est.total, total)
    # num_microbatches=None means m >= p: the same result.
    assert est == _estimate(**LLAMA3_8B, tp=t, pp=p, dp=d, cp=c, seq_length=s, micro_batch_size=b)


def test_llama2_7b_pp4_fewer_microbatches_than_stages_no_distributed_optimizer():
    h, L, V, f, a, k = 4096, 32, 32000, 11008, 32, 32
    t, p, d, c, s, b, m = 2, 4, 2, 1, 4096, 1, 2
    p_layers = 2 * L * h * h * (a + k) // a + 3 * L * h * f + 2 * L * h + h
    assert p_layers == 6_476_271_616
    params = ((p_layers - h) // p + V * h) // t
    assert params == (1_619_066_880 + 131_072_000) // 2 == 875_069_440
    bpp = 2 + 4 + 12  # no distributed optimizer: 18
    model_states = params * bpp
    assert model_states == 15_751_249_920
    per_layer = (s // c) * b * (12 * h + 4 * h * k // a + 8 * f) // t
    assert per_layer == 4096 * 153_600 // 2 == 314_572_800
    layers = L * per_layer
    embedding_input = 8 * (s // c) * b * h * p // t
    assert (layers, embedding_input) == (10_066_329_600, 268_435_456)
    # m < p, non-interleaved: × m/p = × 2/4
    activations = (layers + embedding_input) * m // p
    assert activations == 10_334_765_056 // 2 == 5_167_382_528
    total = model_states + activations
    assert total == 20_918_632_448

    est = _estimate(
        **LLAMA2_7B,
        tp=t,
        pp=p,
        dp=d,
        cp=c,
        seq_length=s,
        micro_batch_size=b,
        num_microbatches=m,
        distributed_optimizer=False,
    )
    assert est.bytes_per_parameter == 18
    assert _same(est.parameters_on_rank, params)
    assert _same(est.model_states, model_states)
    assert _same(est.activations, activations)
    assert _same(est.total, total)


def test_llama2_7b_interleaved_factor():
    h, L, V, f, a, k = 4096, 32, 32000, 11008, 32, 32
    t, p, d, c, s, b, v = 1, 4, 8, 1, 4096, 1, 2
    p_layers = 2 * L * h * h * (a + k) // a + 3 * L * h * f + 2 * L * h + h
    params = ((p_layers - h) // p + V * h) // t
    assert params == 1_750_138_880
    # 6 + 12/(d·c) = 6 + 12/8 = 7.5: in integers, model states = params·(6·d·c + 12)/(d·c)
    model_states = params * (6 * d * c + 12) // (d * c)
    assert model_states == 13_126_041_600
    per_layer = (s // c) * b * (12 * h + 4 * h * k // a + 8 * f) // t
    layers = L * per_layer
    embedding_input = 8 * (s // c) * b * h * p // t
    assert (layers, embedding_input) == (20_132_659_200, 536_870_912)
    # Interleaved: × (1 + (p-1)/(p·v)) = × (p·v + p - 1)/(p·v) = × 11/8
    activations = (layers + embedding_input) * (p * v + p - 1) // (p * v)
    assert activations == 20_669_530_112 * 11 // 8 == 28_420_603_904
    total = model_states + activations
    assert total == 41_546_645_504

    est = _estimate(
        **LLAMA2_7B, tp=t, pp=p, dp=d, cp=c, seq_length=s, micro_batch_size=b, virtual_stages=v, num_microbatches=2
    )  # the m/p discount is for the non-interleaved schedule only
    assert est.bytes_per_parameter == 7.5
    assert _same(est.model_states, model_states)
    assert _same(est.activations, activations)
    assert _same(est.total, total)


def test_bytes_per_parameter_18_vs_distributed_optimizer():
    for d, c, expected in [(1, 1, 18.0), (4, 1, 9.0), (2, 2, 9.0), (8, 2, 6.75), (64, 1, 6.1875)]:
        est = _estimate(**LLAMA2_7B, tp=1, pp=1, dp=d, cp=c, seq_length=1024, micro_batch_size=1)
        assert est.bytes_per_parameter == expected == 6 + 12 / (d * c)
        assert _same(est.model_states, est.parameters_on_rank * expected)
        plain = _estimate(
            **LLAMA2_7B, tp=1, pp=1, dp=d, cp=c, seq_length=1024, micro_batch_size=1, distributed_optimizer=False
        )
        assert plain.bytes_per_parameter == 18.0
        assert plain.parameters_on_rank == est.parameters_on_rank


def test_no_flash_attention_adds_s_squared_terms():
    L, a = 32, 32
    t, c, s, b = 2, 2, 4096, 1
    kwargs = dict(**LLAMA2_7B, tp=t, pp=1, dp=1, cp=c, seq_length=s, micro_batch_size=b)
    flash = _estimate(**kwargs)
    no_flash = _estimate(**kwargs, flash_attention=False)
    no_flash_dropout = _estimate(**kwargs, flash_attention=False, attention_dropout=True)
    s_c = s // c  # 2048
    # Korthikanti et al. 2022: 4·a·s²·b per layer (s -> s/c, / t), + a·s²·b with attention dropout.
    scores = L * 4 * a * s_c * s_c * b // t
    dropout_mask = L * a * s_c * s_c * b // t
    assert (scores, dropout_mask) == (8_589_934_592, 2_147_483_648)
    assert _same(no_flash.activations - flash.activations, scores)
    assert _same(no_flash_dropout.activations - flash.activations, scores + dropout_mask)
    assert no_flash.model_states == flash.model_states
    # With FlashAttention the dropout flag changes nothing (Eq. 12 has no s² term).
    assert _estimate(**kwargs, attention_dropout=True) == flash


def test_tied_embeddings_drop_the_head_only_when_pp_is_1():
    V, h, t = 32000, 4096, 2
    base = dict(**LLAMA2_7B, tp=t, dp=1, cp=1, seq_length=2048, micro_batch_size=1)
    untied = _estimate(**base, pp=1)
    tied = _estimate(**base, pp=1, tie_word_embeddings=True)
    assert _same(untied.parameters_on_rank - tied.parameters_on_rank, V * h // t)  # 65,536,000
    assert untied.activations == tied.activations
    assert _estimate(**base, pp=2) == _estimate(**base, pp=2, tie_word_embeddings=True)


def test_eighty_percent_rule():
    device = 80 * GIB
    limit = 0.8 * device  # 64 GiB = 68,719,476,736 bytes
    assert limit == 68_719_476_736

    def estimate(total):
        return Fujii2024Estimate(
            parameters_on_rank=0.0, bytes_per_parameter=18.0, model_states=0.0, activations=total, total=total
        )

    assert estimate(68_719_476_736 - 1).fits(device)
    assert estimate(68_719_476_736).fits(device)  # "at most 80%"
    assert not estimate(68_719_476_736 + 1).fits(device)
    assert estimate(68_719_476_736 + 1).fits(device, budget=0.9)
    with pytest.raises(ValueError, match="budget"):
        estimate(1.0).fits(device, budget=0)
    with pytest.raises(ValueError, match="device_memory_bytes"):
        estimate(1.0).fits(0)


def test_from_config_duck_typed_and_llama_config():
    cfg = SimpleNamespace(**LLAMA3_8B, tie_word_embeddings=False)
    layout = dict(tp=4, pp=4, dp=2, cp=2, seq_length=8192, micro_batch_size=1)
    direct = _estimate(**LLAMA3_8B, **layout)
    assert fujii2024_from_config(cfg, **layout) == direct
    assert _same(direct.total, 10_745_167_872)
    tied_cfg = SimpleNamespace(**LLAMA2_7B, tie_word_embeddings=True)
    p1 = dict(layout, pp=1)
    assert fujii2024_from_config(tied_cfg, **p1) == _estimate(**LLAMA2_7B, **p1, tie_word_embeddings=True)
    assert fujii2024_from_config(tied_cfg, **p1, tie_word_embeddings=False) == _estimate(**LLAMA2_7B, **p1)

    from lightning_4d.models import LlamaConfig

    llama = LlamaConfig(**LLAMA3_8B)
    assert fujii2024_from_config(llama, **layout) == direct


def test_of_layout_is_the_one_mapping_of_a_layout():
    """Issue 33: the layout -> paper arguments mapping is one function (``estimate``, ``plan`` and the callback used to
    write it three times and differ: the callback passed no v and ``zero_stage >= 1``, the CLI and the planner v and
    ``zero_stage == 1``). v is the layout's (the interleaved factor), and ZeRO >= 1 is the distributed optimizer."""
    from lightning_4d.config import ParallelConfig
    from lightning_4d.memory_check import MemoryEstimatorCallback
    from lightning_4d.planning.fujii2024 import fujii2024_of_layout

    cfg = SimpleNamespace(**LLAMA2_7B, tie_word_embeddings=False)
    pc = ParallelConfig(
        data_parallel_size=2, pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", zero_stage=1
    ).resolve(8)
    got = fujii2024_of_layout(cfg, pc, 4096, 1, 8)
    want = dict(tp=1, pp=4, dp=2, cp=1, seq_length=4096, micro_batch_size=1, num_microbatches=8)
    assert got == _estimate(**LLAMA2_7B, **want, virtual_stages=2)
    assert got != _estimate(**LLAMA2_7B, **want)  # v matters: the callback used to drop it
    for stage, distributed in ((0, False), (1, True), (2, True), (3, True)):
        one = fujii2024_of_layout(cfg, ParallelConfig(data_parallel_size=8, zero_stage=stage).resolve(8), 4096, 1, 1)
        assert one.bytes_per_parameter == (6 + 12 / 8 if distributed else 18.0)
    callback = MemoryEstimatorCallback(device_memory="80GiB", formula="fujii2024")
    est, total, _ = callback._estimate(cfg, pc, 1, 4096, 8, "bf16-mixed", "cuda", None)
    assert est == got and total == got.total


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(hidden_size=0), r"hidden_size=0 is not valid: expected a positive integer"),
        (dict(num_layers=-1), r"num_layers=-1 is not valid"),
        (dict(vocab_size=1.5), r"vocab_size=1.5 is not valid"),
        (dict(tp=0), r"tp=0 is not valid"),
        (dict(cp=True), r"cp=True is not valid"),
        (dict(seq_length=0), r"seq_length=0 is not valid"),
        (dict(micro_batch_size=0), r"micro_batch_size=0 is not valid"),
        (dict(num_microbatches=0), r"num_microbatches=0 is not valid"),
        (dict(num_kv_heads=5), r"num_heads=32 is not divisible by num_kv_heads=5"),
        (dict(virtual_stages=0), r"virtual_stages=0 is not valid: expected an integer >= 1"),
    ],
)
def test_errors(override, match):
    kwargs = dict(**LLAMA3_8B, tp=1, pp=1, dp=1, cp=1, seq_length=1024, micro_batch_size=1)
    kwargs.update(override)
    with pytest.raises(ValueError, match=match):
        _estimate(**kwargs)


def test_module_does_not_import_torch():
    path = Path(__file__).resolve().parents[1] / "lightning_4d" / "planning" / "fujii2024.py"
    assert importlib.util.spec_from_file_location("fujii2024_standalone", path) is not None
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('fujii2024_standalone', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)\n"
        "model = mod.Fujii2024Model(hidden_size=64, num_layers=2, vocab_size=128, intermediate_size=128,\n"
        "    num_heads=4, num_kv_heads=2)\n"
        "layout = mod.Fujii2024Layout(tp=1, pp=1, dp=1, cp=1)\n"
        "mod.fujii2024_estimate(model, layout, seq_length=16, micro_batch_size=1)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    init = path.parent / "__init__.py"
    for source in (init.read_text(), path.read_text()):
        assert "import torch" not in source and "from torch" not in source
