"""Young's checkpoint interval (planning/reliability.py) and `plan`'s checkpoint fields and plot."""

from __future__ import annotations

import json
import math

import pytest

from lightning_4d.cli import main
from lightning_4d.models.llama_config import LlamaConfig
from lightning_4d.planning.reliability import (
    DEFAULT_MTBF_GPU_HOURS,
    async_blocking_seconds,
    checkpoint_bytes,
    checkpoint_interval,
)

PLAN = ["plan", "--model", "llama3-8b", "--num-gpus", "64", "--seq-length", "4096", "--global-batch-size", "128"]


def test_default_mtbf_is_llama3s_interruptions():
    """419 unexpected interruptions in 54 days on 16,384 GPUs (Llama 3 paper §3.3.4): a 16,384-GPU job fails every
    3.09 hours."""
    assert DEFAULT_MTBF_GPU_HOURS == pytest.approx(50_677, abs=1)
    assert DEFAULT_MTBF_GPU_HOURS / 16384 == pytest.approx(54 * 24 / 419)


def test_young_interval_by_hand():
    cfg = LlamaConfig.from_preset("llama3-8b")
    n = cfg.num_parameters()
    assert checkpoint_bytes(cfg, "bf16-mixed") == 14 * n  # bf16 weights + fp32 master + Adam m, v
    assert checkpoint_bytes(cfg, "32-true") == 12 * n
    got = checkpoint_interval(cfg, 64, 8, 2.0, checkpoint_write_gbps=5.0, mtbf_gpu_hours=10_000.0)
    write = 14 * n / (8 * 5e9)  # 8 nodes writing in parallel
    mtbf = 10_000 * 3600 / 64
    tau = math.sqrt(2 * write * mtbf)
    assert got.write_s == pytest.approx(write) and got.mtbf_s == pytest.approx(mtbf)
    assert got.interval_s == pytest.approx(tau) and got.interval_steps == round(tau / 2.0)
    assert (
        got.lost_fraction == pytest.approx(write / tau + tau / (2 * mtbf)) == pytest.approx(math.sqrt(2 * write / mtbf))
    )
    faster = checkpoint_interval(cfg, 64, 8, 2.0, checkpoint_write_gbps=50.0, mtbf_gpu_hours=10_000.0)
    assert faster.interval_s < got.interval_s and faster.lost_fraction < got.lost_fraction
    for bad in ({"checkpoint_write_gbps": 0}, {"mtbf_gpu_hours": float("nan")}, {"mtbf_gpu_hours": -1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            checkpoint_interval(cfg, 64, 8, 2.0, **bad)


def test_plan_json_has_the_checkpoint_interval_of_every_layout(capsys):
    assert main(PLAN + ["--top", "3", "--json", "--checkpoint-write-gbps", "2", "--mtbf-gpu-hours", "20000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint_write_gbps"] == 2 and out["mtbf_gpu_hours"] == 20000
    for c in out["layouts"]:
        assert c["checkpoint_interval_steps"] == max(1, round(c["checkpoint_interval_s"] / c["step_time"]))
        assert c["checkpoint_interval_s"] == pytest.approx(math.sqrt(2 * c["checkpoint_write_s"] * c["job_mtbf_s"]))
        assert c["checkpoint_blocking_s"] == c["checkpoint_write_s"]  # synchronous saves block for the whole write
        assert c["job_mtbf_s"] == pytest.approx(20000 * 3600 / 64)
    assert main(PLAN + ["--top", "1"]) == 0
    assert "checkpoint every" in capsys.readouterr().out
    for bad in (["--checkpoint-write-gbps", "0"], ["--mtbf-gpu-hours", "nan"]):
        with pytest.raises(SystemExit) as info:
            main(PLAN + bad)
        assert info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_async_checkpoint_charges_only_the_staging_by_hand():
    """``async_checkpoint``: a save blocks for the GPU's states over its host link (C_b), Young's interval uses C_b,
    never below the write's C (a save would wait for the previous one), and a failure also redoes the write still in
    flight (C - C_b)."""
    from types import SimpleNamespace

    cfg = LlamaConfig.from_preset("llama3-8b")
    n = cfg.num_parameters()
    zero1 = SimpleNamespace(tp=2, pp=2, dp=16, cp=1, zero_stage=1)  # ZeRO 1 gathers its chunks for the save
    zero3 = SimpleNamespace(tp=2, pp=2, dp=16, cp=1, zero_stage=3)
    assert async_blocking_seconds(cfg, zero1, 64e9) == pytest.approx(14 * n / 4 / 64e9)
    assert async_blocking_seconds(cfg, zero3, 64e9) == pytest.approx(14 * n / 64 / 64e9)
    sync = checkpoint_interval(cfg, 64, 8, 2.0, checkpoint_write_gbps=5.0, mtbf_gpu_hours=10_000.0)
    blocking = async_blocking_seconds(cfg, zero3, 64e9)
    got = checkpoint_interval(cfg, 64, 8, 2.0, checkpoint_write_gbps=5.0, mtbf_gpu_hours=10_000.0, blocking_s=blocking)
    write, mtbf = 14 * n / (8 * 5e9), 10_000 * 3600 / 64
    tau = math.sqrt(2 * blocking * mtbf)
    assert tau > write and got.blocking_s == blocking and got.write_s == pytest.approx(write)
    assert got.interval_s == pytest.approx(tau) and got.interval_s < sync.interval_s
    assert got.lost_fraction == pytest.approx(blocking / tau + (tau / 2 + write - blocking) / mtbf)
    assert got.lost_fraction < sync.lost_fraction
    # a blocking part so small that Young's interval would be shorter than the write: the write bounds it
    tiny = checkpoint_interval(cfg, 64, 8, 2.0, checkpoint_write_gbps=5.0, mtbf_gpu_hours=10_000.0, blocking_s=1e-9)
    assert tiny.interval_s == pytest.approx(write)
    with pytest.raises(ValueError, match="host_bandwidth=0"):
        async_blocking_seconds(cfg, zero3, 0)


def test_plan_async_checkpoint_uses_the_blocking_part(capsys):
    assert main(PLAN + ["--top", "2", "--json", "--async-checkpoint"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["async_checkpoint"] is True
    for c in out["layouts"]:
        assert 0 < c["checkpoint_blocking_s"] < c["checkpoint_write_s"]
        young = math.sqrt(2 * c["checkpoint_blocking_s"] * c["job_mtbf_s"])
        assert c["checkpoint_interval_s"] == pytest.approx(max(young, c["checkpoint_write_s"]))
    assert main(PLAN + ["--top", "1", "--async-checkpoint"]) == 0
    assert "(async; write" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_plot_draws_every_estimated_layout(capsys, tmp_path):
    pytest.importorskip("matplotlib")  # a dev dependency: installed in CI
    from lightning_4d.planning import plot as plot_module

    drawn = {}
    original = plot_module.plot_plan

    def spy(points, *args, **kwargs):
        drawn["result"] = original(points, *args, **kwargs)
        drawn["points"] = points
        return drawn["result"]

    path = tmp_path / "plan.png"
    import lightning_4d.planning.plot

    lightning_4d.planning.plot.plot_plan = spy
    try:
        assert main(PLAN + ["--plot", str(path)]) == 0
    finally:
        lightning_4d.planning.plot.plot_plan = original
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points, result = drawn["points"], drawn["result"]
    assert len(result["fitting"]) == sum(c.fits for c in points) > 0
    assert len(result["not_fitting"]) == sum(not c.fits for c in points) > 0
    assert f"plot: {path}" in capsys.readouterr().out.replace("\n", "")


def test_plan_plot_without_matplotlib_is_one_line(capsys, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(PLAN + ["--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'lightning-4d[plot]'" in err
