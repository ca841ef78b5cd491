"""Mixture-of-Experts Llama without expert parallelism (issue 23, first part): config validation, the routing and
capacity rules, parity with transformers' ``MixtralForCausalLM`` (logits, load-balancing loss, init_from, export-hf),
dp x ZeRO parity with one process, and the memory model's MoE counts against measured bytes. Tiny models, no
download."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_4d import ParallelConfig
from lightning_4d.features.moe.layer import MoEFeedForward, capacity
from lightning_4d.models import LlamaConfig, LlamaModel
from lightning_4d.planning.model import estimate_memory, model_state_bytes, saved_activation_bytes
from lightning_4d.planning.workload import Workload
from tests._launch import FLOAT32_STEPS, SCRIPTS, check_final_weights, initial_weights, torchrun

#: the dp parity launches are float32 only: FLOAT32_STEPS
STEPS = FLOAT32_STEPS
LOSS_RTOL = 1e-5
# Final weights against the one-process run's, per parameter ‖w − w_ref‖ / ‖w_ref − w0‖ (tests/_launch.py's
# update_errors: 1 for a parameter that never trained), in float32 (`pytest -s` of test_moe.py,
# test_expert_parallel.py -k ep_losses, test_moe_tensor_parallel.py -k under_tp_and_cp): at FLOAT32_STEPS (5) at most
# 6.08e-5 (dp2 ZeRO 1/3 with VARIANT, layers.1.feed_forward.shared_experts.w1: elements whose near-zero gradient
# AdamW's m/sqrt(v) amplifies; 4.06e-5 there at 10 steps on the EpochWindowDataset order, 2.24e-5 on the earlier
# random-window order), 1.6x under the bound; ep 6.58e-6, MoE under tp 8.33e-6.
UPDATE_RTOL = 1e-4


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_experts_per_token", 9, ["num_experts_per_token=9", "1 .. num_experts=8"]),
        ("num_experts_per_token", 0, ["num_experts_per_token=0"]),
        ("capacity_factor", 0.0, ["capacity_factor=0.0", "None (dropless)"]),
        ("capacity_factor", -1.25, ["capacity_factor=-1.25"]),
        ("moe_layer_interval", 0, ["moe_layer_interval=0", "1 .. num_layers=2"]),
        ("moe_layer_interval", 3, ["moe_layer_interval=3", "1 .. num_layers=2"]),
        ("router_score", "relu", ["router_score='relu'", "'softmax', 'sigmoid'"]),
        ("router_aux_loss_coef", -0.1, ["router_aux_loss_coef=-0.1", ">= 0"]),
        ("num_shared_experts", -1, ["num_shared_experts=-1"]),
        ("moe_intermediate_size", 0, ["moe_intermediate_size=0"]),
        ("num_experts", -2, ["num_experts=-2", "0 (a dense Llama)"]),
    ],
)
def test_bad_moe_config_names_value_and_valid_ones(field, value, words):
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_preset("tiny-moe", **{field: value})
    for w in words:
        assert w in str(e.value), str(e.value)


def test_dense_config_unchanged_and_ignores_moe_fields():
    dense = LlamaConfig.from_preset("tiny")
    assert not dense.is_moe and dense.num_moe_layers == 0 and dense.num_experts == 0
    assert dense.num_active_parameters() == dense.num_parameters()
    # MoE fields are not validated for a dense config (top-k 2 > 0 experts is fine)
    assert not LlamaConfig(num_experts_per_token=5).is_moe
    model = LlamaModel(LlamaConfig.from_preset("tiny-test"))
    assert model.moe_aux_loss() is None and model.moe_stats() == {}
    assert not any(isinstance(m, MoEFeedForward) for m in model.modules())


def test_moe_layer_rule_and_parameter_count():
    cfg = LlamaConfig.from_preset("tiny-moe", num_layers=6, moe_layer_interval=2, num_shared_experts=1)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]  # Llama 4's rule
    model = LlamaModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    kinds = [type(model.layers[str(i)].feed_forward).__name__ for i in range(6)]
    assert kinds == ["FeedForward", "MoEFeedForward"] * 3
    # active: the router, k of E experts and the shared expert per MoE layer
    h, fe = cfg.hidden_size, cfg.expert_intermediate_size
    assert cfg.num_parameters() - cfg.num_active_parameters() == 3 * (8 - 2) * 3 * h * fe


def test_presets_published_sizes():
    # Mixtral paper (arXiv 2401.04088): 46.7B parameters, 12.9B active; Mixtral 8x22B: 141B / 39B
    m7 = LlamaConfig.from_preset("mixtral-8x7b")
    assert round(m7.num_parameters() / 1e9, 1) == 46.7 and round(m7.num_active_parameters() / 1e9, 1) == 12.9
    m22 = LlamaConfig.from_preset("mixtral-8x22b")
    assert round(m22.num_parameters() / 1e9) == 141 and round(m22.num_active_parameters() / 1e9) == 39
    # Llama 4: 17B active; Maverick 400B total (text model); Scout's 109B counts the vision encoder too
    scout, maverick = (LlamaConfig.from_preset(n) for n in ("llama4-scout-17b-16e", "llama4-maverick-17b-128e"))
    assert round(scout.num_active_parameters() / 1e9) == 17 and round(maverick.num_active_parameters() / 1e9) == 17
    assert round(maverick.num_parameters() / 1e9) == 401 and maverick.num_moe_layers == 24


def test_llama4_presets_are_estimate_only():
    from lightning_4d.tasks import CausalLMModule

    for name in ("llama4-scout-17b-16e", "llama4-maverick-17b-128e"):
        with pytest.raises(ValueError, match="NoPE layers.*estimate"):
            CausalLMModule(name)
        cfg = LlamaConfig.from_preset(name)
        with pytest.raises(ValueError, match="chunked local attention"):
            LlamaModel(cfg)
        est = estimate_memory(Workload(cfg, 1, 8192), ParallelConfig(data_parallel_size=32, zero_stage=3))
        assert est.total > 0
    with pytest.raises(ValueError, match="QK norm"):
        CausalLMModule("llama4-scout-17b-16e")
    with pytest.raises(ValueError, match="Llama 4.*NoPE"):
        LlamaConfig.from_hf_dict({"model_type": "llama4_text", "hidden_size": 64})


def test_layouts_moe_does_not_support_yet_fail_before_any_process_group():
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule("tiny-moe")
    validate_against_module(ParallelConfig(data_parallel_size=2, zero_stage=3), module)  # dp + ZeRO: fine
    # tp and cp: fine (tests/test_moe_tensor_parallel.py); tp with ZeRO 2/3 too (FSDP2 units over dp_cp_tp)
    validate_against_module(
        ParallelConfig(data_parallel_size=1, tensor_parallel_size=2, context_parallel_size=2), module
    )
    # pipeline parallelism runs MoE models (tests/test_moe_pipeline.py): the layout and the estimator take it
    validate_against_module(ParallelConfig(data_parallel_size=1, pipeline_parallel_size=2), module)
    assert estimate_memory(
        Workload("mixtral-8x7b", 1, 4096), ParallelConfig(data_parallel_size=4, pipeline_parallel_size=2)
    )


# ---------------------------------------------------------------------------------------------------- routing
def _naive(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the top-k experts' SwiGLU, weighted as the config says, plus the shared experts."""
    cfg, e = moe.config, moe.experts
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = moe.router(t)
        if cfg.router_score == "softmax":
            p = torch.softmax(logits, -1)
            w, idx = torch.topk(p, cfg.num_experts_per_token)
            w = w / w.sum()
        else:
            top, idx = torch.topk(logits, cfg.num_experts_per_token)
            w = torch.sigmoid(top)
        y = torch.zeros_like(t)
        for wj, j in zip(w, idx):

            def expert(v):
                return e.w2[j] @ (torch.nn.functional.silu(e.w1[j] @ v) * (e.w3[j] @ v))

            y = y + (wj * expert(t) if cfg.router_score == "softmax" else expert(wj * t))
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(t)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_shared_experts": 1},
        {"router_score": "sigmoid", "num_experts_per_token": 1},
        {"router_score": "sigmoid", "num_shared_experts": 2},
    ],
)
def test_moe_forward_equals_token_by_token_reference(overrides):
    torch.manual_seed(0)
    moe = MoEFeedForward(LlamaConfig.from_preset("tiny-moe", **overrides)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    torch.testing.assert_close(moe(x), _naive(moe, x), rtol=1e-12, atol=1e-12)
    assert int(moe.tokens_per_expert.sum()) == 32 * moe.top_k and int(moe.dropped) == 0


def test_capacity_drops_past_capacity_in_token_order():
    """E=2, top-1, capacity_factor=1: capacity = ceil(1 · 6 · 1 / 2) = 3. The router sends tokens 0-4 to expert 0 and
    token 5 to expert 1: expert 0 keeps tokens 0, 1, 2 and drops 3, 4 (zero output: their residual only)."""
    cfg = LlamaConfig.from_preset("tiny-moe", num_experts=2, num_experts_per_token=1, capacity_factor=1.0)
    assert capacity(cfg, 6) == 3
    moe = MoEFeedForward(cfg)
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 1.0, -1.0  # feature 0 > 0: expert 0, else expert 1
    x = torch.randn(1, 6, 64)
    x[0, :5, 0], x[0, 5, 0] = 1.0, -1.0
    out = moe(x)
    ref = _naive(moe, x)  # dropless
    torch.testing.assert_close(out[0, :3], ref[0, :3])
    torch.testing.assert_close(out[0, 5], ref[0, 5])
    assert torch.equal(out[0, 3:5], torch.zeros(2, 64))
    assert moe.tokens_per_expert.tolist() == [5, 1] and int(moe.dropped) == 2 and int(moe.assignments) == 6
    model = LlamaModel(LlamaConfig.from_preset("tiny-moe", capacity_factor=0.5))
    model(torch.randint(0, 256, (2, 32)))
    stats = model.moe_stats()  # capacity 0.5 · 64 · 2 / 8 = 8 of the mean 16 per expert: at least half dropped
    assert stats["dropped_fraction"] >= 0.5 and stats["tokens_per_expert_mean"] == 16


def test_aux_loss_is_switch_transformer_form():
    """aux = E · sum_e f_e · P_e per layer, mean over layers; uniform routing probabilities give exactly k."""
    cfg = LlamaConfig.from_preset("tiny-moe")
    model = LlamaModel(cfg)
    for layer in model.moe_layers():
        torch.nn.init.zeros_(layer.router.weight)
    model(torch.randint(0, 256, (2, 16)))
    assert math.isclose(float(model.moe_aux_loss().detach()), cfg.num_experts_per_token, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------------- transformers
try:
    import transformers
except ImportError:  # pragma: no cover - the 'hf' extra is a test dependency
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs the 'hf' extra (transformers)")
# fp32, relative to the largest logit (measured: ~1e-7, printed)
REL = 1e-6


def _mixtral(tmp, layers: int = 2, max_shard_size=None, **overrides):
    torch.manual_seed(0)
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    fields.update(overrides)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields)).float().eval()
    with torch.no_grad():  # routers far from uniform, so that the top-k choice is not decided by rounding
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))


