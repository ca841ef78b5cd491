"""Forward + backward tokens/s of context-parallel ring attention at cp=1 (no exchange: the kernels, the merge and
the bookkeeping alone) against plain ``F.scaled_dot_product_attention`` (flash), on one CUDA GPU, side by side in
one run; prints the ratio (goal: >= 0.95, docs/context_parallel.md "On CUDA").

Usage::

    python benchmarks/cp_kernel_speed.py [--seq-length 8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from lightning_4d.features.context_parallel.runtime import context_parallel_attention
    from lightning_4d.models.attention_backends import attention

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("nccl", rank=0, world_size=1)
    s = args.seq_length
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def timed(fn) -> float:
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        for _ in range(3):
            fn(*xs).backward(dout)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn(*xs).backward(dout)
        torch.cuda.synchronize()
        return args.iters * s / (time.perf_counter() - start)

    plain = timed(lambda a, b, c: attention(a, b, c, backend="sdpa"))
    ring = timed(lambda a, b, c: context_parallel_attention(a, b, c, dist.group.WORLD, method="ring", backend="sdpa"))
    print(
        f"forward+backward tokens/s at s={s}: ring cp=1 {ring:,.0f}, plain SDPA {plain:,.0f}, ratio {ring / plain:.3f}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
