"""The feature registry (``lightning_4d/features/``): every feature's record names layout fields that exist, no layout
field has two owners, and the terms and runtime each record names import."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest

from lightning_4d.features import FEATURES
from lightning_4d.layout import LAYOUT_FIELDS


def test_each_layout_field_has_at_most_one_feature():
    owners = Counter(owner for feature in FEATURES for owner in feature.owns)
    assert all(n == 1 for n in owners.values()), owners
    declared = {f.feature for f in LAYOUT_FIELDS}
    assert set(owners) <= declared, set(owners) - declared
    assert all(feature.fields for feature in FEATURES)


@pytest.mark.parametrize("feature", FEATURES, ids=[f.name for f in FEATURES])
def test_the_modules_a_feature_names_import(feature):
    names = [name for name in (feature.costs, feature.runtime) if name is not None]
    assert len({name.rsplit(".", 1)[0] for name in names}) <= 1, names  # one folder per feature
    for name in names:
        importlib.import_module(name)


def test_the_overlap_rules_run_in_the_config():
    """``ParallelConfig`` runs each feature's ``check``: the tp ring overlap's, by its exact message."""
    from lightning_4d.config import ParallelConfig

    with pytest.raises(ValueError, match=r"^tensor_parallel_overlap='yes' is not valid: expected True or False\.$"):
        ParallelConfig(tensor_parallel_overlap="yes")
