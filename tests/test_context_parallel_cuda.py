"""Context-parallel attention on CUDA (skipped without a GPU): the fused kernels in bfloat16 against the float32
reference (the ring method's tokens/s against plain SDPA is a benchmark, ``benchmarks/cp_kernel_speed.py``).

Run on a GPU machine with ``python -m pytest tests/test_context_parallel_cuda.py -s`` and record the printed figures
in docs/context_parallel.md.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_RTOL = 1e-2


@pytest.fixture(scope="module")
def group():
    """A one-rank NCCL process group on a free port, destroyed after this module's tests (tests after them assert
    that no process group is left behind)."""
    import socket

    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


def _inputs(s: int, hq: int = 32, hkv: int = 8, d: int = 128, b: int = 1, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(b, s, hkv, d, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(b, s, hkv, d, device="cuda", generator=g, dtype=dtype)
    return q, k, v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_block_kernels_and_merge_match_float32_reference(backend):
    """A causal block and a full block merged by log-sum-exp (one ring step's work) equal full causal attention."""
    from lightning_4d.features.context_parallel.runtime import _Kernel, _merge
    from lightning_4d.models.attention_backends import _flash_attn_installed, attention

    if backend == "flash" and not _flash_attn_installed():
        pytest.skip("flash-attn is not installed")
    q, k, v = _inputs(2048)
    ref = attention(q.float(), k.float(), v.float(), backend="eager")
    kernel = _Kernel(backend, q.shape[-1] ** -0.5)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    half = q.shape[1] // 2
    # second half of the queries: full block over the first half of the keys, causal block over the second
    o1, l1 = kernel.forward(qt[:, :, half:], kt[:, :, :half], vt[:, :, :half], causal=False)
    o2, l2 = kernel.forward(qt[:, :, half:], kt[:, :, half:], vt[:, :, half:], causal=True)
    out, _ = _merge(*_merge(None, None, o1, l1), o2, l2)
    err = _rel(out.transpose(1, 2), ref[:, half:])
    print(f"\n{backend} block kernels + merge, bf16 vs float32 reference: relative error {err:.2e}")
    assert err <= BF16_RTOL


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_cp_attention_bf16_forward_backward(group, method):
    from lightning_4d.features.context_parallel.runtime import context_parallel_attention
    from lightning_4d.models.attention_backends import attention

    q, k, v = _inputs(4096)
    dout = torch.randn_like(q)
    ref_in = [x.float().requires_grad_() for x in (q, k, v)]
    ref = attention(*ref_in, backend="eager")
    ref.backward(dout.float())
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*xs, group, method=method, backend="sdpa")
    out.backward(dout)
    errors = {"out": _rel(out, ref), **{f"d{n}": _rel(x.grad, r.grad) for n, x, r in zip("qkv", xs, ref_in)}}
    print(f"\n{method} cp=1 bf16 vs float32: {errors}")
    assert max(errors.values()) <= BF16_RTOL