@needs_transformers
@pytest.mark.parametrize("layers", [1, 2])
def test_mixtral_logits_and_aux_loss_equal_transformers(tmp_path, ids, layers):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from lightning_4d.tasks import CausalLMModule

    hf = _mixtral(tmp_path, layers)
    module = CausalLMModule(model_config=str(tmp_path), init_from=str(tmp_path))
    cfg = module.model_config
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size) == (8, 2, 96)
    module.configure_model()
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        ours = module(ids)
    err = ((ours - out.logits).abs().max() / out.logits.abs().max()).item()
    print(f"\nMixtral {layers} layer(s): max |ours - transformers| / max |transformers| = {err:.2e}")
    assert err <= REL
    aux = module.model.moe_aux_loss()
    per_layer = torch.stack([load_balancing_loss_func((lg,), 8, 2) for lg in out.router_logits])
    torch.testing.assert_close(aux, per_layer.mean(), rtol=1e-6, atol=0)
    if layers == 1:  # one MoE layer: transformers' pooled loss is the same number
        torch.testing.assert_close(aux, out.aux_loss, rtol=1e-6, atol=0)
    print(f"aux: ours {float(aux):.6f}, transformers per layer {per_layer.tolist()}, pooled {float(out.aux_loss):.6f}")


@needs_transformers
def test_mixtral_config_round_trip_and_what_it_cannot_express():
    cfg = LlamaConfig.from_preset("tiny-moe", router_aux_loss_coef=0.02)
    hf = cfg.to_hf()
    assert hf["model_type"] == "mixtral" and hf["num_local_experts"] == 8 and hf["intermediate_size"] == 64
    back = LlamaConfig.from_hf_dict(json.loads(json.dumps(hf)))
    assert back.num_experts == 8 and back.expert_intermediate_size == 64 and back.router_aux_loss_coef == 0.02
    transformers.MixtralConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    for bad in ({"num_shared_experts": 1}, {"router_score": "sigmoid"}, {"moe_layer_interval": 2}):
        with pytest.raises(ValueError, match="no transformers Mixtral equivalent"):
            LlamaConfig.from_preset("tiny-moe", **bad).to_hf()
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaConfig.from_hf_dict({**hf, "sliding_window": 4096})


