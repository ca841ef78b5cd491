"""A user's own LightningModule under FourDStrategy: it applies (or not) plans in configure_model with the mesh
the strategy exposes; the strategy averages gradients over dp and shards optimizer states (ZeRO 1)."""

import json

import pytest

from tests._launch import SCRIPTS, torchrun


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("user") / "ref.json"
    torchrun(1, SCRIPTS / "user_module.py", "--out", str(out))
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_user_module_matches_single_process(reference, tmp_path, zero):
    out = tmp_path / "losses.json"
    torchrun(2, SCRIPTS / "user_module.py", "--out", str(out), "--zero", str(zero))
    losses = json.loads(out.read_text())
    print(f"\nuser module ZeRO {zero}: {losses} vs {reference}")
    assert len(losses) == 5
    assert losses == pytest.approx(reference, rel=1e-5)
