"""The pre-fit memory check (MemoryEstimatorCallback) and the ``estimate`` / ``plan`` commands."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from lightning_4d import MemoryBudgetExceeded, MemoryEstimatorCallback
from lightning_4d.memory.hardware import GPU_PRESETS, gpu_spec, parse_bytes
from tests._launch import ROOT, SCRIPTS, torchrun, worker_env


def _check(tmp_path, device_memory, **kw):
    args = ["--out", str(tmp_path), "--device-memory", device_memory]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    torchrun(2, SCRIPTS / "memory_check.py", *args, timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_over_budget_raises_on_every_rank_before_configure_model(tmp_path):
    ranks = _check(tmp_path, "2MiB")
    for r in ranks:
        assert r["configure_model_called"] is False
        err = r["error"]
        assert err["type"] == "MemoryBudgetExceeded" and err["is_runtime_error"]
        msg = err["message"]
        assert "exceeds the budget" in msg and "dp=2" in msg and "activations" in msg
        assert "Layouts of the same 2 GPUs that fit" in msg and "tensor_parallel_size=2" in msg
    assert ranks[0]["error"]["message"] == ranks[1]["error"]["message"]  # the same verdict on every rank
    print(ranks[0]["error"]["message"])


def test_under_budget_trains(tmp_path):
    ranks = _check(tmp_path, "64GiB", zero=3)
    for r in ranks:
        assert r["error"] is None and r["configure_model_called"] is True
        assert 0 < r["estimate"]["total"] < 0.8 * 64 * 2**30


def test_callback_arguments():
    assert MemoryEstimatorCallback(device_memory="80GiB").device_memory == 80 * 2**30
    assert MemoryEstimatorCallback(device_memory="94GB").device_memory == 94 * 10**9
    assert MemoryEstimatorCallback(device_memory=1024).device_memory == 1024
    with pytest.raises(ValueError, match="budget=1.5"):
        MemoryEstimatorCallback(budget=1.5)
    with pytest.raises(ValueError, match="device memory '80 apples'"):
        MemoryEstimatorCallback(device_memory="80 apples")
    with pytest.raises(ValueError, match="formula='megatron'"):
        MemoryEstimatorCallback(formula="megatron")
    assert issubclass(MemoryBudgetExceeded, RuntimeError)


def test_hardware_presets():
    assert parse_bytes("512MiB") == 2**29
    assert gpu_spec("h100-80gb") is GPU_PRESETS["H100-80GB"]
    assert gpu_spec("64GiB").memory == 64 * 2**30
    with pytest.raises(ValueError, match="A100-40GB"):
        gpu_spec("B300")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lightning_4d", *args], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=120)


def test_estimate_json():
    proc = _cli("estimate", "--model", "llama3-8b", "--tp", "2", "--num-gpus", "8", "--micro-batch-size", "1",
                "--seq-length", "4096", "--zero-stage", "3", "--activation-checkpointing", "full",
                "--gpu-memory", "80GiB", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead",
                "total", "total_gib", "fraction", "fits"):
        assert key in out
    assert out["fits"] is True and out["layout"]["dp"] == 4
    assert out["total_gib"] == pytest.approx(out["total"] / 2**30)
    assert out["fraction"] == pytest.approx(out["total"] / (80 * 2**30))


def test_estimate_table_and_verdict():
    proc = _cli("estimate", "--model", "configs/llama3_8b.yaml", "--dp", "1", "--micro-batch-size", "4",
                "--seq-length", "8192", "--gpu-memory", "A100-40GB")
    assert proc.returncode == 1  # does not fit
    assert "does NOT fit" in proc.stdout and "optimizer_states" in proc.stdout


def test_estimate_fujii2024_formula():
    proc = _cli("estimate", "--model", "llama3-8b", "--tp", "2", "--dp", "4", "--micro-batch-size", "1",
                "--seq-length", "8192", "--formula", "fujii2024", "--json")
    out = json.loads(proc.stdout)
    assert out["total"] == 60_450_574_336  # the paper's formula, hand-derived in tests/test_fujii2024.py


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3", "--num-gpus", "6"], "num_heads=32 is not divisible by tensor_parallel_size=3"),
        (["--pp", "64", "--num-gpus", "64"], "num_layers=32 cannot be split into pp*v = 64*1 = 64 pipeline stages"),
        (["--tp", "4", "--num-gpus", "6"], "world size 6 is not divisible by pp*cp*tp"),
        (["--model", "llama9-1t", "--num-gpus", "8"], "llama9-1t"),
    ],
)
def test_invalid_layouts_exit_2_with_one_line(args, message):
    base = ["estimate", "--model", "llama3-8b", "--micro-batch-size", "1", "--seq-length", "8192"]
    proc = _cli(*base, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_plan_405b_on_16384_gpus_under_a_second():
    t0 = time.perf_counter()
    proc = _cli("plan", "--model", "llama3.1-405b", "--num-gpus", "16384", "--gpus-per-node", "8",
                "--gpu-memory", "H100-80GB", "--seq-length", "8192", "--global-batch-size", "2048", "--json")
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    layouts = out["layouts"]
    assert 0 < len(layouts) <= 20
    times = [c["step_time"] for c in layouts]
    assert times == sorted(times)
    for c in layouts:
        assert c["tp"] * c["pp"] * c["cp"] * c["dp"] == 16384 and c["fits"]
        assert c["memory"] <= 0.8 * 80 * 2**30
        assert c["dp"] * c["micro_batch_size"] * c["num_microbatches"] == 2048
    print(f"plan 405B on 16,384 GPUs: {elapsed:.2f} s (including the interpreter start), best {layouts[0]}")
    assert elapsed < 1.0


def test_plan_invalid_exit_2():
    proc = _cli("plan", "--model", "llama3-8b", "--num-gpus", "12", "--gpus-per-node", "8", "--seq-length", "8192",
                "--global-batch-size", "64")
    assert proc.returncode == 2 and "num_gpus=12 is not a multiple of gpus_per_node=8" in proc.stderr


def test_peak_flops_of_device_reads_the_gpu_table():
    from lightning_4d.memory.hardware import peak_flops_of_device

    assert peak_flops_of_device("NVIDIA H100 80GB HBM3") == GPU_PRESETS["H100-80GB"].peak_flops == 989e12
    assert peak_flops_of_device("NVIDIA A100-SXM4-40GB") == GPU_PRESETS["A100-40GB"].peak_flops == 312e12
    assert peak_flops_of_device("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops_of_device("NVIDIA H200") == GPU_PRESETS["H200"].peak_flops
    assert peak_flops_of_device("NVIDIA L40S") == 362e12
    assert peak_flops_of_device("NVIDIA A10") == 125e12  # A10, not A100's family
    assert peak_flops_of_device("NVIDIA GeForce RTX 4090") is None
    assert peak_flops_of_device("NVIDIA A10G") is None  # another chip than the A10


def test_estimate_dualpipev_defaults_to_2p_microbatches(capsys):
    """Without --num-microbatches, dualpipev runs m = 2·pp (its minimum), as the strategy does; both formulas."""
    from lightning_4d.memory.cli import main

    base = ["--model", "llama3-8b", "--pp", "4", "--num-gpus", "8", "--micro-batch-size", "1", "--seq-length", "4096",
            "--pipeline-schedule", "dualpipev", "--json"]
    for formula in ("lightning_4d", "fujii2024"):
        assert main("estimate", [*base, "--formula", formula]) in (0, 1)
        out = json.loads(capsys.readouterr().out)
        assert out["layout"]["pipeline_schedule"] == "dualpipev" and out["layout"]["num_microbatches"] == 8
    assert main("estimate", base) in (0, 1)
    assert json.loads(capsys.readouterr().out)["details"]["num_microbatches"] == 8
    assert main("estimate", [*base[:-2], "1f1b", "--json"]) in (0, 1)  # 1F1B: m = pp
    assert json.loads(capsys.readouterr().out)["layout"]["num_microbatches"] == 4


def _strategy_kwargs(line: str) -> dict:
    """The keyword arguments of the ``FourDStrategy(...)`` call on a printed line (the comment after it dropped)."""
    import ast

    call = ast.parse(line.strip(), mode="exec").body[0].value
    assert isinstance(call, ast.Call) and call.func.id == "FourDStrategy" and not call.args
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def test_refusal_suggestions_can_be_pasted_llama3_8b_on_8_gpus(monkeypatch):
    """llama3-8b, 8 GPUs, s=8192, b=1: the fastest layout that fits is FSDP over 8 GPUs (ZeRO 3, as torchtitan's
    published 8B runs; the step-time model of memory/step_time.py, whose tp collectives are exposed, puts tp=2 x dp=4
    after it); the printed line names every dimension, so that it describes 8 GPUs (it used to print dp and tp
    only: 4 GPUs)."""
    import inspect
    from types import SimpleNamespace

    from lightning_4d import FourDStrategy, ParallelConfig
    from lightning_4d.models import LlamaConfig

    callback = MemoryEstimatorCallback(device_memory="80GiB")
    monkeypatch.setattr(callback, "_device", lambda trainer: (80 * 2**30, "NVIDIA H100 80GB HBM3", "cuda"))
    job = ParallelConfig(data_parallel_size=8, zero_stage=1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(parallel_config=job), precision="bf16-mixed",
                              datamodule=SimpleNamespace(micro_batch_size=1, seq_length=8192),
                              accumulate_grad_batches=1, num_devices=8)
    module = SimpleNamespace(model_config=LlamaConfig.from_preset("llama3-8b"))
    with pytest.raises(MemoryBudgetExceeded) as info:
        callback.setup(trainer, module, "fit")
    lines = [line for line in str(info.value).splitlines() if line.strip().startswith("FourDStrategy(")]
    assert len(lines) == len(info.value.suggestions) > 0
    accepted = set(inspect.signature(FourDStrategy.__init__).parameters)
    for line, (suggested, _) in zip(lines, info.value.suggestions):
        assert "# with micro_batch_size=1" in line
        kwargs = _strategy_kwargs(line)
        assert set(kwargs) <= accepted
        pc = ParallelConfig(**kwargs)
        assert pc.world_size == job.world_size == 8
        assert pc == suggested
    first = ParallelConfig(**_strategy_kwargs(lines[0]))
    assert (first.tp, first.cp, first.dp, first.pp, first.zero_stage, first.activation_checkpointing) == \
        (1, 1, 8, 1, 3, "none")


def test_suggestion_line_with_a_pipeline_names_schedule_and_microbatches():
    from lightning_4d import ParallelConfig
    from lightning_4d.memory.callback import suggestion_line

    pc = ParallelConfig(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=1,
                        pipeline_schedule="dualpipev")
    line = suggestion_line(pc, 4)
    kwargs = _strategy_kwargs(line)
    assert kwargs["pipeline_schedule"] == "dualpipev" and kwargs["num_microbatches"] == 4  # 2·pp by default
    assert ParallelConfig(**kwargs).world_size == 8 and line.endswith("# with micro_batch_size=4")