@pytest.mark.slow
@needs_transformers
def test_mixtral_export_after_training_and_sharded_init_from(tmp_path, ids):
    """One process: 3 AdamW steps of tiny-moe, checkpoint, export-hf: transformers' MixtralForCausalLM gives our
    logits. dp2 x ZeRO 3: the same export (a sharded checkpoint folder), and init_from a Mixtral directory of 3
    experts: 3 rows do not split evenly over the two ranks, so ZeRO 3 shards every expert on dim 1
    (``lightning_4d.features.moe.costs.expert_shard_dim``) and each rank reads its rows of every expert's tensors."""
    torch.save(ids, tmp_path / "ids.pt")
    layouts = [{"dp": 2, "zero": 3}]
    torchrun(
        1,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "export",
        "--model",
        "tiny-moe",
        "--out",
        str(tmp_path / "one"),
        "--ids",
        str(tmp_path / "ids.pt"),
        "--layouts",
        json.dumps([{}]),
    )
    torchrun(
        2,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "export",
        "--model",
        "tiny-moe",
        "--out",
        str(tmp_path / "dp2"),
        "--ids",
        str(tmp_path / "ids.pt"),
        "--layouts",
        json.dumps(layouts),
    )
    for run in ("one", "dp2"):
        hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / run / "export0").float().eval()
        _assert_logits(hf, sorted((tmp_path / run).glob("export0_rank*.pt")), f"export {run}")
    source = tmp_path / "hf"
    hf = _mixtral(source, 2, intermediate_size=64, num_local_experts=3)
    torchrun(
        2,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "import",
        "--hf",
        str(source),
        "--out",
        str(tmp_path),
        "--ids",
        str(tmp_path / "ids.pt"),
        "--layouts",
        json.dumps(layouts),
    )
    _assert_logits(hf, sorted(tmp_path.glob("import0_rank*.pt")), "init_from dp2 ZeRO 3")


