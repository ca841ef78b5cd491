"""Loss parity and model-state bytes of parallel layouts against the single-process run (CPU, gloo, float32).

Every layout trains the tiny Llama (GQA: 4 heads, 2 kv heads) for 10 AdamW steps on the same global batches of the
embedded corpus. Each layout's logged per-step ``train_loss`` (the mean over the global batch) must equal the
single-process run's to 1e-5 relative, and its final weights must match. Each rank also reports the bytes of its
local parameter, gradient and optimizer-state shards, checked against what the ZeRO stage promises.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests._launch import SCRIPTS, torchrun

STEPS = 10
WORLD2 = [{"dp": 2, "zero": z} for z in range(4)] + [{"tp": 2, "zero": 0}]
WORLD4 = [{"dp": 2, "tp": 2, "zero": z} for z in range(4)] + [{"dp": 4, "zero": z} for z in range(4)]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5


def _run(tmp_path_factory, name: str, nproc: int, layouts: list[dict]):
    out = tmp_path_factory.mktemp(name)
    torchrun(nproc, SCRIPTS / "run_layouts.py", "--out", str(out), "--steps", str(STEPS), "--layouts",
             json.dumps(layouts), timeout=900)
    results = []
    for i, layout in enumerate(layouts):
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"layout{i}_rank*.json"))]
        weights = torch.load(out / f"layout{i}_weights.pt")
        results.append((layout, ranks, weights))
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory, "reference", 1, [{"reference": True}])[0]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _run(tmp_path_factory, "world2", 2, WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _run(tmp_path_factory, "world4", 4, WORLD4)


def _layout_id(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in layout.items())


def _check_parity(reference, result):
    _, ref_ranks, ref_weights = reference
    layout, ranks, weights = result
    ref_losses = ref_ranks[0]["losses"]
    assert len(ref_losses) == STEPS
    for r in ranks:  # identical on every rank, whatever its tp coordinate
        assert r["losses"] == ranks[0]["losses"]
    losses = ranks[0]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    werr = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    print(f"\n{_layout_id(layout)}: max rel loss diff {rel:.2e}, max abs weight diff {werr:.2e}; "
          f"losses {[round(x, 5) for x in losses]}")
    assert set(weights) == set(ref_weights)
    assert rel <= LOSS_RTOL
    assert werr <= WEIGHT_ATOL
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_parity_world2(reference, world2, index):
    _check_parity(reference, world2[index])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_parity_world4(reference, world4, index):
    _check_parity(reference, world4[index])


def _check_bytes(result):
    layout, ranks, _ = result
    zero, dp, tp = layout.get("zero", 0), layout.get("dp", 1), layout.get("tp", 1)
    by_tp: dict[int, list[dict]] = {}
    for r in ranks:  # mesh (pp, dp, cp, tp): tp innermost
        by_tp.setdefault(r["rank"] % tp, []).append(r["bytes"])
    for tp_rank, group in by_tp.items():
        assert len(group) == dp
        full = group[0]["tp_local_params"]  # fp32: bytes of one unsharded tp-local copy
        assert all(g["tp_local_params"] == full for g in group)
        total = {k: sum(g[k] for g in group) for k in ("params", "grads", "optimizer_states")}
        worst = {k: max(g[k] for g in group) for k in ("params", "grads", "optimizer_states")}
        print(f"\n{_layout_id(layout)} tp_rank {tp_rank}: unsharded {full} B; per rank (max) params {worst['params']} "
              f"grads {worst['grads']} optimizer {worst['optimizer_states']} B; sums over dp {total}")
        # bound for a 1/dp shard: every parameter split in dp chunks of ceil(n/dp) elements (4 bytes each)
        slack = 4 * group[0]["num_params"]
        sharded = {"params": zero >= 2, "grads": zero >= 2, "optimizer_states": zero >= 1}
        for key, is_sharded in sharded.items():
            expected_full = 2 * full if key == "optimizer_states" else full  # AdamW: exp_avg + exp_avg_sq
            if is_sharded:
                assert total[key] == expected_full, key  # the shards partition one copy exactly
                per_rank_bound = expected_full / dp + (2 if key == "optimizer_states" else 1) * slack
                assert worst[key] <= per_rank_bound, key
            else:
                assert all(g[key] == expected_full for g in group), key


@pytest.mark.parametrize("index", range(len(WORLD2)), ids=[_layout_id(x) for x in WORLD2])
def test_model_state_bytes_world2(world2, index):
    _check_bytes(world2[index])


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[_layout_id(x) for x in WORLD4])
def test_model_state_bytes_world4(world4, index):
    _check_bytes(world4[index])
