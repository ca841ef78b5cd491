"""The ring autograd functions of ``tensor_parallel_overlap`` (``lightning_4d/features/tensor_parallel/runtime.py``)
against references, on every rank of a gloo group (``torchrun --nproc-per-node t tests/scripts/tp_overlap_unit.py --out
DIR``).

Every rank builds the same full problem from one seed. Column side: :func:`ring_projection` vs the all-gather
version :func:`sequence_parallel_projection` and vs one-process autograd on the gathered sequence. Row side:
:func:`ring_output_projection` vs one-process autograd of ``Σ_q y_q @ W_q^T`` (rank r's sequence rows). Writes the
largest absolute differences of the outputs and all gradients (``DIR/unit_rank{r}.json``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_4d.features.tensor_parallel.runtime import (
    ring_output_projection,
    ring_projection,
    sequence_parallel_projection,
)
from lightning_4d.parallel.comm import CommMeter


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.clone())
    return lin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    b, n, h, f = 2, 3, 8, 12  # n: tokens per rank; f: features per rank
    diffs: dict[str, float] = {}

    def diff(name: str, a: torch.Tensor, ref: torch.Tensor) -> None:
        diffs[name] = max(diffs.get(name, 0.0), (a - ref).abs().max().item())

    # ---------------- column side: outs_i = all_gather_seq(x) @ W_i^T, two projections of different widths
    x_all = torch.randn(t, b, n, h, dtype=torch.float64)
    w_full = [torch.randn(t * f, h, dtype=torch.float64), torch.randn(t * 2, h, dtype=torch.float64)]
    g_all = [torch.randn(b, t * n, w.shape[0], dtype=torch.float64) for w in w_full]  # output grads, full
    x_ref = x_all.clone().requires_grad_()
    w_ref = [w.clone().requires_grad_() for w in w_full]
    full = torch.cat(list(x_ref), dim=1)  # [b, s, h] in rank order
    (sum(((full @ w.t()) * g).sum() for w, g in zip(w_ref, g_all))).backward()
    for name, fn in (("ring", ring_projection), ("allgather", sequence_parallel_projection)):
        x = x_all[r].clone().requires_grad_()
        lins = [_linear(w.chunk(t)[r]) for w in w_full]
        meter = CommMeter({"tp": group})
        with meter:
            outs = fn(x, tuple(lins), group)
            local_g = [g[..., g.shape[-1] // t * r : g.shape[-1] // t * (r + 1)] for g in g_all]
            sum((o * g).sum() for o, g in zip(outs, local_g)).backward()
        diffs[f"col_{name}_tp_bytes"] = meter.total("tp")
        for i, (o, w) in enumerate(zip(outs, w_full)):
            diff(f"col_{name}_out", o, full.detach() @ w.chunk(t)[r].t())
            diff(f"col_{name}_dw", lins[i].weight.grad, w_ref[i].grad.chunk(t)[r])
        diff(f"col_{name}_dx", x.grad, x_ref.grad[r])
        if name == "ring":
            ring_outs = [o.detach() for o in outs]
            ring_grads = [x.grad] + [lin.weight.grad for lin in lins]
        else:
            for i, o in enumerate(outs):
                diff("col_ring_vs_allgather", ring_outs[i], o)
            for a, ref in zip(ring_grads, [x.grad] + [lin.weight.grad for lin in lins]):
                diff("col_ring_vs_allgather", a, ref)

    # ---------------- row side: out_r = Σ_q y_q[:, rows r] @ W_q^T
    y_all = torch.randn(t, b, t * n, f, dtype=torch.float64)
    w2 = torch.randn(h, t * f, dtype=torch.float64)
    go_all = torch.randn(t, b, n, h, dtype=torch.float64)
    y_ref = y_all.clone().requires_grad_()
    w2_ref = w2.clone().requires_grad_()
    total = sum(y_ref[q] @ w2_ref[:, q * f : (q + 1) * f].t() for q in range(t))  # [b, s, h] summed over ranks
    ref_out = [total[:, q * n : (q + 1) * n] for q in range(t)]
    sum((o * g).sum() for o, g in zip(ref_out, go_all)).backward()
    y = y_all[r].clone().requires_grad_()
    lin = _linear(w2[:, r * f : (r + 1) * f])
    meter = CommMeter({"tp": group})
    with meter:
        out = ring_output_projection(y, lin, group)
        (out * go_all[r]).sum().backward()
    diffs["row_ring_tp_bytes"] = meter.total("tp")
    diffs["row_reduce_scatter_bytes"] = (t - 1) * out.numel() * out.element_size()  # RS of [b, s, h]
    diffs["row_allgather_bytes"] = (t - 1) * go_all[r].numel() * go_all[r].element_size()  # backward AG of dY
    diff("row_ring_out", out, ref_out[r].detach())
    diff("row_ring_dy", y.grad, y_ref.grad[r])
    diff("row_ring_dw", lin.weight.grad, w2_ref.grad[:, r * f : (r + 1) * f])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"unit_rank{r}.json").write_text(json.dumps(diffs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from lightning_4d.parallel._compat.process import exit_distributed_process  # not into finalization: see there

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_distributed_process(main() or 0)
