"""Where a :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer`'s states live across a checkpoint
(issue 32).

- On a resume, each loaded state gets the device and dtype torch's own ``Optimizer.load_state_dict`` gives it: Adam's
  ``step`` on the parameter's device in float32 for a ``fused`` or ``capturable`` optimizer (the fused CUDA kernel
  reads it there), on the CPU otherwise; ``exp_avg`` / ``exp_avg_sq`` in the parameter's dtype on its device. Shown
  on the meta device (a device other than the CPU that a CPU machine has) and with bfloat16 parameters.
- On a save, the gathered states of DTensor parameters stay in CPU memory, and so do the resume templates DCP reads
  into: ``DTensor.from_local`` copies a CPU tensor to the device of its mesh (a CUDA mesh: the whole tp-local
  optimizer state on the GPU until the save is written). A mesh whose device type is ``"meta"`` stands in for the
  CUDA mesh: from the CPU, ``from_local`` moves to it the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_4d.checkpoint import _sharded_optimizer_template, check_complete, param_fqns, read_folder
from lightning_4d.parallel._compat.fake import init_fake_process_group
from lightning_4d.parallel._compat.lightning import LIGHTNING_METADATA_FILENAME
from lightning_4d.parallel.sharded_optimizer import (
    MasterWeights,
    ShardedOptimizer,
    host_zeros_like,
    setup_zero,
)
from tests.test_mixed_precision import group  # noqa: F401  (the fixture: a one-rank gloo process group)


@pytest.fixture()
def fake_two_ranks():
    """Rank 0 of 2 on torch's fake process group: ZeRO 1 shards the optimizer (no data moves; none is needed)."""
    init_fake_process_group(0, 2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _saved_states(model: nn.Module) -> dict[str, torch.Tensor]:
    """A gathered (layout-free) AdamW state of ``model`` as a checkpoint holds it: float32 on the CPU."""
    g = torch.Generator().manual_seed(1)
    flat: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        flat[f"state.{name}.step"] = torch.tensor(3.0)
        flat[f"state.{name}.exp_avg"] = torch.randn(p.shape, generator=g)
        flat[f"state.{name}.exp_avg_sq"] = torch.rand(p.shape, generator=g)
    return flat


def _torch_loaded(shard: torch.Tensor, kwargs: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as torch's ``load_state_dict`` places it for an AdamW(**kwargs) over a tensor like ``shard``."""
    reference = torch.optim.AdamW([nn.Parameter(torch.empty_like(shard))], lr=1e-2, **kwargs)
    packed = reference.state_dict()
    packed["state"] = {0: {k: v.clone() for k, v in state.items()}}
    reference.load_state_dict(packed)
    return next(iter(reference.state.values()))


CASES = {
    # capturable: step moves to the parameter's device (meta here, CUDA in a run); fails before the fix
    "meta-capturable": ("meta", torch.float32, {"capturable": True}),
    "meta-foreach": ("meta", torch.float32, {}),
    # bfloat16 parameters stepped without master weights (bf16-true): torch casts m and v to bfloat16
    "cpu-bf16-fused": ("cpu", torch.bfloat16, {"fused": True}),
    "cpu-bf16-foreach": ("cpu", torch.bfloat16, {}),
    "cpu-fp32-fused": ("cpu", torch.float32, {"fused": True}),
    "cpu-fp32-capturable": ("cpu", torch.float32, {"capturable": True}),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["gathered", "legacy-per-rank"])
@pytest.mark.parametrize("case", list(CASES))
def test_loaded_states_are_placed_as_torch_load_state_dict_places_them(fake_two_ranks, case, legacy):
    device, dtype, kwargs = CASES[case]
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False)).to(device=device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)
    setup_zero(model, [optimizer], fake_two_ranks, zero_stage=1)
    sharded = ShardedOptimizer.of(optimizer)
    assert sharded is not None and sharded.sharded
    fqns = param_fqns(model)
    flat = _saved_states(model)
    flat["param_groups.0.weight.lr"] = flat["param_groups.1.weight.lr"] = 5e-3
    if legacy:  # an earlier version's per-rank files: {name: {key: owned slice}}
        states = {}
        for p in model.parameters():
            start, end = sharded.owned[id(p)]
            name = fqns[id(p)]
            states[name] = {
                k: (v if v.ndim == 0 else v.reshape(-1)[start:end])
                for k, v in ((k, flat[f"state.{name}.{k}"]) for k in ("step", "exp_avg", "exp_avg_sq"))
            }
        sharded.load_sharded_state(fqns, states)
    else:
        sharded.load_gathered_state(fqns, flat)
    # the param groups hold the model's parameters again, with the saved hyper-parameters
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    if not legacy:
        assert all(g["lr"] == 5e-3 for g in optimizer.param_groups)
    for p in model.parameters():
        shard = sharded.shard[id(p)]
        start, end = sharded.owned[id(p)]
        name = fqns[id(p)]
        saved = {k: flat[f"state.{name}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
        saved = {k: (v if v.ndim == 0 else v.reshape(-1)[start:end]) for k, v in saved.items()}
        expected = _torch_loaded(shard, kwargs, saved)
        ours = optimizer.state[shard]
        assert sorted(ours) == sorted(expected)
        for key in expected:
            got = (ours[key].device, ours[key].dtype, tuple(ours[key].shape))
            want = (expected[key].device, expected[key].dtype, tuple(expected[key].shape))
            assert got == want, f"{case} {name}.{key}: loaded as {got}, torch's load_state_dict gives {want}"
            if device != "meta":
                assert torch.equal(ours[key], expected[key])


def _dtensor_model(mesh: DeviceMesh) -> nn.Module:
    """Two linear layers whose weights are DTensors over ``mesh`` (tp size 1; one Shard(0), one Replicate) with
    their local tensors in CPU memory, whatever the mesh's device type (as a CUDA run's CPU copies are)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    for module, placement in zip(model, (Shard(0), Replicate())):
        w = module.weight.detach()
        on_meta = DTensor.from_local(w.to("meta"), mesh, [placement], shape=w.shape, stride=w.stride())
        p = torch.empty_like(on_meta, device="cpu")
        p.to_local().copy_(w)
        module.weight = nn.Parameter(p)
    return model


@pytest.mark.usefixtures("group")
def test_host_zeros_like_stays_on_the_cpu_whatever_the_mesh_device():
    mesh = DeviceMesh("meta", torch.arange(1), mesh_dim_names=("tp",))
    p = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)], shape=(4, 3), stride=(3, 1))
    for dtype in (torch.float32, torch.bfloat16):
        t = host_zeros_like(p, dtype)
        assert isinstance(t, DTensor) and t.device_mesh is mesh and t.placements == (Shard(0),)
        assert t.shape == p.shape and t.stride() == p.stride() and t.dtype == dtype
        local = t.to_local()
        assert local.device == torch.device("cpu") and local.shape == (4, 3) and not local.any()
    plain = host_zeros_like(torch.empty(5, 2, device="meta"), torch.bfloat16)
    assert not isinstance(plain, DTensor) and plain.device.type == "cpu" and plain.shape == (5, 2)
    assert plain.dtype == torch.bfloat16


@pytest.mark.usefixtures("group")
def test_save_and_resume_keep_dtensor_states_in_cpu_memory(tmp_path):
    """ZeRO 0 with master weights on one rank, DTensor (tp) parameters: the states gathered for a save and the templates
    a resume reads into stay in CPU memory (their local tensors on the CPU, no copy to the mesh's device), and the
    DCP round trip gives back the same states."""
    from torch.distributed.checkpoint import save as dcp_save

    # a mesh whose device is not the CPU stands for a CUDA mesh: DTensor.from_local moves a CPU tensor to it
    mesh = DeviceMesh("meta", torch.arange(1), mesh_dim_names=("tp",))
    model = _dtensor_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    setup_zero(model, [optimizer], dist.group.WORLD, zero_stage=0, masters=MasterWeights(torch.float32))
    sharded = ShardedOptimizer.of(optimizer)
    fqns = param_fqns(model)
    flat = _saved_states(model)
    sharded.load_gathered_state(fqns, flat)
    gathered = sharded.gathered_state(fqns)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "master"):
            value = gathered[f"state.{fqns[id(p)]}.{key}"]
            assert isinstance(value, DTensor) and value.placements == p.placements and value.shape == p.shape
            assert value.to_local().device == torch.device("cpu"), f"{key} of {fqns[id(p)]} left the CPU"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(gathered[f"state.{fqns[id(p)]}.{key}"].to_local(), flat[f"state.{fqns[id(p)]}.{key}"])
        assert torch.equal(gathered[f"state.{fqns[id(p)]}.master"].to_local(), p.to_local())
        assert gathered[f"state.{fqns[id(p)]}.step"].device == torch.device("cpu")
    dcp_save({"optimizer_0": gathered}, checkpoint_id=tmp_path)
    (tmp_path / LIGHTNING_METADATA_FILENAME).write_bytes(b"")  # Lightning's metadata file: check_complete asks for it
    template = _sharded_optimizer_template(tmp_path, check_complete(tmp_path), "optimizer_0", model, fqns)
    for name, value in template.items():
        if isinstance(value, torch.Tensor):
            assert _local_device(value) == torch.device("cpu"), f"the resume template {name} is not in CPU memory"
    state = {"optimizer_0": template}
    read_folder(state, tmp_path)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                _local(state["optimizer_0"][f"state.{fqns[id(p)]}.{key}"]),
                _local(gathered[f"state.{fqns[id(p)]}.{key}"]),
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_device(t: torch.Tensor) -> torch.device:
    return _local(t).device