# ---------------------------------------------------------------------------------------------------- dp parity
VARIANT = {"num_shared_experts": 1, "num_layers": 4, "moe_layer_interval": 2, "router_aux_loss_coef": 0.1}
DP2 = [
    {"dp": 2, "zero": 1},
    {"dp": 2, "zero": 3},
    {"dp": 2, "zero": 1, "config": VARIANT},
    {"dp": 2, "zero": 3, "config": VARIANT},
    {"dp": 2, "zero": 0, "ac": "full"},
]


def _records(out, index):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"layout{index}_rank*.json"))]


@pytest.mark.slow
@needs_transformers
def test_mixtral_export_and_init_from_under_expert_parallelism(tmp_path, ids):
    """Expert parallelism: 3 AdamW steps at dp2 ep2 ZeRO 1, export-hf of its sharded checkpoint folder: transformers'
    MixtralForCausalLM gives the logits the ep2 run computed; init_from a sharded Mixtral directory (two safetensors
    files) under dp2 x tp2 x ep2 (each rank reads its experts' rows only): transformers' logits."""
    torch.save(ids, tmp_path / "ids.pt")
    common = ["--ids", str(tmp_path / "ids.pt")]
    export = ["--mode", "export", "--model", "tiny-moe", "--out", str(tmp_path)]
    torchrun(2, SCRIPTS / "hf_checkpoints.py", *export, *common, "--layouts", json.dumps([{"dp": 2, "ep": 2}]))
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "export0").float().eval()
    _assert_logits(hf, sorted(tmp_path.glob("export0_rank*.pt")), "export dp2 ep2")
    source = tmp_path / "hf"
    hf = _mixtral(source, 2, intermediate_size=64, max_shard_size="200KB")
    assert len(list(source.glob("*.safetensors"))) >= 2  # a sharded directory
    layouts = [{"dp": 2, "tp": 2, "ep": 2}]
    torchrun(
        4,
        SCRIPTS / "hf_checkpoints.py",
        "--mode",
        "import",
        "--hf",
        str(source),
        "--out",
        str(tmp_path),
        *common,
        "--layouts",
        json.dumps(layouts),
    )
    _assert_logits(hf, sorted(tmp_path.glob("import0_rank*.pt")), "init_from dp2 tp2 ep2")


