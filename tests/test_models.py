"""The Llama model (``lightning_4d.models``): config and presets, RoPE, attention backends, the transformer, the
layout-independent initialization and a short training run. CPU only, float32 / float64, a few seconds in all."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_4d.models import (
    PRESETS,
    Attention,
    LlamaConfig,
    LlamaModel,
    RopeScaling,
    apply_rotary,
    attention,
    available_backends,
    rope_cos_sin,
    rope_inv_freq,
)
from lightning_4d.models.llama import _param_seed, canonical_name

# Published parameter counts (Meta model cards / Hugging Face safetensors metadata).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
}


def build(config: LlamaConfig, seed: int = 0) -> LlamaModel:
    """The production sequence: build on meta, materialize on CPU, initialize."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.fixture
def tiny() -> LlamaConfig:
    return LlamaConfig.from_preset("tiny-test")


# ---------------------------------------------------------------------------------------------- config and presets
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published(name):
    assert LlamaConfig.from_preset(name).num_parameters() == PUBLISHED[name]


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig.from_preset("tiny-test"),
        LlamaConfig.from_preset("tiny"),
        LlamaConfig.from_preset("small"),
        LlamaConfig.from_preset("tiny-test", tie_word_embeddings=True),
        LlamaConfig.from_preset("tiny-test", vocab_size=250, pad_vocab_to_multiple_of=64),
    ],
    ids=["tiny-test", "tiny", "small", "tied", "padded-vocab"],
)
def test_analytic_count_equals_real_model(config):
    with torch.device("meta"):
        model = LlamaModel(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_scaled_rope_presets_share_the_unscaled_size():
    assert PRESETS["llama3.1-8b"].num_parameters() == PRESETS["llama3-8b"].num_parameters()
    assert PRESETS["llama3.1-8b"].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert PRESETS["llama3.2-1b"].rope_scaling.factor == 32.0


def test_padded_vocab_size_rounds_up():
    config = LlamaConfig(vocab_size=32001, hidden_size=64, num_heads=4, num_kv_heads=2, pad_vocab_to_multiple_of=64)
    assert config.padded_vocab_size == 32064
    assert LlamaConfig(vocab_size=32000, pad_vocab_to_multiple_of=64).padded_vocab_size == 32000


def test_from_preset_returns_an_independent_copy_with_overrides():
    config = LlamaConfig.from_preset("llama3.1-8b", attention_backend="eager")
    config.rope_scaling.factor = 2.0
    assert config.attention_backend == "eager"
    assert PRESETS["llama3.1-8b"].rope_scaling.factor == 8.0
    assert PRESETS["llama3.1-8b"].attention_backend == "sdpa"


def test_rope_scaling_dict_is_converted():
    config = LlamaConfig(rope_scaling={"factor": 32.0})
    assert config.rope_scaling == RopeScaling(factor=32.0)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"'llama5-1t'.*llama2-7b.*llama3-8b.*tiny-test"):
        LlamaConfig.from_preset("llama5-1t")
    assert set(LlamaConfig.preset_names()) == set(PRESETS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden_size": 0}, r"hidden_size=0 is not valid: expected a positive integer"),
        ({"num_layers": -2}, r"num_layers=-2 is not valid"),
        ({"vocab_size": True}, r"vocab_size=True is not valid"),
        ({"hidden_size": 100, "num_heads": 8}, r"hidden_size=100 is not divisible by num_heads=8; valid num_heads"),
        ({"num_heads": 8, "num_kv_heads": 3}, r"num_kv_heads=3 is not valid.*valid num_kv_heads: \[1, 2, 4, 8\]"),
        ({"hidden_size": 24, "num_heads": 8, "num_kv_heads": 4}, r"head_dim=3 .* must be even"),
        ({"attention_backend": "xformers"}, r"attention_backend='xformers' .*\['sdpa', 'flash', 'eager'\]"),
        ({"pad_vocab_to_multiple_of": 0}, r"pad_vocab_to_multiple_of=0 is not valid: expected an integer >= 1"),
        ({"rope_theta": -1.0}, r"rope_theta=-1.0 is not valid"),
        ({"rope_scaling": 3}, r"rope_scaling=3 is not valid"),
    ],
)
def test_config_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match=r"high_freq_factor=1.0 .* greater than low_freq_factor=1.0"):
        RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)


