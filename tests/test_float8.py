"""float8 training through torchao (``FourDStrategy(float8=...)``, issue 35 item 3; ``parallel/float8.py``).

torch 2.13's ``torch._scaled_mm`` runs on CPU, so the tests run torchao's real float8 path (no emulation): tiny-test,
20 AdamW steps, ``bf16-mixed``, against plain Lightning's bf16-mixed run of the same model (no FourDStrategy, no
float8). One process trains the two recipes, FourDStrategy without float8 (the check that float8 changed the
numbers) and float8 with checkpointing and offload; one launch of two processes trains dp2 ZeRO 3 with
``"tensorwise"`` (FSDP2 all-gathers the converted weights in float8, the scales precomputed after each step) and
``compile=True``, then pp2, cp2 and tp2 (rowwise with sequence parallelism, tensorwise without).
"""

from __future__ import annotations

import json

import pytest

from lightning_4d.config import ParallelConfig
from lightning_4d.models import LlamaConfig
from tests._launch import SCRIPTS, torchrun

STEPS = 10
#: Measured (torch 2.13 CPU, torchao 0.18, `pytest -s tests/test_float8.py`): the largest loss relative difference
#: from plain Lightning's bf16-mixed run over 20 steps is 4.6e-4 (tensorwise), 5.5e-4 (rowwise), 2.8e-4 (dp2 ZeRO 3
#: tensorwise compiled), 4.5e-4 (pp2 tensorwise), 4.9e-4 (cp2 rowwise), 4.9e-4 (tp2 rowwise sp), 7.2e-4 (tp2
#: tensorwise no sp; docs/validation_cpu.md); FourDStrategy's own bf16-mixed run without float8 differs by 4.2e-4
#: (bf16 rounding in another order). The bound is 2x the largest (7.2e-4). Over the 10 steps run now: 4.8e-4,
#: 3.7e-4, 5.2e-4, 4.8e-4, 3.6e-4, 3.1e-4, 5.3e-4 in the same order, 1.7e-4 without float8.
LOSS_RTOL = 1.5e-3
#: the linears converted in tiny-test: 7 per decoder layer (wq, wk, wv, wo, w1, w3, w2), 2 layers
CONVERTED = 7 * 2
SINGLE = [
    {"reference": True, "precision": "bf16-mixed"},
    {"precision": "bf16-mixed"},
    {"precision": "bf16-mixed", "float8": "tensorwise"},
    {"precision": "bf16-mixed", "float8": "rowwise"},
    # checkpointing and offload change no number: their losses equal the runs above (measured: equal)
    {"precision": "bf16-mixed", "float8": "tensorwise", "ac": "selective"},
    {"precision": "bf16-mixed", "float8": "rowwise", "ac": "full"},
    {"precision": "bf16-mixed", "float8": "tensorwise", "offload": 1},
]
#: two processes: dp2 ZeRO 3 (float8 all-gather) compiled, pp2 (each stage converts its own layer), cp2 (ring), tp2
#: with sp (rowwise: DTensor's styles, the sequence all-gathered in bf16; compiled) and without (tensorwise: torchao's
#: float8 tensor-parallel styles; with sp they all-gather float8, which gloo cannot: test_float8_tp_memory_estimate...)
TWO = [
    {"dp": 2, "zero": 3, "precision": "bf16-mixed", "float8": "tensorwise", "compile": True},
    {"pp": 2, "m": 2, "precision": "bf16-mixed", "float8": "tensorwise"},
    {"cp": 2, "precision": "bf16-mixed", "float8": "rowwise"},
    {"tp": 2, "precision": "bf16-mixed", "float8": "rowwise", "compile": True},
    {"tp": 2, "sp": False, "precision": "bf16-mixed", "float8": "tensorwise"},
]
#: Measured (torch 2.13 CPU, torchao 0.18, 20 steps): tp2 float8 against the one-process float8 run of the same
#: recipe, largest loss relative difference: 1.95e-4 (rowwise, sp; 1.47e-4 compiled), 3.79e-4 (tensorwise, no sp);
#: bf16-mixed without float8, tp2 against one process: 7.3e-5 (sp), 1.3e-4 (no sp): the float8 casts round the
#: slightly different bf16 sums of the split matmuls apart. The bound is 3x the largest. Over 10 steps: 7.9e-5
#: (rowwise, sp, compiled), 1.38e-4 (tensorwise, no sp).
TP_RTOL = 1.2e-3


