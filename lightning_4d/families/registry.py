"""The registry of model families (:class:`~lightning_4d.families.base.ModelFamily`): the strategy,
``parallel/parallelize.py``, ``init_from`` and the memory callback ask it which models a LightningModule holds and
never test a model's class themselves.

Adding a family: one file with a :class:`~lightning_4d.families.base.ModelFamily` subclass (ours beside the registry,
a foreign library's in :mod:`lightning_4d.adapters`) and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch.nn as nn

from lightning_4d.adapters.hf_llama import HF_LLAMA
from lightning_4d.families.base import ModelFamily, PipelineLayout
from lightning_4d.families.hf_io import is_hf_model_dir
from lightning_4d.families.native_llama import LLAMA
from lightning_4d.features.moe.hf_mixtral import HF_MIXTRAL

__all__ = ["FAMILIES", "ModelFamily", "PipelineLayout", "find_models", "estimate_config", "load_initial_weights"]

#: every model family the strategy can split, asked in this order
FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,  # lightning_4d.models.LlamaModel
    HF_LLAMA,  # transformers' LlamaForCausalLM
    HF_MIXTRAL,  # transformers' MixtralForCausalLM
)


def find_models(module: nn.Module) -> list[tuple[str, ModelFamily, nn.Module]]:
    """``[(name in module, family, model), ...]``: every model of a registered family inside ``module`` (itself
    included), outermost first; the submodules of a found model are not searched."""
    found: list[tuple[str, ModelFamily, nn.Module]] = []
    inside: set[int] = set()
    for name, m in module.named_modules():
        if id(m) in inside:
            continue
        family = next((f for f in FAMILIES if f.is_model(m)), None)
        if family is not None:
            found.append((name, family, m))
            inside.update(id(sub) for sub in m.modules())
    return found


def estimate_config(module: Any) -> Optional[Any]:
    """The :class:`~lightning_4d.models.LlamaConfig` the memory estimate of ``module`` (a LightningModule) uses: the
    first registered model's (:meth:`ModelFamily.model_config`), ``None`` when it holds none or one whose variant
    the memory model does not model."""
    if not isinstance(module, nn.Module):
        return None
    for _, family, model in find_models(module):
        try:
            return family.model_config(model)
        except (ValueError, KeyError, TypeError):
            return None
    return None


def load_initial_weights(module: nn.Module, init_from: Union[str, Path]) -> None:
    """Replace the initial weights of the model inside ``module`` (after parallelization and materialization, before
    the optimizer copies master weights) with those at ``init_from``: a Hugging Face model directory
    (:func:`~lightning_4d.families.hf_io.is_hf_model_dir`; ``config.json`` + ``model.safetensors`` or sharded with an
    index; :meth:`ModelFamily.load_hf`) or one of our checkpoints (sharded folder or full file;
    :meth:`ModelFamily.load_checkpoint_weights`). Every rank reads only the slices it holds (DCP), so no rank
    materializes a full fp32 copy of the model. Works on every layout and on one process.

    Raises:
        ValueError: ``init_from`` does not exist or is neither kind, ``module`` holds no (or, for a Hugging Face
            directory, several) models of a registered family, or a tensor is missing or unreadable (named).
    """
    path = Path(init_from)
    if not path.exists():
        raise ValueError(
            f"init_from={str(init_from)!r} does not exist: pass a Hugging Face model directory "
            "(config.json + model.safetensors[.index.json]) or a checkpoint of ours"
        )
    models = find_models(module)
    if not models:
        raise ValueError(
            f"init_from={str(init_from)!r}: {type(module).__name__} holds no model of a family "
            f"FourDStrategy knows ({', '.join(f.name for f in FAMILIES)})"
        )
    if is_hf_model_dir(path):
        if len(models) > 1:
            raise ValueError(
                f"init_from={str(init_from)!r}: {type(module).__name__} holds {len(models)} models "
                f"({[n for n, _, _ in models]}); a Hugging Face directory holds one"
            )
        _, family, model = models[0]
        family.load_hf(model, path)
    elif path.is_dir() and not (path / ".metadata").is_file():
        raise ValueError(
            f"init_from={str(init_from)!r} is neither a Hugging Face model directory (config.json + "
            "model.safetensors or model.safetensors.index.json) nor a sharded checkpoint (.metadata)"
        )
    else:
        for prefix, family, model in models:
            family.load_checkpoint_weights(prefix, model, path)
