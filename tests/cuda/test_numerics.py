"""CUDA numerics against the CPU reference (issue 32), each test on CUDA when a GPU is present; the kernel-level
tests also run on the CPU, which checks the tests themselves (the CPU kernels are the reference there).

- a ring step's attention blocks and their log-sum-exp merge, forward and every gradient, against float32 autograd
  of full causal attention (the CUDA flash backward read a strided log-sum-exp as dense: every head but the first
  got another row's values);
- the routed experts' grouped GEMM (``torch._grouped_mm``) against the loop over experts;
- 20 steps of the main job's model, data and optimizer on one GPU against the CPU (``tests/scripts/tiny_losses.py``):
  ``32-true`` within 1e-4, ``bf16-mixed`` within 1e-2 (relative, per step).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._launch import ROOT, worker_env

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device", DEVICES)
def test_ring_step_blocks_and_every_gradient_equal_full_attention(device):
    """The second half of the queries against all keys as a ring step computes it: a full block over the first half
    of the keys and a causal block over the second, merged by log-sum-exp; then each block's backward with the
    merged ``out`` and a strided slice of the merged ``lse``. Output and dq, dk, dv equal float32 autograd of full
    causal attention (GQA: 8 query heads, 2 kv heads) within bfloat16's rounding: relative norms measured on CPU out
    4.2e-3, dq 4.5e-3, dk 5.2e-3, dv 5.0e-3 (torch 2.13); bounds 1e-2 (out) and 2e-2 (gradients)."""
    from lightning_4d.features.context_parallel.runtime import _Kernel, _merge

    g = torch.Generator(device=device).manual_seed(0)
    b, hq, hkv, s, d = 1, 8, 2, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s // 2, d, device=device, generator=g)
    # reference: float32 autograd, queries of the second half attending causally over all keys
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    rep = hq // hkv
    scores = qr[:, :, s // 2 :] @ kr.repeat_interleave(rep, 1).transpose(-2, -1) * d**-0.5
    mask = torch.ones(s // 2, s, dtype=torch.bool, device=device).tril(s // 2)
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vr.repeat_interleave(rep, 1)
    ref.backward(dout)
    # the blocks, in bfloat16
    kernel = _Kernel("sdpa", d**-0.5)
    qb, kb, vb, db = (x.to(torch.bfloat16) for x in (q[:, :, s // 2 :], k, v, dout))
    first, second = slice(0, s // 2), slice(s // 2, s)
    o1, l1 = kernel.forward(qb, kb[:, :, first], vb[:, :, first], causal=False)
    o2, l2 = kernel.forward(qb, kb[:, :, second], vb[:, :, second], causal=True)
    out, lse = _merge(*_merge(None, None, o1, l1), o2, l2)
    out = out.to(torch.bfloat16)
    lse_wide = torch.cat([torch.zeros_like(lse), lse], dim=2)[:, :, s // 2 :]  # a strided view, as the ring passes
    assert not lse_wide.is_contiguous()
    dq1, dk1, dv1 = kernel.backward(db, qb, kb[:, :, first], vb[:, :, first], out, lse_wide, causal=False)
    dq2, dk2, dv2 = kernel.backward(db, qb, kb[:, :, second], vb[:, :, second], out, lse_wide, causal=True)
    rel = {
        "out": _rel(out, ref.detach()),
        "dq": _rel(dq1.float() + dq2.float(), qr.grad[:, :, s // 2 :]),
        "dk": _rel(torch.cat([dk1, dk2], 2), kr.grad),
        "dv": _rel(torch.cat([dv1, dv2], 2), vr.grad),
    }
    print(f"\n{device}: relative differences {rel}")
    assert rel["out"] < 1e-2 and max(rel["dq"], rel["dk"], rel["dv"]) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_gemm_equals_the_loop_over_experts(device):
    """``torch._grouped_mm`` (the CUDA path of the routed experts) equals the loop over experts in bfloat16, an
    expert without rows included (bit-identical on torch 2.13's CPU kernel; on CUDA within bfloat16's rounding)."""
    from lightning_4d.features.moe.layer import GroupedExperts
    from lightning_4d.parallel._compat.kernels import grouped_mm

    if grouped_mm is None:
        pytest.skip("this torch has no torch._grouped_mm")
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 128).to(device=device, dtype=torch.bfloat16)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=0.05)
    counts = torch.tensor([40, 0, 56, 32], device=device)
    x = torch.randn(128, 64, device=device, dtype=torch.bfloat16)
    loop = experts.run(x, counts, experts.w1, experts.w3, experts.w2)
    experts.grouped_mm = grouped_mm
    grouped = experts._grouped(x, counts, experts.w1, experts.w3, experts.w2)
    assert _rel(grouped, loop) < 8e-3


def _tiny_job(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "tests/scripts/tiny_losses.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision, rtol", [("32-true", 1e-4), ("bf16-mixed", 1e-2)])
def test_tiny_job_on_cuda_equals_cpu(precision, rtol, tmp_path):
    init = tmp_path / "init.pt"  # one set of initial weights for both devices (their generators differ)
    _finish(_tiny_job("--write-init", str(init)))
    runs = {d: _tiny_job("--device", d, "--precision", precision, "--init-from", str(init), "--out", str(tmp_path / d))
            for d in ("cpu", "cuda")}  # fmt: skip
    for proc in runs.values():  # concurrently: each process runs one CPU thread
        _finish(proc)
    cpu, cuda = (json.loads((tmp_path / d).read_text())["losses"] for d in ("cpu", "cuda"))
    assert len(cpu) == len(cuda) == 20
    worst = max(abs(a - b) / abs(b) for a, b in zip(cuda, cpu))
    print(f"\n{precision}: CUDA vs CPU, largest relative loss difference over 20 steps {worst:.2e}")
    print(
        f"{precision}: losses CPU {[round(x, 5) for x in cpu]}\n{precision}: losses CUDA {[round(x, 5) for x in cuda]}"
    )
    assert worst <= rtol