# ---------------------------------------------------------------------------------------------- rotary embeddings
def test_inv_freq_without_scaling_is_theta_power():
    config = LlamaConfig(hidden_size=64, num_heads=4, num_kv_heads=2, rope_theta=10000.0)  # head_dim 16
    expected = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)], dtype=torch.float32)
    got = rope_inv_freq(config)
    assert got.dtype == torch.float32 and got.shape == (8,)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_llama31_inv_freq_scaling_by_hand():
    config = LlamaConfig.from_preset("llama3.1-8b")  # head_dim 128, theta 5e5, factor 8, low 1, high 4, 8192
    got = rope_inv_freq(config).double()
    base = [500000.0 ** (-2 * i / 128) for i in range(64)]
    # i = 0: wavelength 2*pi tokens < 8192 / 4 = 2048: unchanged
    assert 2 * math.pi / base[0] < 2048
    assert got[0].item() == pytest.approx(base[0], rel=1e-6)
    # i = 10: wavelength ~ 49 tokens: unchanged
    assert got[10].item() == pytest.approx(base[10], rel=1e-6)
    # i = 40 and 63: wavelengths > 8192 / 1 tokens: divided by 8
    for i in (40, 63):
        assert 2 * math.pi / base[i] > 8192
        assert got[i].item() == pytest.approx(base[i] / 8, rel=1e-6)
    # i = 30: wavelength 2*pi / 500000**(-60/128) ~ 3042 tokens, inside (2048, 8192): blended
    f = base[30]
    wavelen = 2 * math.pi / f
    assert 2048 < wavelen < 8192
    smooth = (8192 / wavelen - 1) / (4 - 1)
    expected = (1 - smooth) * f / 8 + smooth * f
    assert 0 < smooth < 1
    assert got[30].item() == pytest.approx(expected, rel=1e-5)


def test_llama32_inv_freq_follows_the_piecewise_rule_everywhere():
    config = LlamaConfig.from_preset("llama3.2-1b")  # head_dim 64, factor 32
    got = rope_inv_freq(config).double()
    bands = []
    for i in range(32):
        f = 500000.0 ** (-2 * i / 64)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            expected, band = f, "kept"
        elif wavelen > 8192 / 1:
            expected, band = f / 32, "scaled"
        else:
            smooth = (8192 / wavelen - 1) / 3
            expected, band = (1 - smooth) * f / 32 + smooth * f, "blended"
        bands.append(band)
        assert got[i].item() == pytest.approx(expected, rel=1e-5), i
    assert set(bands) == {"kept", "scaled", "blended"}


