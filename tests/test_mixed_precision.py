"""Mixed precision with master weights (``parallel/sharded_optimizer.py``) and the lean RMSNorm
(``models/llama.py``), single process: exact arithmetic against plain PyTorch references, and the tensors each piece
keeps.

The multi-process layouts (dp, tp, pp, cp under ``bf16-mixed`` against a single-process ``bf16-mixed`` run) are in
``tests/test_parity.py``; the bytes against the memory model in ``tests/test_memory_model.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_4d.measure import model_state_tensors
from lightning_4d.models.llama import RMSNorm
from lightning_4d.parallel.grad_buffers import GradientBuckets
from lightning_4d.parallel.sharded_optimizer import (
    MasterWeights,
    ShardedOptimizer,
    mixed_precision_dtype,
    setup_zero,
    validate_precision,
)


def _meta_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Meta's ``RMSNorm.forward`` through plain autograd: ``self._norm(x.float()).type_as(x) * self.weight``."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rmsnorm_equals_meta_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(16).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    y = norm(x)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    x2, w2 = x.detach().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    y2 = _meta_rmsnorm(x2, w2, norm.eps)
    gx2, gw2 = torch.autograd.grad(y2, (x2, w2), g)
    assert torch.equal(y, y2)  # the forward is the same arithmetic
    assert gx.dtype == dtype and gw.dtype == dtype
    # the input gradient is computed in closed form instead of through autograd's graph: float32 round-off
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(gx, gx2, rtol=tol, atol=tol)
    torch.testing.assert_close(gw, gw2, rtol=tol, atol=tol)


def test_rmsnorm_saves_its_input_and_the_reciprocal_rms_only():
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    h = x * 1  # the residual stream's tensor (not a leaf)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(h)
    activations = [t for t in saved if t.data_ptr() != norm.weight.data_ptr()]
    assert sorted((tuple(t.shape), t.dtype) for t in activations) == [
        ((2, 8, 1), torch.float32),
        ((2, 8, 64), torch.bfloat16),
    ]
    assert any(t.data_ptr() == h.data_ptr() for t in activations)  # the input itself, no copy


def test_precision_flags():
    assert mixed_precision_dtype("bf16-mixed") is torch.bfloat16
    assert mixed_precision_dtype("16-mixed") is None and mixed_precision_dtype("32-true") is None
    validate_precision("bf16-mixed", 1)
    for stage in (0, 1, 2, 3):
        with pytest.raises(ValueError, match="precision='16-mixed' is not supported by FourDStrategy.*bf16-mixed"):
            validate_precision("16-mixed", stage)
    validate_precision("bf16-mixed", 3, full_file_checkpoints=True)
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False.*bf16-mixed"):
        validate_precision("bf16-mixed", 0, full_file_checkpoints=True)


@pytest.fixture()
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_master_weights_step_in_float32(group):
    """ZeRO 0 with master weights on one rank: bf16 parameters, gradients accumulated in float32 buckets over two
    backward passes, AdamW stepping float32 masters; the bf16 weights are the masters rounded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    reference = [p.detach().clone() for p in model.parameters()]  # the fp32 masters' starting point
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buckets = setup_zero(model, [optimizer], group, zero_stage=0, masters=MasterWeights(torch.float32))
    assert isinstance(buckets, GradientBuckets) and ShardedOptimizer.of(optimizer) is not None
    model.to(torch.bfloat16)
    buckets.register_hooks()  # with master weights, once the parameters are cast
    xs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(2)]
    for x in xs:  # two micro-batches, accumulated
        model(x).float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters())  # moved into the float32 buckets
    grads = [buckets.main_grad(p).clone() for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    # the same gradients through plain autograd (bf16 weights), summed in float32
    expected = [torch.zeros_like(r) for r in reference]
    for x in xs:
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        out = x @ params[0].t() @ params[1].t()
        for e, g in zip(expected, torch.autograd.grad(out.float().square().mean(), params)):
            e += g.float().reshape_as(e)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.view_as(e), e, rtol=0, atol=0)
    buckets.synchronize()
    ShardedOptimizer.of(optimizer).step()
    buckets.start_accumulation()
    masters = [p.detach().clone().requires_grad_() for p in reference]
    for m, e in zip(masters, expected):
        m.grad = e
    torch.optim.AdamW(masters, lr=1e-2).step()
    sharded = ShardedOptimizer.of(optimizer)
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(sharded.shard[id(p)].view_as(m), m.detach(), rtol=0, atol=0)
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    tensors = model_state_tensors(model, [optimizer], buckets)
    assert sum(t.numel() * t.element_size() for t in tensors["master_weights"]) == 4 * (8 * 16 + 16 * 4)
    # the next backward overwrites the buckets instead of adding to the last step's gradients
    model(xs[0]).float().square().mean().backward()
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    fresh = torch.autograd.grad((xs[0] @ params[0].t() @ params[1].t()).float().square().mean(), params)
    for p, g in zip(model.parameters(), fresh):
        assert torch.equal(buckets.main_grad(p), g.float().reshape(-1))
    buckets.close()


@pytest.mark.parametrize("command", ["fit", "estimate", "measure"])
def test_16_mixed_is_refused_in_our_words_before_anything_starts(command, capsys):
    """``16-mixed`` is refused with the reason and the flags that train (one line, exit 2): by ``lightning-4d fit``
    before the Trainer is built (Lightning's own refusal named neither FourDStrategy nor why), and by ``estimate``
    and ``measure``, which modelled it although nothing could train with it."""
    from lightning_4d.cli import main
    from lightning_4d.config import check_training_precision

    if command == "fit":
        config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
        argv = ["fit", "--config", config, "--trainer.precision=16-mixed", "--trainer.max_steps=1"]
    else:
        argv = [command, "--model", "tiny-test", "--seq-length", "64", "--dp", "1", "--precision", "16-mixed"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "precision='16-mixed' is not supported by FourDStrategy" in err and "'bf16-mixed'" in err
    for flag in ("32-true", "bf16-mixed", "bf16-true", "16-true"):
        assert check_training_precision(flag) == flag