def _max_rel(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torchao.float8")
    out = tmp_path_factory.mktemp("float8")
    common = ["--model", "tiny-test", "--steps", str(STEPS)]
    torchrun(1, SCRIPTS / "run_layouts.py", "--out", str(out / "one"), *common, "--layouts", json.dumps(SINGLE))
    torchrun(2, SCRIPTS / "run_layouts.py", "--out", str(out / "two"), *common, "--layouts", json.dumps(TWO))
    single = [json.loads((out / "one" / f"layout{i}_rank0.json").read_text()) for i in range(len(SINGLE))]
    two = [[json.loads((out / "two" / f"layout{i}_rank{r}.json").read_text()) for r in range(2)] for i in range(5)]
    return single, two


@pytest.mark.slow
def test_float8_recipes_track_bf16_on_one_process(runs):
    (reference, plain, tensorwise, rowwise, *_), _ = runs
    for run in (plain, tensorwise, rowwise):
        rel = _max_rel(run["losses"], reference["losses"])
        print(f"\n{run['layout']}: loss rel diff {rel:.2e}, float8 linears {run['bytes']['float8_linears']}")
        assert rel < LOSS_RTOL
    assert plain["bytes"]["float8_linears"] == 0
    for run in (tensorwise, rowwise):
        assert run["bytes"]["float8_linears"] == CONVERTED
        assert run["bytes"]["float8_gathered"] == 0  # ZeRO 0: nothing all-gathered
        assert run["losses"] != plain["losses"]  # the float8 matmuls ran


@pytest.mark.slow
def test_float8_with_checkpointing_and_offload(runs):
    (_, _, tensorwise, rowwise, selective, full, offload), _ = runs
    assert selective["losses"] == tensorwise["losses"]  # the selective policy recomputes the float8 matmuls
    assert full["losses"] == rowwise["losses"]
    assert offload["losses"] == tensorwise["losses"]
    assert all(r["bytes"]["float8_linears"] == CONVERTED for r in (selective, full, offload))


@pytest.mark.slow
def test_float8_all_gather_under_zero3_with_compile(runs):
    (reference, *_), (ranks, *_) = runs
    rel = _max_rel(ranks[0]["losses"], reference["losses"])
    print(f"\ndp2 ZeRO 3 tensorwise compiled: loss rel diff {rel:.2e}")
    assert rel < LOSS_RTOL
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for r in ranks:
        assert r["bytes"]["float8_linears"] == CONVERTED
        assert r["bytes"]["float8_gathered"] == CONVERTED  # FSDP2 all-gathers them in float8
        assert r["bytes"]["compiled_graphs"] > 0


@pytest.mark.slow
def test_float8_under_pipeline_and_context_parallelism(runs):
    (reference, *_), (_, pp2, cp2, *_) = runs
    for name, ranks, converted in (("pp2", pp2, CONVERTED // 2), ("cp2", cp2, CONVERTED)):
        rel = _max_rel(ranks[0]["losses"], reference["losses"])
        print(f"\n{name}: loss rel diff {rel:.2e}")
        assert rel < LOSS_RTOL
        assert ranks[0]["losses"] == ranks[1]["losses"]
        assert [r["bytes"]["float8_linears"] for r in ranks] == [converted, converted]  # pp: a layer per stage


@pytest.mark.slow
def test_float8_under_tensor_parallelism(runs):
    """tp2 float8 (the linears of the tp plan run through Float8Linear.forward, every one converted) tracks the
    one-process float8 run of its recipe and plain Lightning's bf16-mixed run."""
    (reference, _, tensorwise, rowwise, *_), (*_, sp_rowwise, tensorwise_no_sp) = runs
    for name, ranks, one in (("tp2 sp rowwise", sp_rowwise, rowwise), ("tp2 tensorwise", tensorwise_no_sp, tensorwise)):
        rel, rel_one = _max_rel(ranks[0]["losses"], reference["losses"]), _max_rel(ranks[0]["losses"], one["losses"])
        print(f"\n{name}: loss rel diff {rel:.2e} from bf16, {rel_one:.2e} from one process")
        assert rel < LOSS_RTOL
        assert rel_one < TP_RTOL
        assert ranks[0]["losses"] == ranks[1]["losses"]
        assert [r["bytes"]["float8_linears"] for r in ranks] == [CONVERTED, CONVERTED]


@pytest.mark.slow
def test_float8_checkpoint_resumes_exactly_under_zero3(tmp_path):
    """dp2 ZeRO 3 tensorwise (weights held as torchao's float8-gathering tensor inside FSDP2's DTensors): 3 steps,
    a sharded checkpoint, 3 resumed steps give the straight run's losses bit for bit (measured: equal)."""
    pytest.importorskip("torchao.float8")
    layout = {"dp": 2, "zero": 3, "precision": "bf16-mixed", "float8": "tensorwise"}
    args = ["--out", str(tmp_path), "--model", "tiny-test", "--steps", "6", "--resume-check"]
    torchrun(2, SCRIPTS / "run_layouts.py", *args, "--layouts", json.dumps([layout]))
    for rank in range(2):
        record = json.loads((tmp_path / f"resume0_rank{rank}.json").read_text())
        assert record["first"] + record["resumed"] == record["straight"]
        assert ".metadata" in record["files"]  # a sharded (DCP) checkpoint


# ------------------------------------------------------------------------------------------------ refusals
def test_float8_refuses_an_unknown_recipe_tp_overlap_and_the_float8_gather_on_gloo():
    from lightning_4d.parallel.float8 import validate_float8

    with pytest.raises(ValueError, match=r"float8='e4m3' is not valid: expected one of \[None, 'tensorwise'"):
        ParallelConfig(float8="e4m3")
    with pytest.raises(ValueError, match="float8='rowwise' is not supported with tensor_parallel_overlap=True"):
        ParallelConfig(tensor_parallel_size=2, tensor_parallel_overlap=True, float8="rowwise")
    tp2 = ParallelConfig(tensor_parallel_size=2, float8="tensorwise")  # sp on by default
    with pytest.raises(ValueError, match="all-gathers the sequence in float8, which the 'gloo' process group"):
        validate_float8("tensorwise", "bf16-mixed", tp2, "gloo")
    validate_float8("tensorwise", "bf16-mixed", tp2, "nccl")
    validate_float8("tensorwise", "bf16-mixed", ParallelConfig(tensor_parallel_size=2, sequence_parallel=False), "gloo")
    validate_float8("rowwise", "bf16-mixed", ParallelConfig(tensor_parallel_size=2, float8="rowwise"), "gloo")


def test_float8_refuses_dimensions_not_divisible_by_16():
    config = ParallelConfig(float8="tensorwise")
    ok = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=100)
    config.validate_model(ok)  # the vocabulary is the head's: not converted
    bad = LlamaConfig(num_layers=2, hidden_size=64, intermediate_size=120, num_heads=4, num_kv_heads=2, vocab_size=128)
    with pytest.raises(ValueError, match=r"divisible by 16.*\{'intermediate_size': 120\}"):
        config.validate_model(bad)


def test_float8_refuses_tensor_parallel_shards_not_divisible_by_16():
    """The small preset's FFN, 688, is divisible by 16, but at tp2 each rank's w1/w3 output and w2 input are 344:
    torch._scaled_mm refuses that on CUDA, so the layout is refused before any process group, naming the valid tp."""
    small = LlamaConfig.from_preset("small")
    ParallelConfig(float8="tensorwise").validate_model(small)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*\{'intermediate_size/tp': 344\}.*\[1\]"):
        ParallelConfig(float8="tensorwise", tensor_parallel_size=2).validate_model(small)
    ParallelConfig(tensor_parallel_size=2).validate_model(small)  # without float8: no such rule
    tiny = LlamaConfig.from_preset("tiny-test")  # FFN 128, heads 4 x 16: 64 and 32 per rank at tp2
    ParallelConfig(float8="rowwise", tensor_parallel_size=2).validate_model(tiny)


def test_float8_refuses_tokens_per_rank_not_divisible_by_16():
    """The weight gradient's inner dimension is the tokens of a micro-batch on this rank (b * s / cp)."""
    ParallelConfig(float8="tensorwise").validate_float8_tokens(8, 2)  # 16 tokens
    ParallelConfig(float8="tensorwise", context_parallel_size=2).validate_float8_tokens(64, 1)  # 32
    ParallelConfig().validate_float8_tokens(8, 1)  # no float8: no rule
    with pytest.raises(ValueError, match=r"= 1 \* 24 / 1 = 24\) divisible by 16.*multiple of 2"):
        ParallelConfig(float8="tensorwise").validate_float8_tokens(24, 1)
    with pytest.raises(ValueError, match=r"= 1 \* 40 / 2 = 20\)"):
        ParallelConfig(float8="rowwise", context_parallel_size=2).validate_float8_tokens(40, 1)


def test_estimate_refuses_float8_tokens_per_rank_as_the_strategy_does(capsys):
    """``estimate`` gives the strategy's one-line refusal (exit 2) for a float8 micro-batch whose tokens per rank
    are not divisible by 16, instead of an estimate of a layout that cannot run."""
    from lightning_4d.cli import main

    argv = ["estimate", "--model", "small", "--dp", "1", "--seq-length", "1000", "--float8", "tensorwise"]
    assert main(argv + ["--micro-batch-size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 * 1000 / 1 = 1000) divisible by 16" in err[0], err
    assert main(argv + ["--micro-batch-size", "2"]) == 0


def test_float8_refuses_cuda_cards_without_float8_tensor_cores(monkeypatch):
    """Below compute capability 8.9 (Ada, Hopper) there is no float8 matmul: refused (the capability patched, so
    this runs without a GPU); the CPU and float8=None are not checked."""
    import torch

    from lightning_4d.parallel.float8 import check_float8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9 .*NVIDIA A100 is 8\.0"):
        check_float8_device("tensorwise", torch.device("cuda", 0))
    check_float8_device(None, torch.device("cuda", 0))
    check_float8_device("tensorwise", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("tensorwise", torch.device("cuda", 0))


def test_float8_refuses_missing_torchao_and_float16(monkeypatch):
    from lightning_4d import FourDStrategy
    from lightning_4d.parallel import float8

    monkeypatch.setattr(float8, "_torchao_version", lambda: None)
    with pytest.raises(ValueError, match=r"float8='tensorwise' needs torchao >= 0.18 \(not installed\)"):
        FourDStrategy(float8="tensorwise")
    monkeypatch.setattr(float8, "_torchao_version", lambda: (0, 18))
    FourDStrategy(float8="tensorwise")
    with pytest.raises(ValueError, match="float8='tensorwise' is not supported with precision='16-true'"):
        float8.validate_float8("tensorwise", "16-true")


# ------------------------------------------------------------------------------------------------ models
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "recipe", "rtol", "phase"),
    [
        # measured 2026-11-27: estimate 113,641,984 B, measured 113,376,116 B (+0.23%; without the float8 term the
        # estimate, 109,722,112 B, was 3.2% under)
        (["--dp", "1"], "tensorwise", 0.01, "float8 backward"),
        # tp2 sp on the fake group: torchao's float8 styles all-gather the sequence in float8 (the path gloo cannot
        # run). Measured 2026-11-27: estimate 56,207,872 B, measured 55,099,848 B (+2.0%; bf16 tp2 sp: -1.5%; before
        # planning/float8_costs.py counted tp, +7.1%). Without sp +0.1%, rowwise with sp -0.5% (not run here).
        # At FFN 704 (688 is refused at tp2): estimate 57,093,632 B, measured 55,935,432 B (+2.1%)
        (["--dp", "1", "--tp", "2"], "tensorwise", 0.03, "float8 backward"),
        # dp2 ZeRO 3: the peak is the last layer's w2 input cast in forward (the previous step's gradient shards
        # alive). Measured 2026-11-27: tensorwise estimate 68,837,888 B, measured 68,844,544 B (-0.01%; before the
        # float8 forward phase -5.2%); rowwise 70,287,872 B against 70,296,404 B (-0.01%; before -7.1%). The same
        # layout without float8 estimates 65,271,808 B against 67,648,340 B (-3.5%: its forward end phase counts no
        # parameters gathered, the last layer's forward holds the root and two layer units)
        (["--dp", "2", "--zero-stage", "3"], "tensorwise", 0.01, "float8 forward"),
        (["--dp", "2", "--zero-stage", "3"], "rowwise", 0.01, "float8 forward"),
        # tp2 sp selective checkpointing: the float8 backward transient in the last layer's backward beside its
        # recomputed set (the kept parts do not count float8's tp change: planning/activations.py). Measured
        # 2026-11-27: estimate 51,764,736 B, measured 52,556,328 B (-1.51%; before the recomputed set was counted
        # -2.85%); not run here: rowwise without sp -0.74% (-2.05%), tensorwise with sp +0.22% (-1.15%), without
        # +0.21% (-1.11%); one process rowwise full -0.01% (-3.05%), tensorwise selective -0.25% (-1.68%). At FFN
        # 704: estimate 52,593,152 B, measured 53,381,736 B (-1.48%)
        (["--dp", "1", "--tp", "2", "--activation-checkpointing", "selective"], "rowwise", 0.03, "float8 backward"),
    ],
    ids=["one-process", "tp2-sp", "zero3-tensorwise", "zero3-rowwise", "tp2-sp-selective-rowwise"],
)
def test_float8_memory_estimate_matches_measure(layout, recipe, rtol, phase, tmp_path):
    """The float8 terms (lightning_4d/planning/float8_costs.py: the backward and forward transients, FSDP2's float8
    all-gather, and under tp the saved inputs) against `lightning-4d measure` (CPU, LiveTensorBytes): small b=2 s=256
    bf16-mixed, ZeRO 1 unless the layout says otherwise; the model states equal (before ``measure.local_bytes``
    unwrapped torchao's float8 weight, ZeRO 3 tensorwise measured 817,664 B of parameters against 8,968,704). Under
    tp2 the FFN is 704 instead of small's 688 (whose 344 per rank float8 refuses: torch._scaled_mm on CUDA)."""
    pytest.importorskip("torchao.float8")

    from tests._launch import python_run

    model = "small"
    if "--tp" in layout:
        model = str(tmp_path / "small_ffn704.yaml")
        (tmp_path / "small_ffn704.yaml").write_text("preset: small\nintermediate_size: 704\n")
    cmd = ["-m", "lightning_4d", "measure", "--model", model, "--seq-length", "256"]
    cmd += ["--micro-batch-size", "2", *layout, "--float8", recipe, "--json"]
    proc = python_run(*cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    measured, estimate = record["measured"]["peak_allocated"], record["estimate"]
    print(f"\nfloat8 {layout} peak: estimate {estimate['total']:,} B, measured {measured:,} B")
    assert estimate["peak_phase"] == phase
    assert abs(estimate["total"] - measured) / measured < rtol
    # the model states exact, torchao's float8 weights under FSDP2 counted through their inner tensors
    rows = {r["component"]: r for r in record["rows"]}
    for key in ("parameters", "gradients", "optimizer_states"):
        assert rows[key]["estimated"] == rows[key]["measured"], key


def test_float8_step_time_reproduces_the_published_gains():
    """FLOAT8_MATMUL_SPEEDUP turns the step-time model's compiled bf16 prediction of torchtitan's Llama 3 8B run (8
    H100, FSDP 8, s=8192, selective checkpointing, torch.compile) into the published float8 gains
    (planning/float8_costs.py,
    FLOAT8_RUNS). The runs' selective checkpointing with compile is a layout FourDStrategy refuses, so the compiled
    step-time Layout is made directly."""
    import dataclasses

    from lightning_4d.planning import step_time as st
    from lightning_4d.planning.float8_costs import FLOAT8_RUNS
    from lightning_4d.planning.hardware import gpu_spec
    from lightning_4d.planning.step_time import predict_step_time

    cfg = LlamaConfig.from_preset("llama3-8b")
    gpu = gpu_spec("H100-96GB")
    layout = dict(data_parallel_size=8, zero_stage=3, activation_checkpointing="selective")
    compiled = dataclasses.replace(st.Layout.of(ParallelConfig(**layout), 1, 1), compile=True)
    bf16 = st.step_time_of(st.model_dims(cfg), compiled, seq_length=8192, gpu=gpu, gpus_per_node=8)
    for recipe, before, after in FLOAT8_RUNS:
        f8 = st.with_float8(bf16, cfg, ParallelConfig(**layout, float8=recipe), 1, 1, 8192, gpu, 8)
        print(f"\n{recipe}: predicted gain {bf16.total / f8.total:.4f}, published {after / before:.4f}")
        assert bf16.total / f8.total == pytest.approx(after / before, abs=0.005)  # the factors' 2 decimals: 0.002
        eager = predict_step_time(cfg, ParallelConfig(**layout, float8=recipe), 1, 1, 8192, gpu, 8)
        assert eager.total < predict_step_time(cfg, ParallelConfig(**layout), 1, 1, 8192, gpu, 8).total
    moe = LlamaConfig.from_preset("tiny-moe")  # its experts stay bf16: not charged
    plain = predict_step_time(moe, ParallelConfig(data_parallel_size=1), 1, 1, 64, gpu, 8).total
    assert (
        predict_step_time(moe, ParallelConfig(data_parallel_size=1, float8="tensorwise"), 1, 1, 64, gpu, 8).total
        == plain
    )


def test_float8_refuses_a_module_without_our_llama():
    """A LightningModule holding no lightning_4d Llama (and no model config): nothing to convert, refused before any
    process group (a Mixture-of-Experts model and a transformers Llama: the support matrix's float8-moe and
    float8-hf-llama rows)."""
    import lightning as L
    import torch

    from lightning_4d.parallel.parallelize import validate_against_module

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(16, 16)

    with pytest.raises(ValueError, match="float8='rowwise' converts the decoder layers .* Plain holds none"):
        validate_against_module(ParallelConfig(data_parallel_size=1, float8="rowwise"), Plain())


def _saved_storage_bytes(cfg, dtype, cuda_branch: bool, monkeypatch) -> int:
    """Bytes of the storages one float8 (tensorwise) decoder layer with weights and input in ``dtype`` saves for
    backward under bf16 autocast on CPU (b=2, s=256), torchao's CUDA autocast branch emulated (``is_autocast_enabled()``
    true, as under CUDA's autocast) or not."""
    import torch
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_4d.models.llama import TransformerBlock

    b, s = 2, 256
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(dtype)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(b, s, cfg.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = torch.ones(s, cfg.head_dim // 2), torch.zeros(s, cfg.head_dim // 2)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with monkeypatch.context() as patch:
        if cuda_branch:
            enabled = torch.is_autocast_enabled
            patch.setattr(float8_linear.torch, "is_autocast_enabled", lambda *a: enabled(*a) if a else True)
            patch.setattr(torch, "get_autocast_gpu_dtype", lambda: torch.bfloat16)
        with torch.autocast("cpu", torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, cos, sin)
    return sum(storages.values())


def test_float8_cuda_autocast_branch_saves_what_the_cpu_branch_saves(monkeypatch):
    """torchao's Float8Linear casts its input to the autocast dtype only under CUDA's autocast, so the float8 memory
    terms measured on CPU ran its other branch. Emulated on CPU (the saved tensors are set by torchao's Python, not by
    the float8 matmul): with ``bf16-mixed``'s bf16 weights and residual stream both branches save the same bytes (the
    cast finds bf16 and returns it), so the terms hold on CUDA; with float32 weights (not a layout of ours) the CUDA
    branch saves one ``[b, s, h]`` bf16 copy more per layer, which shows the emulation takes that branch."""
    pytest.importorskip("torchao.float8")
    import torch

    cfg = LlamaConfig.from_preset("small")
    bf16 = [_saved_storage_bytes(cfg, torch.bfloat16, cuda, monkeypatch) for cuda in (False, True)]
    assert bf16[0] == bf16[1]
    fp32 = [_saved_storage_bytes(cfg, torch.float32, cuda, monkeypatch) for cuda in (False, True)]
    assert fp32[1] - fp32[0] == 2 * 256 * cfg.hidden_size * 2