def test_rotary_rotates_a_known_vector():
    x = torch.tensor([1.0, 0.0, 0.0, 2.0]).view(1, 1, 1, 4)  # pairs (1, 0) and (0, 2)
    angles = torch.tensor([[math.pi / 3, math.pi / 2]])  # [s=1, d/2=2]
    out = apply_rotary(x, angles.cos(), angles.sin()).view(4)
    expected = torch.tensor([0.5, math.sqrt(3) / 2, -2.0, 0.0])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_rotary_matches_meta_complex_multiplication(tiny):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, tiny.head_dim)
    positions = torch.arange(7)
    cos, sin = rope_cos_sin(tiny, positions)
    # Meta: view_as_complex on reshape(..., -1, 2) times polar(1, positions x inv_freq), flatten(3)
    freqs_cis = torch.polar(torch.ones(7, tiny.head_dim // 2), torch.outer(positions.float(), rope_inv_freq(tiny)))
    reference = torch.view_as_real(torch.view_as_complex(x.reshape(2, 7, 3, -1, 2)) * freqs_cis[None, :, None, :])
    torch.testing.assert_close(apply_rotary(x, cos, sin), reference.flatten(3), rtol=0, atol=1e-6)


def test_rotary_keeps_dtype_and_accepts_batched_positions(tiny):
    x = torch.randn(2, 5, 4, tiny.head_dim, dtype=torch.bfloat16)
    positions = torch.stack([torch.arange(5), torch.arange(10, 15)])
    cos, sin = rope_cos_sin(tiny, positions)
    assert cos.dtype == torch.float32 and cos.shape == (2, 5, tiny.head_dim // 2)
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16
    cos1, sin1 = rope_cos_sin(tiny, torch.arange(10, 15))
    torch.testing.assert_close(out[1], apply_rotary(x[1:], cos1, sin1)[0], rtol=0, atol=0)


def test_rotary_score_depends_only_on_relative_position():
    config = LlamaConfig(hidden_size=128, num_heads=4, num_kv_heads=4, rope_theta=10000.0)  # head_dim 32
    inv_freq = rope_inv_freq(config).double()
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 32, dtype=torch.float64, generator=generator)
    k = torch.randn(1, 1, 1, 32, dtype=torch.float64, generator=generator)

    def rotated(x, position):
        angles = torch.tensor([position], dtype=torch.float64)[:, None] * inv_freq  # [1, 16] float64
        return apply_rotary(x, angles.cos(), angles.sin())

    scores = [(rotated(q, m) * rotated(k, n)).sum().item() for m, n in [(3, 1), (10, 8), (500, 498), (4097, 4095)]]
    assert scores == pytest.approx([scores[0]] * 4, rel=1e-10, abs=1e-10)
    assert (rotated(q, 5) * rotated(k, 1)).sum().item() != pytest.approx(scores[0], rel=1e-3)


# ---------------------------------------------------------------------------------------------- attention
def _qkv(b, s, heads, kv_heads, d, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, heads, d, dtype=dtype, generator=generator)
    k = torch.randn(b, s, kv_heads, d, dtype=dtype, generator=generator)
    v = torch.randn(b, s, kv_heads, d, dtype=dtype, generator=generator)
    return q, k, v


@pytest.mark.parametrize("kv_heads", [8, 4, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_sdpa_equals_eager(kv_heads, dtype, atol):
    q, k, v = _qkv(2, 17, 8, kv_heads, 16, dtype)
    out = attention(q, k, v, "sdpa")
    assert out.shape == (2, 17, 8, 16) and out.dtype == dtype
    torch.testing.assert_close(out, attention(q, k, v, "eager"), rtol=0, atol=atol)


def test_eager_attention_matches_per_head_loop_with_meta_kv_grouping():
    q, k, v = _qkv(1, 6, 6, 2, 4, torch.float64)
    out = attention(q, k, v, "eager")
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    for j in range(6):
        kv = j // 3  # query heads 0-2 use kv head 0, 3-5 use kv head 1
        scores = q[0, :, j] @ k[0, :, kv].T / 2.0
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(out[0, :, j], probs @ v[0, :, kv], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_attention_is_causal(backend):
    q, k, v = _qkv(1, 10, 4, 2, 8, torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:, 6:] += 1.0
    v2[:, 6:] -= 1.0
    a, b = attention(q, k, v, backend), attention(q, k2, v2, backend)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_attention_rejects_unknown_backend_and_bad_grouping():
    q, k, v = _qkv(1, 4, 6, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"backend='xformers' is not valid"):
        attention(q, k, v[..., :2, :], "xformers")
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of the number of kv heads \(4\)"):
        attention(q, k, v, "sdpa")


@pytest.mark.skipif(torch.cuda.is_available() and "flash" in available_backends(), reason="flash-attn is usable")
def test_flash_without_flash_attn_or_cuda_raises_clearly():
    q, k, v = _qkv(1, 4, 4, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"flash.*(not installed|CUDA).*'sdpa'"):
        attention(q, k, v, "flash")
    assert available_backends()[:2] == ["sdpa", "eager"]


@pytest.mark.skipif(
    not (torch.cuda.is_available() and "flash" in available_backends()), reason="needs CUDA and flash-attn"
)
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_flash_equals_eager_on_cuda(kv_heads):
    q, k, v = (t.cuda().to(torch.bfloat16) for t in _qkv(2, 64, 8, kv_heads, 64, torch.float32))
    torch.testing.assert_close(
        attention(q, k, v, "flash").float(), attention(q, k, v, "eager").float(), rtol=2e-2, atol=2e-2
    )


def test_attention_module_runs_on_a_head_shard(tiny):
    """Column-split wq/wk/wv and row-split wo over 2 "ranks": the partial outputs sum to the full output (the
    layout tensor parallelism gives the module)."""
    torch.manual_seed(0)
    full = Attention(tiny).double()
    d, a, k = tiny.head_dim, tiny.num_heads, tiny.num_kv_heads
    x = torch.randn(2, 9, tiny.hidden_size, dtype=torch.float64)
    cos, sin = rope_cos_sin(tiny, torch.arange(9))
    total = torch.zeros_like(x)
    for rank in range(2):
        shard = copy.deepcopy(full)
        qs, ks = slice(rank * a // 2 * d, (rank + 1) * a // 2 * d), slice(rank * k // 2 * d, (rank + 1) * k // 2 * d)
        shard.wq.weight = nn.Parameter(full.wq.weight[qs].clone())
        shard.wk.weight = nn.Parameter(full.wk.weight[ks].clone())
        shard.wv.weight = nn.Parameter(full.wv.weight[ks].clone())
        shard.wo.weight = nn.Parameter(full.wo.weight[:, qs].clone())
        total += shard(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the model
def test_model_sdpa_equals_eager(tiny):
    tokens = torch.randint(0, tiny.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    sdpa = build(tiny)
    eager = build(LlamaConfig.from_preset("tiny-test", attention_backend="eager"))
    logits = sdpa(tokens)
    assert logits.shape == (2, 33, tiny.padded_vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, eager(tokens), rtol=0, atol=1e-5)


def test_model_is_causal(tiny):
    model = build(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 12] = (tokens[0, 12] + 1) % tiny.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().amax(-1).min() > 1e-4


def test_default_positions_are_arange_and_batched_positions_work(tiny):
    model = build(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(tokens), model(tokens, torch.arange(8)), rtol=0, atol=0)
    shifted = torch.stack([torch.arange(8), torch.arange(5, 13)])
    out = model(tokens, shifted)
    torch.testing.assert_close(out[1:], model(tokens[1:], torch.arange(5, 13)), rtol=0, atol=1e-6)
    assert not torch.allclose(out[1], model(tokens)[1])
    with pytest.raises(ValueError, match=r"positions has shape \(7,\).*s=8"):
        model(tokens, torch.arange(7))


def test_tied_head_shares_storage_and_counts_once():
    config = LlamaConfig.from_preset("tiny-test", tie_word_embeddings=True)
    model = build(config)  # to_empty must not untie the head
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied = LlamaConfig.from_preset("tiny-test").num_parameters()
    assert model.num_parameters() == config.num_parameters() == untied - 256 * 64
    model.to(torch.float64)
    assert model.output.weight is model.tok_embeddings.weight


def test_model_has_no_buffers(tiny):
    assert list(build(tiny).buffers()) == []


def test_pipeline_stages_compose_to_the_full_model(tiny):
    """Stage 0 keeps the embedding and layer 0, stage 1 layer 1, the norm and the head (None submodules skipped)."""
    model = build(tiny)
    tokens = torch.randint(0, tiny.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    hidden = first(tokens)
    assert hidden.shape == (2, 11, tiny.hidden_size)
    torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=1e-6)
    assert list(last.layers.keys()) == ["1"]


# ---------------------------------------------------------------------------------------------- initialization
def test_canonical_name_strips_wrappers():
    name = "_orig_mod.layers.3._checkpoint_wrapped_module._fsdp_wrapped_module.attention.wq.weight"
    assert canonical_name(name) == "layers.3.attention.wq.weight"


def test_param_seed_is_a_stable_63_bit_value():
    seed = _param_seed(0, "tok_embeddings.weight")
    assert 0 <= seed < 2**63
    assert seed == _param_seed(0, "tok_embeddings.weight")
    assert len({_param_seed(s, n) for s in range(3) for n in ("a.weight", "b.weight")}) == 6


def test_same_seed_gives_identical_weights(tiny):
    a, b = build(tiny, seed=7), build(tiny, seed=7)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_different_seeds_give_different_weights(tiny):
    a, b = build(tiny, seed=1), build(tiny, seed=2)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    assert not torch.equal(a.tok_embeddings.weight, b.tok_embeddings.weight)


def test_parameters_of_equal_shape_get_different_values(tiny):
    model = build(tiny)
    assert not torch.equal(model.layers["0"].feed_forward.w1.weight, model.layers["0"].feed_forward.w3.weight)
    assert not torch.equal(model.layers["0"].attention.wq.weight, model.layers["1"].attention.wq.weight)


def test_constructor_on_a_real_device_equals_meta_build(tiny):
    direct, meta = LlamaModel(tiny, init_seed=5), build(tiny, seed=5)
    for p, q in zip(direct.parameters(), meta.parameters()):
        assert torch.equal(p, q)


def test_init_ignores_wrappers(tiny):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = build(tiny, seed=3)
    with torch.device("meta"):
        wrapped = LlamaModel(tiny)
    wrapped.layers["1"] = checkpoint_wrapper(wrapped.layers["1"])
    wrapped.to_empty(device="cpu")
    wrapped.init_weights(3)
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_checkpoint_wrapped_module" in n for n in names)
    for (name, p), q in zip(wrapped.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_init_statistics():
    config = LlamaConfig.from_preset("small")  # h 256, f 688, L 6
    model = build(config)
    block = model.layers["2"]
    w1 = block.feed_forward.w1.weight  # 176,128 values
    assert w1.std().item() == pytest.approx(0.02, rel=0.02)
    assert abs(w1.mean().item()) < 3 * 0.02 / math.sqrt(w1.numel())
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * config.num_layers)
    assert block.attention.wo.weight.std().item() == pytest.approx(scaled, rel=0.02)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(scaled, rel=0.02)
    for norm in (block.attention_norm, block.ffn_norm, model.norm):
        assert torch.equal(norm.weight, torch.ones(config.hidden_size))


def test_tied_head_held_apart_gets_the_embedding_values():
    """A pipeline stage holding only the head of a tied model draws it under the embedding's name."""
    config = LlamaConfig.from_preset("tiny-test", tie_word_embeddings=True)
    tied = build(config, seed=4)
    last_stage = build(config, seed=4)
    last_stage.tok_embeddings = None
    last_stage.output.weight = nn.Parameter(torch.zeros_like(last_stage.output.weight))
    last_stage.init_weights(4)
    assert torch.equal(last_stage.output.weight, tied.tok_embeddings.weight)


def test_init_weights_on_meta_raises(tiny):
    with torch.device("meta"):
        model = LlamaModel(tiny)
    with pytest.raises(RuntimeError, match=r"meta device.*to_empty"):
        model.init_weights()


@pytest.fixture
def single_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_init_under_dtensor_layout_matches_plain(tiny, single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    plain = build(tiny, seed=11)
    with torch.device("meta"):
        model = LlamaModel(tiny)
    model.to_empty(device="cpu")
    placements = {
        "tok_embeddings": Shard(0),
        "layers.0.attention.wq": Shard(0),
        "layers.1.attention.wo": Shard(1),
        "layers.0.attention_norm": Replicate(),
    }
    for module_name, placement in placements.items():
        module = model.get_submodule(module_name)
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [placement]))
    model.init_weights(11)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.equal(full, q), name
    assert isinstance(model.tok_embeddings.weight, DTensor)


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_tiny_model_trains():
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny-test")
    model = build(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (4, 33), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(config.vocab_size), rel=0.05)
    assert losses[-1] < 0.5 * losses[0]


def test_task_builds_on_meta_only_for_a_strategy_that_initializes_llama_models():
    """CausalLMModule.configure_model: a ``LayoutStrategy`` whose ``initializes_llama_models`` is true (FourDStrategy)
    gets the model on the meta device; under any other strategy (here one whose tensor_init_context would give the
    meta device, as Lightning's FSDPStrategy / ModelParallelStrategy do for empty_init=True), or a ``LayoutStrategy``
    that does not initialize Llama models, the task initializes the weights itself, equal to LlamaModel(cfg,
    init_seed)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from lightning_4d import FourDStrategy
    from lightning_4d.tasks import CausalLMModule
    from tests._fakes import FakeLayoutStrategy

    @contextmanager
    def meta_when_empty(empty_init=None):
        with torch.device("meta") if empty_init else torch.device("cpu"):
            yield

    assert FourDStrategy.initializes_llama_models
    cfg = LlamaConfig.from_preset("tiny-test")
    reference = LlamaModel(cfg, init_seed=3)
    layout = FakeLayoutStrategy(tensor_init_context=meta_when_empty, initializes_llama_models=True)
    other = SimpleNamespace(tensor_init_context=meta_when_empty)
    not_initializing = FakeLayoutStrategy(tensor_init_context=meta_when_empty, initializes_llama_models=False)
    for strategy, meta in ((layout, True), (other, False), (not_initializing, False)):
        module = CausalLMModule(cfg, init_seed=3)
        module._trainer = SimpleNamespace(strategy=strategy)
        module.configure_model()
        assert all(p.is_meta == meta for p in module.model.parameters())
        if not meta:
            for (name, p), q in zip(module.model.named_parameters(), reference.parameters()):
                assert torch.equal(p, q), name


def test_a_huge_size_fails_in_one_line_instead_of_hanging():
    """A crafted config (a checkpoint's, a ``config.json``) with ``hidden_size=10**13+1`` once made the divisor
    search of the error message loop 10^13 times; sizes are bounded and the search takes ``O(sqrt(n))`` steps."""
    import time

    from lightning_4d.models.llama_config import MAX_MODEL_SIZE, divisors

    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))
    start = time.process_time()
    for name in ("hidden_size", "vocab_size", "num_layers", "max_seq_length"):
        fields = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=64)
        with pytest.raises(ValueError, match=f"{name}=10000000000001 is not valid: expected at most"):
            LlamaConfig(**{**fields, name: 10**13 + 1})
    with pytest.raises(ValueError, match="not divisible by num_heads=2"):
        LlamaConfig(num_layers=2, hidden_size=MAX_MODEL_SIZE - 1, intermediate_size=8, num_heads=2, num_kv_heads=1)
    assert time.process_time() - start < 5  # the divisors of 2^30 - 1: 32,768 steps


def test_generate_equals_greedy_decoding_of_the_unpadded_forward():
    """``CausalLMModule.generate`` pads each forward to GENERATE_LENGTH_STEP tokens (one shape for DTensor's sharding
    cache): its tokens equal greedy decoding with plain ``LlamaModel`` forwards of the exact sequence, also past one
    padding step and past the model's longest sequence (the window slides, the padding stops at max_seq_length)."""
    from lightning_4d.tasks.causal_lm import GENERATE_LENGTH_STEP, CausalLMModule

    config = LlamaConfig.from_preset("tiny-test", max_seq_length=2 * GENERATE_LENGTH_STEP + 8)
    module = CausalLMModule(config)
    module.configure_model()
    prompt = [5, 17, 99, 3]
    new = config.max_seq_length + 5 - len(prompt)  # the last forwards see a full, sliding window
    lengths = []
    hook = module.model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    ids = module.generate(prompt, new)
    hook.remove()
    assert module.training  # restored
    # one shape per GENERATE_LENGTH_STEP new tokens, never longer than the model's longest sequence
    assert sorted(set(lengths)) == [GENERATE_LENGTH_STEP, 2 * GENERATE_LENGTH_STEP, config.max_seq_length]
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = module.model(torch.tensor([expected[-config.max_seq_length :]]))
            expected.append(int(logits[0, -1, : config.vocab_size].argmax()))
    assert ids == expected
    assert len(set(ids[len(prompt) :])) > 1  # not one repeated token: the comparison decides something