def _assert_logits(hf, paths, what: str) -> None:
    """Every (batch, logits) pair a rank saved equals ``hf``'s logits within ``REL`` of the largest."""
    seen = 0
    for path in paths:
        for batch, logits in torch.load(path):
            with torch.no_grad():
                ref = hf(batch).logits
            err = ((ref - logits).abs().max() / ref.abs().max()).item()
            print(f"\n{what} {path.name}: relative error {err:.2e}")
            assert err <= REL
            seen += 1
    assert seen >= 1


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    ref, dp2 = tmp_path_factory.mktemp("moe_ref"), tmp_path_factory.mktemp("moe_dp2")
    torchrun(
        1,
        SCRIPTS / "run_layouts.py",
        "--out",
        str(ref),
        "--model",
        "tiny-moe",
        "--steps",
        str(STEPS),
        "--layouts",
        json.dumps([{"reference": True}, {"reference": True, "config": VARIANT}]),
    )
    torchrun(
        2,
        SCRIPTS / "run_layouts.py",
        "--out",
        str(dp2),
        "--model",
        "tiny-moe",
        "--steps",
        str(STEPS),
        "--layouts",
        json.dumps(DP2),
        timeout=900,
    )
    return ref, dp2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DP2)), ids=[json.dumps(x) for x in DP2])
def test_dp2_zero_losses_aux_and_routing_equal_one_process(dp_runs, index):
    """STEPS AdamW steps in float32: the language-model loss, the load-balancing loss and the busiest expert's
    tokens of every step equal the single-process run's (global-batch counts, features/moe/layer.py); model states on
    every
    rank equal the memory model's; the final weights equal the single-process run's (UPDATE_RTOL)."""
    ref_dir, out = dp_runs
    layout = DP2[index]
    ref_index = 1 if "config" in layout else 0
    ref = _records(ref_dir, ref_index)[0]
    ranks = _records(out, index)
    assert len(ranks) == 2
    for r in ranks:
        assert len(r["losses"]) == STEPS
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        aux = max(abs(a - b) / abs(b) for a, b in zip(r["bytes"]["aux_losses"], ref["bytes"]["aux_losses"]))
        print(f"\n{layout} rank {r['rank']}: loss rel {rel:.1e}, aux rel {aux:.1e}")
        assert rel <= LOSS_RTOL and aux <= LOSS_RTOL
        assert r["bytes"]["tokens_per_expert_max"] == ref["bytes"]["tokens_per_expert_max"]
        cfg = LlamaConfig.from_preset("tiny-moe", **layout.get("config", {}))
        pc = ParallelConfig(
            data_parallel_size=2, zero_stage=layout["zero"], activation_checkpointing=layout.get("ac", "none")
        )
        est = model_state_bytes(cfg, pc, "32-true", dp_cp_rank=r["rank"])
        b = r["bytes"]
        assert (b["params"], b["grads"], b["optimizer_states"]) == (est.parameters, est.gradients, est.optimizer_states)
    check_final_weights(out, index, ref_dir, ref_index, initial_weights("tiny-moe", layout.get("config")), UPDATE_RTOL)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


