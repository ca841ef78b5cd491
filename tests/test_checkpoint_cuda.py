"""ZeRO checkpoint faults of issue 32 that only CUDA shows (skipped without a GPU; written on a CPU machine, not yet
run on one): a save keeps the gathered optimizer states in host memory (no device bytes held, also for DTensor
parameters on a CUDA mesh), and a resume with the fused AdamW puts Adam's ``step`` on the GPU and steps.

Run on a GPU machine with ``python -m pytest tests/test_checkpoint_cuda.py -s``. The CPU counterparts are in
``tests/test_optimizer_state_placement.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_4d.checkpoint import param_fqns
from lightning_4d.parallel.sharded_optimizer import MasterWeights, ShardedOptimizer, setup_zero
from tests.test_context_parallel_cuda import group  # noqa: F401  (the fixture: one rank on NCCL)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model_on_cuda(tp_mesh: DeviceMesh) -> nn.Module:
    """Two linear layers on cuda:0 whose weights are DTensors over the one-rank CUDA mesh ``tp_mesh``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 32, bias=False)).cuda()
    for module, placement in zip(model, (Shard(0), Replicate())):
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), tp_mesh, [placement]))
    return model


def _build(tp_mesh: DeviceMesh, pg) -> tuple:
    model = _model_on_cuda(tp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    buckets = setup_zero(model, [optimizer], pg, zero_stage=0, masters=MasterWeights(torch.float32))
    model.to(torch.bfloat16)
    buckets.register_hooks()
    return model, optimizer, ShardedOptimizer.of(optimizer), buckets


def _train_step(model, sharded, buckets) -> None:
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    h = x @ model[0].weight.to_local().t()  # tp of one rank: the local weights are whole
    (h @ model[1].weight.to_local().t()).float().square().mean().backward()
    buckets.synchronize()
    sharded.step()
    buckets.start_accumulation()


@pytest.mark.usefixtures("group")
def test_save_holds_no_device_bytes_and_fused_adamw_resumes():
    tp_mesh = DeviceMesh("cuda", torch.arange(1), mesh_dim_names=("tp",))
    model, optimizer, sharded, buckets = _build(tp_mesh, dist.group.WORLD)
    _train_step(model, sharded, buckets)
    fqns = param_fqns(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gathered = sharded.gathered_state(fqns)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    print(f"\ndevice bytes held by the gathered optimizer state: {held}")
    assert held == 0  # every state (master, m, v: 12 bytes per parameter here) is in host memory
    for key, value in gathered.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            assert local.device.type == "cpu", key
    # resume into a fresh optimizer: the fused kernel reads step on the GPU
    model2, optimizer2, sharded2, buckets2 = _build(tp_mesh, dist.group.WORLD)
    sharded2.load_gathered_state(param_fqns(model2), gathered)
    for state in optimizer2.state.values():
        assert state["step"].device.type == "cuda" and state["step"].dtype == torch.float32
        assert state["exp_avg"].device.type == "cuda"
    _train_step(model2, sharded2, buckets2)  # crashed before: the fused kernel got a CPU step
    buckets.close()
    buckets2.close()
