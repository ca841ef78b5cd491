"""The Mixture-of-Experts rules of a training layout: the MoE component's validation (issue 33, "each parallel
feature owns itself"), pure Python so that the memory estimator and the planner run it without torch.

:class:`~lightning_4d.config.ParallelConfig`'s validation, the one place where the features' rules meet, calls these
and holds no MoE rule itself: :func:`check_moe_layout` from ``__post_init__``, ``resolve`` (the layout alone) and
``validate_model`` (the layout against the model), :func:`check_float8` from ``validate_model``'s float8 check. The
rest of the MoE component: ``features/moe/runtime.py`` and ``features/moe/expert.py`` (the runtime),
``features/moe/layer.py`` (the layer), ``features/moe/costs.py`` (its memory and step-time terms);
``docs/architecture.md``, "The MoE component".
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_4d.models.llama_config import divisors


def check_moe_layout(layout: Any, model_config: Any = None, resolved: bool = False) -> None:
    """The Mixture-of-Experts rules of a training layout (``layout``: a
    :class:`~lightning_4d.config.ParallelConfig`), called from its validation (``ParallelConfig.__post_init__``,
    ``resolve`` and ``validate_model``): without ``model_config`` the rules of the layout alone (the one that needs
    the resolved dp only when ``resolved``), with it those against the model (``model_config``: a
    :class:`~lightning_4d.models.llama_config.LlamaConfig` or any config with ``is_moe`` and ``num_experts``; one
    without them is dense). What training an MoE model supports today (``docs/moe.md``); the estimator and the planner
    follow, so that they propose only layouts ``FourDStrategy`` runs.

    Raises:
        ValueError: ``expert_parallel_size`` > 1 with PowerSGD, or not dividing dp·cp·tp (ep ranks are carved out
            of the ranks that hold disjoint tokens of an MoE layer: the data-parallel ranks and, folded, the tp ranks,
            ``docs/moe.md``); with ``model_config``: ep > 1 for a dense model, an ep that does not divide
            ``num_experts``, an MoE model with tp > 1 and PowerSGD.
    """
    ep, tp = layout.expert_parallel_size, layout.tp
    if model_config is None:
        if ep > 1 and layout.gradient_compression == "powersgd":
            raise ValueError(
                f"gradient_compression='powersgd' is not supported with expert_parallel_size="
                f"{ep}: use gradient_compression='none' or 'bf16' with expert parallelism."
            )
        if resolved and (layout.dp_cp * tp) % ep != 0:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide dp*cp*tp = {layout.dp}*{layout.cp}*{tp} = "
                f"{layout.dp_cp * tp}: ep ranks are carved out of the data-parallel ranks and, folded, the tp ranks; "
                f"valid expert_parallel_size values for this layout: {divisors(layout.dp_cp * tp)}."
            )
        return
    moe = getattr(model_config, "is_moe", False)
    if ep > 1 and not moe:
        raise ValueError(
            f"expert_parallel_size={ep} needs a Mixture-of-Experts model (num_experts > 0); this model is dense "
            f"(num_experts={getattr(model_config, 'num_experts', 0)}): the only valid expert_parallel_size is 1."
        )
    if ep > 1 and model_config.num_experts % ep != 0:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide num_experts={model_config.num_experts} (each ep rank holds "
            f"num_experts/ep whole experts); valid expert_parallel_size values for this model: "
            f"{divisors(model_config.num_experts)}."
        )
    if moe and tp > 1 and layout.gradient_compression == "powersgd":
        raise ValueError(
            f"gradient_compression='powersgd' is not supported for a Mixture-of-Experts model with "
            f"tensor_parallel_size={tp} (its MoE gradients are reduced over dp*cp*tp, PowerSGD's over dp*cp): "
            "use gradient_compression='none' or 'bf16'."
        )


def check_float8(float8: Optional[str], model_config: Any) -> None:
    """Refuse float8 training (``float8``: ``ParallelConfig.float8``, a recipe name) of a Mixture-of-Experts model
    (``model_config``: a :class:`~lightning_4d.models.llama_config.LlamaConfig`): its grouped expert matmuls are not the
    linears torchao converts (``parallel/float8.py``). Called by ``ParallelConfig.validate_model`` with a recipe set,
    before the dimensions of the dense linears are checked.

    Raises:
        ValueError: ``model_config.num_experts`` > 0.
    """
    if model_config.num_experts > 0:
        raise ValueError(
            f"float8={float8!r} is not supported for a Mixture-of-Experts model (num_experts="
            f"{model_config.num_experts}) yet: its expert matmuls are not linears torchao converts. Use "
            "float8=None."
        )
