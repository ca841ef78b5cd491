"""ZeRO 2/3 expert units divide their gradients by D = dp·cp whatever torch's FSDP2 does on a one-rank group
(issue 32; ``lightning_4d.features.moe.runtime.average_expert_gradients``).

At ep = D the expert data-parallel group ``edp`` has one rank, and FSDP2's ``foreach_reduce`` skips the
reduce-scatter there. What it does with the divide factor then changed between releases: torch 2.13 divides when it
copies the gradient; the releases between pytorch#162021 and pytorch#167178 (torch 2.9's line) copied without
dividing, so the expert gradients came out D times too large. One process plays rank 0 of dp2 ep2 on torch's fake
process group (the one-rank expert unit moves no data, so its gradient is exact), and a wrapper around
``foreach_reduce`` that drops the divide factor on one-rank groups plays such a release.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from lightning_4d.config import ParallelConfig
from lightning_4d.mesh import build_mesh
from lightning_4d.parallel._compat.fake import init_fake_process_group
from lightning_4d.parallel.fsdp import apply_fsdp


class _Experts(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        local = torch.arange(12, dtype=torch.float32).view(2, 3, 2) / 10  # this rank's 2 of 4 experts
        self.w = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], shape=(4, 3, 2), stride=(6, 2, 1)))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w.to_local() * c).sum()


class _Model(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.experts = _Experts(ep_mesh)
        self.proj = nn.Linear(2, 2, bias=False)  # a dense parameter: the root unit's, over dp_cp

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.experts(c) + self.proj.weight.sum() * 0


def _expert_gradient(zero_stage: int, older_release: bool, monkeypatch) -> torch.Tensor:
    """The expert weight's local gradient after one backward of ``sum(w_local * c)`` (its per-rank gradient is c)."""
    if older_release:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        real = _fsdp_param_group.foreach_reduce

        def copy_without_dividing(*args, **kwargs):
            group = args[2] if len(args) > 2 else kwargs["reduce_scatter_group"]
            if group is not None and group.size() == 1:
                kwargs["gradient_divide_factor"] = None
                if len(args) > 8:  # positional: (..., device, gradient_divide_factor, ...)
                    args = (*args[:8], None, *args[9:])
                    kwargs.pop("gradient_divide_factor")
            return real(*args, **kwargs)

        monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", copy_without_dividing)
    mesh = build_mesh(ParallelConfig(data_parallel_size=2, expert_parallel_size=2, zero_stage=zero_stage), "cpu")
    assert mesh.edp.size() == 1 and mesh.dp_cp.size() == 2
    model = _Model(mesh.ep)
    apply_fsdp(model, mesh.dp_cp, zero_stage, blocks=[], moe_meshes={"expert_mesh": mesh.edp})
    c = torch.linspace(-1.0, 1.0, 12).view(2, 3, 2)
    model(c).backward()
    grad = model.experts.w.grad
    return (grad.to_local() if isinstance(grad, DTensor) else grad).detach().clone(), c


@pytest.fixture()
def fake_dp2():
    init_fake_process_group(0, 2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("older_release", [False, True], ids=["installed-torch", "copy-without-dividing"])
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_expert_gradients_at_ep_equal_to_dp_are_divided_by_dp(fake_dp2, zero_stage, older_release, monkeypatch):
    grad, c = _expert_gradient(zero_stage, older_release, monkeypatch)
    torch.testing.assert_close(grad.view_as(c), c / 2, rtol=0, atol=0)