# ---------------------------------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_memory_model_matches_measured_moe_states_and_activations(tmp_path):
    """One process, tiny-moe variants: parameter, gradient and Adam-state bytes exact; saved activations (dropless:
    the assignment count is exact whatever the routing) within 1% (measured: exact at b=2, +0.07% to +0.4% at b=1,
    as for the dense model)."""
    layouts = [
        {},
        {"config": {"num_shared_experts": 1, "num_layers": 4, "moe_layer_interval": 2}},
        {"config": {"router_score": "sigmoid", "num_shared_experts": 2}},
        {"precision": "bf16-mixed"},
        {"ac": "full"},
    ]
    torchrun(
        1,
        SCRIPTS / "measure_memory.py",
        "--out",
        str(tmp_path),
        "--model",
        "tiny-moe",
        "--layouts",
        json.dumps(layouts),
        "--shapes",
        "[[1, 64], [2, 64], [2, 128]]",
    )
    for i, layout in enumerate(layouts):
        r = _records(tmp_path, i)[0]
        for key in ("parameters", "gradients", "optimizer_states"):
            assert r["states"][key] == r["estimated_states"][key], (layout, key)
        for row in r["activations"]:
            print(f"\n{layout} b={row['b']} s={row['s']}: measured {row['measured']}, estimated {row['estimated']}")
            assert abs(row["estimated"] / row["measured"] - 1) <= 0.01


def test_memory_model_moe_states_formula():
    """ZeRO 3 shards the experts' stacked weights by expert rows (dim 0, torch.chunk) when the group divides them,
    else on dim 1 (8 experts over 16 ranks: ``f_e/16`` rows of every expert's w1/w3, ``h/16`` of its w2 per rank, so
    the ranks differ by the router's rows only, 8 rows over 16 ranks); ZeRO 0 holds everything."""
    cfg = LlamaConfig.from_preset("mixtral-8x7b")
    n = cfg.num_parameters()
    st = model_state_bytes(cfg, ParallelConfig(data_parallel_size=1, zero_stage=0), "32-true")
    assert st.parameters == 4 * n and st.optimizer_states == 8 * n
    st3 = model_state_bytes(cfg, ParallelConfig(data_parallel_size=8, zero_stage=3), "bf16-mixed")
    assert st3.parameters == 4 * n // 8  # every dim 0 (8 experts, 4096 rows, 32000 vocabulary rows) divides by 8
    pc16 = ParallelConfig(data_parallel_size=16, zero_stage=3)
    per_rank = [model_state_bytes(cfg, pc16, "bf16-mixed", dp_cp_rank=r).parameters for r in range(16)]
    router = 4 * cfg.num_experts * cfg.hidden_size * cfg.num_moe_layers  # float32 routers, one row per rank 0-7
    assert sum(per_rank) == 4 * n and per_rank[0] - per_rank[15] == router // cfg.num_experts
    assert per_rank[15] == 4 * (n - cfg.num_experts * cfg.hidden_size * cfg.num_moe_layers) // 16
    act = saved_activation_bytes(
        Workload(LlamaConfig.from_preset("tiny-moe"), 2, 64, "32-true"), ParallelConfig(data_parallel_size=1)
    )
    assert act["layers"] > 0


def test_grouped_gemm_path_equals_the_loop_over_experts():
    """The experts as ``torch._grouped_mm`` GEMMs (the CUDA path; torch's CPU kernel runs it too) equal the loop over
    experts in bfloat16, an expert without rows included: bit-identical on torch 2.13's CPU kernel (measured max
    difference 0; both accumulate in float32)."""
    from lightning_4d.features.moe.layer import GroupedExperts
    from lightning_4d.parallel._compat.kernels import grouped_mm

    if grouped_mm is None:
        pytest.skip("this torch has no torch._grouped_mm")
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32).to(torch.bfloat16)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=0.1)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    loop = experts.run(x, counts, experts.w1, experts.w3, experts.w2)
    experts.grouped_mm = grouped_mm
    grouped = experts._grouped(x, counts, experts.w1, experts.w3, experts.w2)
    assert torch.equal(grouped, loop)
